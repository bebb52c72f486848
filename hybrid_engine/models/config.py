"""One normalized description of a hybrid model, parsed from a HF `config.json` dict.

Both supported families (NemotronH, GraniteMoeHybrid) and their legacy field spellings map
onto `HybridConfig`; every error names the field that is wrong. Fields that do not change
the model's outputs are not read: e.g. the SSD `chunk_size` / `mamba_chunk_size` (each
kernel blocks its scan its own way, see `KernelOps.ssd_chunk_scan_varlen`).
"""
import math
from dataclasses import dataclass, field
from typing import Any

NEMOTRON_H = "NemotronHForCausalLM"
GRANITE_MOE_HYBRID = "GraniteMoeHybridForCausalLM"
SUPPORTED_ARCHITECTURES = (NEMOTRON_H, GRANITE_MOE_HYBRID)

# Layer kinds: a NemotronH layer is exactly one of these; a Granite layer is a mixer
# ("mamba" or "attention") always followed by its MoE/MLP feed-forward.
_LAYER_ALIASES = {
    "M": "mamba", "mamba": "mamba", "linear_attention": "mamba", "mamba2": "mamba",
    "*": "attention", "attention": "attention", "full_attention": "attention",
    "-": "mlp", "mlp": "mlp",
    "E": "moe", "moe": "moe",
}


class ConfigError(ValueError):
    """A config.json that this engine cannot serve; the message names the field."""


@dataclass
class HybridConfig:
    """Architecture hyper-parameters the engine needs, independent of the checkpoint family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    norm_eps: float
    # attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention_scale: float
    attention_bias: bool = False
    rope_theta: float | None = None
    # mamba-2
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    ssm_state_size: int = 0
    conv_kernel: int = 4
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    # dense MLP (NemotronH "mlp" layers; Granite shared / dense MLP)
    intermediate_size: int = 0
    mlp_bias: bool = False
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None
    # scalars (Granite's multipliers; 1.0 elsewhere)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    @property
    def mamba_d_ssm(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_d_ssm + 2 * self.mamba_n_groups * self.ssm_state_size


def _get(cfg: dict, *names: str, default: Any = KeyError) -> Any:
    """First present spelling of a field; raises ConfigError naming the field if required."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    if default is KeyError:
        raise ConfigError(f"config.json is missing required field {names[0]!r}")
    return default


def _float(value: Any, name: str, *, finite: bool = False, positive: bool = False) -> float:
    """Parse a float that JSON may spell as Infinity, "inf" or {"__float__": "Infinity"}; never NaN.

    `positive` (implies finite) is for epsilons, divisors and values whose log is taken.
    """
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config field {name!r} must be a number, got {value!r}") from None
    if math.isnan(number) or ((finite or positive) and math.isinf(number)):
        raise ConfigError(f"config field {name!r} must be a finite number, got {value!r}")
    if positive and number <= 0:
        raise ConfigError(f"config field {name!r} must be > 0, got {value!r}")
    return number


def _int(cfg: dict, *names: str, default: Any = KeyError) -> int:
    value = _get(cfg, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field {names[0]!r} must be an integer, got {value!r}")
    return value


def _positive(value: int, name: str) -> int:
    if value <= 0:
        raise ConfigError(f"config field {name!r} must be positive, got {value}")
    return value


def _non_negative(value: int, name: str) -> int:
    """A layer width where 0 is a (degenerate) valid model but a negative one is not."""
    if value < 0:
        raise ConfigError(f"config field {name!r} must be >= 0, got {value}")
    return value


def _spelling(cfg: dict, *names: str) -> str:
    """The spelling of a field this config uses (the first one when it has none), for messages."""
    return next((name for name in names if cfg.get(name) is not None), names[0])


def _layer_types(raw: Any, name: str) -> list[str]:
    items = list(raw) if isinstance(raw, (str, list, tuple)) else None
    if not items:
        raise ConfigError(f"config field {name!r} must be a non-empty list or pattern string, got {raw!r}")
    out = []
    for item in items:
        if item not in _LAYER_ALIASES:
            raise ConfigError(f"config field {name!r} has unknown layer type {item!r}")
        out.append(_LAYER_ALIASES[item])
    return out


def _eos_ids(cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _time_step_limit(cfg: dict) -> tuple[float, float]:
    raw = _get(cfg, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise ConfigError(f"config field 'time_step_limit' must be a pair, got {raw!r}")
    low, high = _float(raw[0], "time_step_limit"), _float(raw[1], "time_step_limit")
    if not 0.0 <= low <= high:
        raise ConfigError(f"config field 'time_step_limit' must satisfy 0 <= low <= high, got {list(raw)!r}")
    return low, high


def _time_steps(cfg: dict) -> tuple[float, float]:
    """(time_step_min, time_step_max): the range the initial dt is drawn from (its log is taken)."""
    low = _float(_get(cfg, "time_step_min", "mamba_dt_min", default=0.001), "time_step_min", positive=True)
    high = _float(_get(cfg, "time_step_max", "mamba_dt_max", default=0.1), "time_step_max", positive=True)
    if low > high:
        raise ConfigError(f"config field 'time_step_min' ({low}) must be <= time_step_max ({high})")
    return low, high


def _common(cfg: dict, architecture: str, layer_types: list[str]) -> dict:
    hidden = _positive(_int(cfg, "hidden_size"), "hidden_size")
    # Attention fields are required and checked only when there are attention layers
    # (a made-up head count would only mislead the num_key_value_heads check); head_dim
    # is checked before the default scale is derived from it.
    has_attention = "attention" in layer_types
    heads = _int(cfg, "num_attention_heads", default=KeyError if has_attention else 1)
    head_dim = _int(cfg, "head_dim", default=hidden // max(heads, 1))
    if has_attention:
        _positive(heads, "num_attention_heads")
        _positive(head_dim, "head_dim")
    return dict(
        architecture=architecture,
        vocab_size=_positive(_int(cfg, "vocab_size"), "vocab_size"),
        hidden_size=hidden,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        attention_scale=head_dim ** -0.5 if has_attention else 1.0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_positive(_int(cfg, "max_position_embeddings", default=4096),
                                          "max_position_embeddings"),
        eos_token_ids=_eos_ids(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


def _nemotron_h(cfg: dict) -> HybridConfig:
    if "layers_block_type" in cfg or "layer_types" in cfg:
        name = "layers_block_type" if "layers_block_type" in cfg else "layer_types"
        layer_types = _layer_types(cfg[name], name)
    else:
        layer_types = _layer_types(_get(cfg, "hybrid_override_pattern"), "hybrid_override_pattern")
    hidden = _int(cfg, "hidden_size")
    mamba_heads = _int(cfg, "mamba_num_heads", default=128)
    time_step_min, time_step_max = _time_steps(cfg)
    eps_name = _spelling(cfg, "layer_norm_epsilon", "rms_norm_eps")
    c = HybridConfig(
        **_common(cfg, NEMOTRON_H, layer_types),
        norm_eps=_float(_get(cfg, eps_name, default=1e-5), eps_name, positive=True),
        mamba_num_heads=mamba_heads,
        mamba_head_dim=_int(cfg, "mamba_head_dim", default=64),
        mamba_n_groups=_int(cfg, "n_groups", "mamba_n_groups", default=8),
        ssm_state_size=_int(cfg, "ssm_state_size", "mamba_d_state", default=128),
        conv_kernel=_int(cfg, "conv_kernel", "mamba_d_conv", default=4),
        use_conv_bias=bool(_get(cfg, "use_conv_bias", "mamba_conv_bias", default=True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),
        # transformers' NemotronH ignores time_step_limit and clamps dt >= time_step_min in
        # prefill only; parity with it (the oracle) decides.
        dt_limit=(time_step_min, math.inf),
        time_step_min=time_step_min,
        time_step_max=time_step_max,
        intermediate_size=_non_negative(_int(cfg, "intermediate_size", default=4 * hidden), "intermediate_size"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        num_experts=_int(cfg, "n_routed_experts", "num_local_experts", default=0),
        top_k=_int(cfg, "num_experts_per_tok", default=0),
        moe_intermediate_size=_non_negative(_int(cfg, "moe_intermediate_size", default=0), "moe_intermediate_size"),
        shared_intermediate_size=_non_negative(_int(cfg, "moe_shared_expert_intermediate_size", default=0),
                                               "moe_shared_expert_intermediate_size"),
        n_group=_int(cfg, "n_group", default=1),
        topk_group=_int(cfg, "topk_group", default=1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=_float(cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor", finite=True),
        moe_latent_size=(_positive(_int(cfg, "moe_latent_size"), "moe_latent_size")
                         if cfg.get("moe_latent_size") is not None else None),
    )
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ConfigError(f"config field 'mlp_hidden_act' must be 'relu2' for NemotronH, got {act!r}")
    return c


def _granite(cfg: dict) -> HybridConfig:
    name = "layer_types" if "layer_types" in cfg else "layers_block_type"
    if name in cfg:
        layer_types = _layer_types(cfg[name], name)
    else:
        layer_types = ["mamba"] * _int(cfg, "num_hidden_layers")
    if any(t not in ("mamba", "attention") for t in layer_types):
        raise ConfigError(f"config field {name!r}: GraniteMoeHybrid layers are 'mamba' or 'attention'")
    hidden = _int(cfg, "hidden_size")
    expand = _int(cfg, "mamba_expand", default=2)
    mamba_heads = _int(cfg, "mamba_n_heads", default=128)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = expand * hidden // mamba_heads if d_head in (None, "auto") else d_head
    if not isinstance(d_head, int) or d_head * mamba_heads != expand * hidden:
        raise ConfigError(f"config field 'mamba_d_head' ({d_head!r}) x mamba_n_heads must equal mamba_expand * hidden_size")
    rope_type = cfg.get("position_embedding_type")
    rope_theta = None
    if rope_type == "rope":
        params = cfg.get("rope_parameters") or {}
        kind = params.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
        if kind != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type' {kind!r} is not supported (only 'default')")
        rope_theta = _float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", positive=True)
    elif rope_type not in (None, "nope"):
        raise ConfigError(f"config field 'position_embedding_type' must be 'rope', 'nope' or null, got {rope_type!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' must be 'silu' for GraniteMoeHybrid, got {act!r}")
    common = _common(cfg, GRANITE_MOE_HYBRID, layer_types)
    common["attention_scale"] = _float(cfg.get("attention_multiplier", 1.0), "attention_multiplier", finite=True)
    return HybridConfig(
        **common,
        norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", positive=True),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=rope_theta,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=d_head,
        mamba_n_groups=_int(cfg, "mamba_n_groups", default=1),
        ssm_state_size=_int(cfg, "mamba_d_state", default=256),
        conv_kernel=_int(cfg, "mamba_d_conv", default=4),
        use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_limit=_time_step_limit(cfg),
        intermediate_size=_non_negative(_int(cfg, "shared_intermediate_size", default=0), "shared_intermediate_size"),
        num_experts=_non_negative(_int(cfg, "num_local_experts", default=0), "num_local_experts"),
        top_k=_int(cfg, "num_experts_per_tok", default=0),
        moe_intermediate_size=_non_negative(_int(cfg, "intermediate_size", default=0), "intermediate_size"),
        embedding_multiplier=_float(cfg.get("embedding_multiplier", 1.0), "embedding_multiplier", finite=True),
        residual_multiplier=_float(cfg.get("residual_multiplier", 1.0), "residual_multiplier", finite=True),
        # A divisor of the logits.
        logits_scaling=_float(cfg.get("logits_scaling", 1.0), "logits_scaling", positive=True),
    )


def parse_hf_config(cfg: dict) -> HybridConfig:
    """Normalize a HF config.json dict; raises ConfigError naming the offending field."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not archs and model_type in ("nemotron_h", "granitemoehybrid"):
        archs = [NEMOTRON_H if model_type == "nemotron_h" else GRANITE_MOE_HYBRID]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"config field 'architectures' = {archs!r} (model_type {model_type!r}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    c = _nemotron_h(cfg) if arch == NEMOTRON_H else _granite(cfg)
    _validate(c)
    return c


# The config.json spelling of each checked HybridConfig field, per family (for messages).
_FIELD_NAMES = {
    NEMOTRON_H: dict(mamba_n_groups="n_groups", num_experts="n_routed_experts"),
    GRANITE_MOE_HYBRID: dict(mamba_num_heads="mamba_n_heads", mamba_head_dim="mamba_d_head",
                             mamba_n_groups="mamba_n_groups", ssm_state_size="mamba_d_state",
                             conv_kernel="mamba_d_conv", num_experts="num_local_experts"),
}


def _validate(c: HybridConfig) -> None:
    names = _FIELD_NAMES[c.architecture]

    def check(field_name: str) -> None:
        _positive(getattr(c, field_name), names.get(field_name, field_name))

    if c.attention_layers:
        _positive(c.num_kv_heads, "num_key_value_heads")
        if c.num_attention_heads % c.num_kv_heads:
            raise ConfigError(f"config field 'num_key_value_heads' ({c.num_kv_heads}) must divide "
                              f"num_attention_heads ({c.num_attention_heads})")
    if c.mamba_layers:
        for field_name in ("mamba_num_heads", "mamba_head_dim", "mamba_n_groups", "ssm_state_size", "conv_kernel"):
            check(field_name)
        if c.mamba_num_heads % c.mamba_n_groups:
            raise ConfigError(f"config field {names['mamba_n_groups']!r} must divide the number of Mamba heads")
    needs_experts = "moe" in c.layer_types or (c.architecture == GRANITE_MOE_HYBRID and c.num_experts > 0)
    if needs_experts:
        check("num_experts")
        if not 0 < c.top_k <= c.num_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' must be in [1, {c.num_experts}], got {c.top_k}")
        _positive(c.n_group, "n_group")
        if c.num_experts % c.n_group or not 0 < c.topk_group <= c.n_group:
            raise ConfigError("config fields 'n_group' / 'topk_group' must satisfy topk_group <= n_group | n_experts")

"""Engine settings (the `LLM(...)` keyword arguments) and their device-dependent defaults."""
import dataclasses
import numbers
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from hybrid_engine.spec.config import SpeculativeConfig

# The engine seed seeds torch generators (dummy weights), which take these.
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": None}
# The SSM state pool's dtype ("auto": the checkpoint config's `mamba_ssm_cache_dtype`, else
# float32 -- vLLM's NemotronH rule; float32 is the one known to cost no accuracy).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CHECKPOINT_INTERVAL = 512  # tokens (rounded up to a multiple of kv_block_size)


@dataclass
class EngineConfig:
    """Everything `LLMEngine` is built from; `None` fields get a default for the device."""

    model: str | None = None
    device: str | None = None  # default: "cuda" when available, else "cpu"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    async_scheduling: bool = True
    cuda_graphs: bool = True
    max_num_seqs: int | None = None  # default: 256 on CUDA, 16 on CPU
    max_num_batched_tokens: int | None = None  # default: max(8192 on CUDA / 2048 on CPU, max_num_seqs)
    max_model_len: int | None = None  # default (and most): the model's max_position_embeddings
    kv_block_size: int | None = None  # default: 64 on CUDA, 16 on CPU
    num_kv_blocks: int | None = None  # default: sized from gpu_memory_utilization (CPU: enough for all seqs)
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    load_format: str = "auto"
    inject_rejection_rate: float = 0.0
    # Speculative decoding (off when None): a dict as `SpeculativeConfig.from_dict` takes it.
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    mamba_ssm_cache_dtype: str = "auto"  # resolved by the engine: see `resolve_mamba_ssm_cache_dtype`
    # Prefix caching (docs/cache.md): reuse KV blocks and Mamba state checkpoints across requests.
    enable_prefix_caching: bool = True
    # Mamba state checkpoints the cache may keep (each the size of one request's state);
    # default: 2 per max_num_seqs, fewer on CUDA if they would take over a quarter of the
    # memory left after weights and activations.
    prefix_cache_max_checkpoints: int | None = None
    # Tokens between checkpoints of a long prompt: a multiple of kv_block_size (default:
    # the smallest one >= 512).
    prefix_cache_checkpoint_interval: int | None = None
    # Tensor parallelism (docs/parallel.md): the model sharded over this many processes,
    # one per GPU (gloo processes on CPU); the engine starts and stops the workers itself.
    tensor_parallel_size: int = 1
    # MoE layers hold whole experts per rank instead of a slice of every expert.
    enable_expert_parallel: bool = False

    def resolve(self) -> "EngineConfig":
        """Validate and fill device-dependent defaults (raises ValueError naming the field)."""
        # Types first: the checks below compare values, which for a wrong type either passes
        # silently (True as 1) or fails with a TypeError that names no field.
        converted = _check_field_types(self)
        if converted:
            return dataclasses.replace(self, **converted).resolve()
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        kind, colon, index = device.partition(":")
        if kind not in ("cuda", "cpu") or (colon and (kind == "cpu" or not (index.isascii() and index.isdigit()))):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        if not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}] (a torch generator seed), got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {list(MAMBA_SSM_CACHE_DTYPES)}, "
                             f"got {self.mamba_ssm_cache_dtype!r}")
        on_gpu = torch.device(device).type == "cuda"
        max_num_seqs = _default(self.max_num_seqs, 256 if on_gpu else 16)
        resolved = EngineConfig(
            **{**self.__dict__,
               "device": device,
               "dtype": self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
               "cuda_graphs": self.cuda_graphs and on_gpu,
               "max_num_seqs": max_num_seqs,
               "max_num_batched_tokens": _default(self.max_num_batched_tokens,
                                                  max(8192 if on_gpu else 2048, max_num_seqs)),
               "kv_block_size": _default(self.kv_block_size, 64 if on_gpu else 16),
               "speculative_config": None if self.speculative_config is None
               else SpeculativeConfig.from_dict(self.speculative_config)}
        )
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_block_size"):
            value = getattr(resolved, name)
            if value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if resolved.max_num_batched_tokens < resolved.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode row needs a token)")
        if resolved.max_model_len is not None and resolved.max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got {resolved.max_model_len!r}")
        if resolved.num_kv_blocks is not None and resolved.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {resolved.num_kv_blocks}")
        if not 0.0 < resolved.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {resolved.gpu_memory_utilization}")
        checkpoints = resolved.prefix_cache_max_checkpoints
        if checkpoints is not None and checkpoints < 0:
            raise ValueError(f"prefix_cache_max_checkpoints must be a non-negative integer, got {checkpoints!r}")
        if resolved.prefix_cache_checkpoint_interval is None:
            block = resolved.kv_block_size
            resolved.prefix_cache_checkpoint_interval = -(-DEFAULT_CHECKPOINT_INTERVAL // block) * block
        interval = resolved.prefix_cache_checkpoint_interval
        if interval <= 0 or interval % resolved.kv_block_size:
            raise ValueError(f"prefix_cache_checkpoint_interval must be a positive multiple of kv_block_size "
                             f"({resolved.kv_block_size}), got {interval!r}")
        size = resolved.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if not 0.0 <= resolved.inject_rejection_rate <= 1.0:
            raise ValueError(f"inject_rejection_rate must be in [0, 1], got {resolved.inject_rejection_rate}")
        return resolved

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# What a field of each scalar type accepts, and how an error names it. bool is a subclass of
# int, so True would otherwise pass as an integer or a number; an int is a fine float (1 for
# gpu_memory_utilization), as in vLLM. NumPy's integers and floats count (and become
# Python's: `resolve`).
_TYPE_CHECKS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda value: isinstance(value, bool), "a bool"),
    int: (lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"),
    float: (lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"),
    str: (lambda value: isinstance(value, str), "a string"),
}


def _scalar_type(name: str, annotation: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field annotated `T` or `T | None`."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    optional = type(None) in kinds
    kinds.discard(type(None))
    if len(kinds) != 1 or next(iter(kinds)) not in _TYPE_CHECKS:
        # A new field of another type needs a check of its own (as speculative_config has).
        raise TypeError(f"EngineConfig.{name}: no type check for {annotation}")
    return kinds.pop(), optional


# Read from the annotations, so every field (a new one too) is checked; speculative_config
# is validated by SpeculativeConfig.from_dict.
_FIELD_TYPES: dict[str, tuple[type, bool]] = {
    f.name: _scalar_type(f.name, f.type) for f in fields(EngineConfig) if f.name != "speculative_config"
}


def _check_field_types(config: EngineConfig) -> dict[str, Any]:
    """Raise ValueError naming the first field whose value is not of its annotated type;
    return the fields whose values are of it in another class (a NumPy int, an int for a
    float), converted."""
    converted = {}
    for name, (kind, optional) in _FIELD_TYPES.items():
        value = getattr(config, name)
        accepts, description = _TYPE_CHECKS[kind]
        if not (accepts(value) or (optional and value is None)):
            raise ValueError(f"{name} must be {description}{' or None' if optional else ''}, got {value!r}")
        if value is not None and type(value) is not kind:
            converted[name] = kind(value)
    return converted


def resolve_mamba_ssm_cache_dtype(requested: str, hf_config: dict) -> str:
    """The SSM state pool's dtype name: `requested` unless "auto", then the checkpoint
    config's `mamba_ssm_cache_dtype` (Nemotron-3 configs carry one), else "float32"."""
    if requested != "auto":
        return requested
    value = hf_config.get("mamba_ssm_cache_dtype")
    if value is None or value == "auto":
        return "float32"
    if value not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(f"config field 'mamba_ssm_cache_dtype' must be one of {list(MAMBA_SSM_CACHE_DTYPES[1:])}, "
                         f"got {value!r}")
    return value


def _default(value, default):
    """`value` unless it was left unset (None); an explicit 0 stays 0 and fails validation."""
    return default if value is None else value

"""Build a model from a HF checkpoint directory, a preset, or the embedded default.

Checkpoints: `config.json` plus `model.safetensors` or a sharded set listed in
`model.safetensors.index.json`. Names may use `backbone.` or `model.` prefixes, experts
may be stored per expert or stacked. Every missing, unexpected, mis-shaped or non-finite
(NaN/Inf) tensor, an unreadable file and an index naming a shard outside the directory are
a `CheckpointError` (a ValueError) naming the key or file. `load_format="dummy"` gives
seeded random weights of the real shapes.
The model's layers run the kernel op set they are built with (`load_model(..., ops=...)`).
"""
import json
import logging
import math
import os
from collections import defaultdict

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hybrid_engine.models.base import PER_EXPERT_KEY, HybridForCausalLM
from hybrid_engine.models.config import ConfigError, HybridConfig, parse_hf_config
from hybrid_engine.models.registry import build_model
from layers.kernels import KernelOps, select_ops
from layers.mamba2 import Mamba2Mixer

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its config describes."""


def read_config(path: str) -> dict:
    """The parsed `config.json` of a checkpoint directory."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"no config.json in checkpoint directory {path!r}")
    try:
        with open(config_path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path} is not valid JSON: {e}") from None


def _shard_path(path: str, shard: object, index: str) -> str:
    """The shard file a weight_map entry names; it must lie inside the checkpoint directory
    (an index must not make the loader read files elsewhere, e.g. "../other/x.safetensors").

    The check is on the normalized path, not the symlink-resolved one: the Hugging Face
    cache keeps a snapshot's files as symlinks into a sibling blobs/ directory.
    """
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map entry {shard!r} is not a file name")
    root = os.path.abspath(path)
    file = os.path.abspath(os.path.join(root, shard))
    if os.path.commonpath([root, file]) != root:
        raise CheckpointError(f"{index}: weight_map entry {shard!r} is outside the checkpoint directory {path!r}")
    return file


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not valid JSON: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        return [_shard_path(path, shard, index) for shard in sorted(set(weight_map.values()), key=str)]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _iter_checkpoint(files: list[str]):
    """(name, tensor) of every tensor in `files`; an unreadable file is a CheckpointError naming it."""
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None


# Finiteness is checked in chunks of this many elements, so the boolean scratch stays
# small next to a large embedding or expert stack.
_FINITE_CHECK_CHUNK = 1 << 24


def _first_non_finite_row(tensor: torch.Tensor) -> int | None:
    """Index along dim 0 of the first NaN/Inf in `tensor` (0 for a scalar), None if all finite."""
    if not tensor.is_floating_point():
        return None
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHECK_CHUNK):
        finite = torch.isfinite(flat[start:start + _FINITE_CHECK_CHUNK])
        if not finite.all():
            offset = start + int((~finite).nonzero()[0])
            return offset // (flat.numel() // tensor.shape[0]) if tensor.ndim else 0
    return None


def _target_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers the checkpoint must provide."""
    targets = dict(model.named_parameters())
    persistent = set(model.state_dict().keys())
    targets.update({n: b for n, b in model.named_buffers() if n in persistent})
    return targets


@torch.no_grad()
def load_checkpoint_weights(model: HybridForCausalLM, path: str) -> None:
    """Copy every checkpoint tensor into its parameter (converting dtype), checking coverage."""
    targets = _target_tensors(model)
    loaded: set[str] = set()
    experts: dict[str, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)  # name -> index -> (key, tensor)

    def assign(name: str, tensor: torch.Tensor, source: str, rows: list[str] | None = None) -> None:
        """Copy `tensor` (checkpoint key `source`; `rows`: the key of each stacked expert) into `name`."""
        if name not in targets:
            raise CheckpointError(f"unexpected weight {source!r} in checkpoint (no parameter {name!r} in the model)")
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"weight {source!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)} for {name!r}"
            )
        target.copy_(tensor.to(target.dtype))
        # Checked after the conversion, on the model's device: one pass, and it also
        # catches finite values that overflow a narrower dtype (float32 -> float16).
        bad_row = _first_non_finite_row(target)
        if bad_row is not None:
            key = rows[bad_row] if rows is not None else source
            where = ("" if _first_non_finite_row(tensor) is not None
                     else f" once converted to {target.dtype} (values beyond its range)")
            raise CheckpointError(f"weight {key!r} in checkpoint {path!r} holds NaN or infinite values{where}")
        loaded.add(name)

    for key, tensor in _iter_checkpoint(_safetensors_files(path)):
        name = model.normalize_checkpoint_name(key)
        if name is None:
            continue
        per_expert = PER_EXPERT_KEY.match(name)
        if per_expert:
            experts[f"{per_expert['prefix']}.{per_expert['name']}"][int(per_expert["index"])] = (key, tensor)
        else:
            assign(name, tensor, key)
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise CheckpointError(f"experts of {name!r} are not numbered 0..N-1: found {sorted(by_index)}")
        keys, tensors = zip(*(by_index[i] for i in range(len(by_index))))
        assign(name, torch.stack(tensors), f"{name} (per-expert tensors)", rows=list(keys))

    missing = sorted(set(targets) - loaded)
    if missing == ["lm_head.weight"] and model.config.tie_word_embeddings:
        model.tie_embeddings()
    elif missing:
        raise CheckpointError(f"checkpoint {path!r} is missing weight {missing[0]!r}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


# Below this size dummy weights are drawn on the CPU, so a seed gives the same model on
# every device (the embedded model, test models); above it they are drawn on the model's
# device, since drawing billions of values on the CPU takes minutes.
_CPU_DRAW_MAX_PARAMS = 50_000_000


@torch.no_grad()
def init_dummy_weights(model: HybridForCausalLM, seed: int) -> None:
    """Seeded random weights of the real shapes, scaled like the models' own init."""
    c: HybridConfig = model.config
    device = next(model.parameters()).device
    n_params = sum(p.numel() for p in model.parameters())
    draw_on = torch.device("cpu") if n_params <= _CPU_DRAW_MAX_PARAMS else device
    gen = torch.Generator(device=draw_on).manual_seed(seed)

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=draw_on, dtype=torch.float32)

    def rand(shape) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=draw_on, dtype=torch.float32)

    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.copy_(randn(p.shape) * 0.02)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)  # norm scales
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            heads = mixer.num_heads
            mixer.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
            mixer.D.fill_(1.0)
            dt = torch.exp(rand(heads) * (math.log(c.time_step_max) - math.log(c.time_step_min))
                           + math.log(c.time_step_min)).clamp(min=1e-4)
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            bound = 1.0 / math.sqrt(mixer.conv1d.weight.shape[-1])
            mixer.conv1d.weight.copy_((rand(mixer.conv1d.weight.shape) * 2 - 1) * bound)
    if c.tie_word_embeddings:
        model.tie_embeddings()


def _keep_fp32(model: nn.Module) -> None:
    """Mamba's A_log / D / dt_bias stay float32: tiny and precision-critical."""
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            for name in ("A_log", "D", "dt_bias"):
                getattr(mixer, name).data = getattr(mixer, name).data.float()


def create_model(config: HybridConfig, device: torch.device, dtype: torch.dtype, *,
                 ops: KernelOps) -> HybridForCausalLM:
    """The model on `device` with parameters in `dtype` (placeholders until loaded or
    initialized), its layers running the op set `ops`.

    Built directly on the target device with `dtype` as the default dtype (not meta +
    to_empty, whose first use imports sympy and costs seconds, nor a later `.to(dtype)`,
    which would also cast the float32 buffers: RoPE frequencies, the router bias).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, ops=ops)
    finally:
        torch.set_default_dtype(previous)
    _keep_fp32(model)
    return model.eval()


def load_model(
    hf_config: dict, path: str | None, device: torch.device, dtype: torch.dtype, load_format: str = "auto",
    seed: int = 0, *, ops: KernelOps | None = None,
) -> HybridForCausalLM:
    """Parse the config, build the model and fill its weights from `path` or randomly.

    `ops` is the kernel op set every layer of the model runs; None chooses it for `device`
    (`select_ops`). An engine passes the set it chose, so its model runs exactly that one.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    config = parse_hf_config(hf_config)
    model = create_model(config, device, dtype, ops=ops if ops is not None else select_ops(device))
    if load_format == "dummy" or path is None:
        init_dummy_weights(model, seed)
    else:
        load_checkpoint_weights(model, path)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.1fM parameters, %s, %s)", config.architecture, n_params / 1e6, dtype, device)
    return model

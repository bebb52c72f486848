"""Build a model from a HF checkpoint directory, a preset, or the embedded default.

Checkpoints: `config.json` plus `model.safetensors` or a sharded set listed in
`model.safetensors.index.json`. Names may use `backbone.` or `model.` prefixes, experts
may be stored per expert or stacked. Every missing, unexpected, mis-shaped or non-finite
(NaN/Inf) tensor, an unreadable file and an index naming a shard outside the directory are
a `CheckpointError` (a ValueError) naming the key or file. `load_format="dummy"` gives
seeded random weights of the real shapes.
The model's layers run the kernel op set they are built with (`load_model(..., ops=...)`).
Tensor parallel (`tp`): every rank reads the full checkpoint tensors and keeps its cut of
each (`Shard.cut`, recorded on the parameter); dummy weights are drawn at full size and cut,
so they are the same model at every world size.
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
from layers.parallel import SINGLE, ParallelContext, shard_of

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
    """Copy every checkpoint tensor (this rank's cut of it) into its parameter (converting
    dtype), checking coverage; shapes are checked against the full model's."""
    targets = _target_tensors(model)
    loaded: set[str] = set()
    experts: dict[str, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)  # name -> index -> (key, tensor)

    def assign(name: str, tensor: torch.Tensor, source: str, rows: list[str] | None = None) -> None:
        """Copy `tensor` (checkpoint key `source`; `rows`: the key of each stacked expert) into `name`."""
        if name not in targets:
            raise CheckpointError(f"unexpected weight {source!r} in checkpoint (no parameter {name!r} in the model)")
        target = targets[name]
        shard = shard_of(target)
        expected = _full_shape(target)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(
                f"weight {source!r} has shape {tuple(tensor.shape)}, the model expects {expected} for {name!r}"
            )
        if shard is not None:
            tensor = shard.cut(tensor)
        target.copy_(tensor.to(target.dtype))
        # Checked after the conversion, on the model's device: one pass, and it also
        # catches finite values that overflow a narrower dtype (float32 -> float16).
        bad_row = _first_non_finite_row(target)
        if bad_row is not None:
            if shard is not None and shard.dim == 0:  # the stacked expert it is in the full tensor
                bad_row = shard.full_index(bad_row)
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


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of `param` in the full (world size 1) model."""
    shard = shard_of(param)
    return shard.full_shape(param.shape) if shard is not None else tuple(param.shape)


def _set_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's cut of the full-model tensor `full` into `param`."""
    shard = shard_of(param)
    param.copy_(shard.cut(full) if shard is not None else full)


@torch.no_grad()
def init_dummy_weights(model: HybridForCausalLM, seed: int) -> None:
    """Seeded random weights of the real shapes, scaled like the models' own init.

    Every tensor is drawn at its full (world size 1) shape, in the same order, and cut to
    this rank's share: a rank of a tensor-parallel model holds exactly its part of the
    world-size-1 model of the same seed.
    """
    c: HybridConfig = model.config
    device = next(model.parameters()).device
    n_params = sum(math.prod(_full_shape(p)) for p in model.parameters())
    draw_on = torch.device("cpu") if n_params <= _CPU_DRAW_MAX_PARAMS else device
    gen = torch.Generator(device=draw_on).manual_seed(seed)

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=draw_on, dtype=torch.float32)

    def rand(shape) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=draw_on, dtype=torch.float32)

    for name, p in model.named_parameters():
        if p.ndim >= 2:
            _set_from_full(p, randn(_full_shape(p)) * 0.02)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)  # norm scales
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            heads = _full_shape(mixer.A_log)[0]
            _set_from_full(mixer.A_log, torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
            mixer.D.fill_(1.0)
            dt = torch.exp(rand(heads) * (math.log(c.time_step_max) - math.log(c.time_step_min))
                           + math.log(c.time_step_min)).clamp(min=1e-4)
            _set_from_full(mixer.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            bound = 1.0 / math.sqrt(mixer.conv1d.weight.shape[-1])
            _set_from_full(mixer.conv1d.weight, (rand(_full_shape(mixer.conv1d.weight)) * 2 - 1) * bound)
    if c.tie_word_embeddings:
        model.tie_embeddings()


def _keep_fp32(model: nn.Module) -> None:
    """Mamba's A_log / D / dt_bias stay float32: tiny and precision-critical."""
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            for name in ("A_log", "D", "dt_bias"):
                getattr(mixer, name).data = getattr(mixer, name).data.float()


def create_model(config: HybridConfig, device: torch.device, dtype: torch.dtype, *,
                 ops: KernelOps, tp: ParallelContext = SINGLE) -> HybridForCausalLM:
    """The model (rank `tp.rank`'s share of it) on `device` with parameters in `dtype`
    (placeholders until loaded or initialized), its layers running the op set `ops`.

    Built directly on the target device with `dtype` as the default dtype (not meta +
    to_empty, whose first use imports sympy and costs seconds, nor a later `.to(dtype)`,
    which would also cast what stays float32: RoPE frequencies, NemotronH's router weight
    and bias).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, ops=ops, tp=tp)
    finally:
        torch.set_default_dtype(previous)
    _keep_fp32(model)
    return model.eval()


def load_model(
    hf_config: dict, path: str | None, device: torch.device, dtype: torch.dtype, load_format: str = "auto",
    seed: int = 0, *, ops: KernelOps | None = None, tp: ParallelContext = SINGLE,
) -> HybridForCausalLM:
    """Parse the config, build the model and fill its weights from `path` or randomly.

    `ops` is the kernel op set every layer of the model runs; None chooses it for `device`
    (`select_ops`). An engine passes the set it chose, so its model runs exactly that one.
    `tp`: this process's place in a tensor-parallel group; the model holds its share.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    config = parse_hf_config(hf_config)
    model = create_model(config, device, dtype, ops=ops if ops is not None else select_ops(device), tp=tp)
    if load_format == "dummy" or path is None:
        init_dummy_weights(model, seed)
    else:
        load_checkpoint_weights(model, path)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.1fM parameters, %s, %s)", config.architecture, n_params / 1e6, dtype, device)
    return model

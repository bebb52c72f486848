"""Which tensor-parallel sizes can split a model, and the error for one that cannot.

The layers' sharding rules (`layers/parallel.py` and the layers) need, for world size N:
query heads and Mamba heads divisible by N; KV heads and Mamba groups divisible by N or
dividing it (then replicated); every intermediate size the ranks split divisible by N,
and with expert parallelism the number of experts instead of the experts' intermediate
size. Hidden size and vocabulary never constrain N (the vocabulary is padded).
"""
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_engine.models.config import GRANITE_MOE_HYBRID, HybridConfig


@dataclass(frozen=True)
class _Constraint:
    """A config field (its config.json spelling) whose value must accept the world size."""

    field: str
    value: int
    accepts: Callable[[int, int], bool]  # (value, world size) -> ok


def _divides(value: int, size: int) -> bool:
    return value % size == 0


def _divides_or_replicates(value: int, size: int) -> bool:
    return value % size == 0 or size % value == 0


def _constraints(c: HybridConfig, expert_parallel: bool) -> list[_Constraint]:
    """The fields the model's layers split, in the order they are checked."""
    granite = c.architecture == GRANITE_MOE_HYBRID
    out = []
    if c.attention_layers:
        out += [_Constraint("num_attention_heads", c.num_attention_heads, _divides),
                _Constraint("num_key_value_heads", c.num_kv_heads, _divides_or_replicates)]
    if c.mamba_layers:
        out += [_Constraint("mamba_n_heads" if granite else "mamba_num_heads", c.mamba_num_heads, _divides),
                _Constraint("mamba_n_groups" if granite else "n_groups", c.mamba_n_groups, _divides_or_replicates)]
    if granite or "mlp" in c.layer_types:  # Granite's shared (or dense) MLP is in every layer
        out.append(_Constraint("shared_intermediate_size" if granite else "intermediate_size", c.intermediate_size,
                               _divides))
    if "moe" in c.layer_types or (granite and c.num_experts):
        if expert_parallel:
            out.append(_Constraint("num_local_experts" if granite else "n_routed_experts", c.num_experts, _divides))
        else:
            out.append(_Constraint("intermediate_size" if granite else "moe_intermediate_size",
                                   c.moe_intermediate_size, _divides))
        if not granite:
            out.append(_Constraint("moe_shared_expert_intermediate_size", c.shared_intermediate_size, _divides))
    return out


def tensor_parallel_sizes(config: HybridConfig, expert_parallel: bool, limit: int = 64) -> list[int]:
    """Every tensor_parallel_size in [1, limit] that splits this model."""
    constraints = _constraints(config, expert_parallel)
    return [n for n in range(1, limit + 1) if all(k.accepts(k.value, n) for k in constraints)]


def validate_tensor_parallel(config: HybridConfig, size: int, expert_parallel: bool) -> None:
    """Raise ValueError unless `size` ranks can split the model (naming the first field that
    does not split, its value and the sizes that would); size 1 always can."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    for k in _constraints(config, expert_parallel):
        if not k.accepts(k.value, size):
            mode = " with expert parallelism" if expert_parallel else ""
            allowed = ", ".join(map(str, tensor_parallel_sizes(config, expert_parallel)))
            raise ValueError(f"tensor_parallel_size {size}{mode} cannot split {k.field} ({k.value}): "
                             f"sizes that split this model: {allowed}")

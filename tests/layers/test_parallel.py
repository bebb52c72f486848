"""Tensor-parallel cuts (`layers/parallel.py`) and the validation of tensor_parallel_size
against a model's shapes (`hybrid_engine/models/tensor_parallel.py`); no processes."""
import pytest
import torch

from hybrid_engine.models.config import parse_hf_config
from hybrid_engine.models.tensor_parallel import tensor_parallel_sizes, validate_tensor_parallel
from layers.parallel import ParallelContext, Shard, block_shard, set_shard, shard_of
from tests.models.conftest import GRANITE_DENSE_NOPE, GRANITE_MOE_ROPE, NEMOTRON_LATENT, NEMOTRON_MOE


def _nemotron(**overrides):
    return parse_hf_config(dict(NEMOTRON_MOE, architectures=["NemotronHForCausalLM"], **overrides))


def _granite(base=GRANITE_MOE_ROPE, **overrides):
    return parse_hf_config(dict(base, architectures=["GraniteMoeHybridForCausalLM"], **overrides))


def test_cut_takes_ranges_in_order_and_pads_past_the_full_size():
    full = torch.arange(20).view(10, 2)
    assert Shard(0, ((6, 8), (2, 4)), 10).cut(full)[:, 0].tolist() == [12, 14, 4, 6]
    padded = Shard(0, ((8, 12),), 10)
    assert padded.cut(full).tolist() == [[16, 17], [18, 19], [0, 0], [0, 0]]
    assert padded.full_shape(torch.Size([4, 2])) == (10, 2)
    assert [padded.full_index(i) for i in range(4)] == [8, 9, None, None]
    column = Shard(1, ((1, 2),), 2)
    assert column.cut(full).flatten().tolist() == list(range(1, 20, 2))
    assert column.full_shape(torch.Size([10, 1])) == (10, 2)


def test_fused_pieces_take_the_same_share_of_every_block():
    tp = ParallelContext(rank=1, world_size=2)
    assert tp.shard(0, 4, pieces=(0, 4)) == Shard(0, ((2, 4), (6, 8)), 8)  # [gate | up], 4 rows each
    assert tp.shard(1, 2, unit=3) == Shard(1, ((3, 6),), 6)  # heads of 3 channels
    # Mamba-style blocks of different units: 2 heads x 3 rows, then 1 group x 5 rows.
    assert block_shard(0, 11, [(0, 3, 1, 2), (6, 5, 0, 1)]) == Shard(0, ((3, 6), (6, 11)), 11)
    with pytest.raises(ValueError, match="3 items do not split evenly over 2 ranks"):
        tp.split(3)


def test_split_or_replicate_and_padded_vocabulary():
    # 2 KV heads over 4 ranks: ranks 0, 1 keep head 0, ranks 2, 3 head 1.
    assert [ParallelContext(r, 4).split_or_replicate(2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [ParallelContext(r, 2).split_or_replicate(4) for r in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        ParallelContext(0, 4).split_or_replicate(3)
    # 10 rows over 4 ranks: 3 each, the last rank's two past the end padded.
    assert [ParallelContext(r, 4).padded_shard(10).ranges for r in range(4)] == [((0, 3),), ((3, 6),), ((6, 9),),
                                                                                 ((9, 12),)]


def test_a_whole_cut_is_recorded_as_none():
    p = torch.zeros(4)
    set_shard(p, ParallelContext().shard(0, 4))
    assert shard_of(p) is None
    set_shard(p, ParallelContext(1, 2).shard(0, 8))
    assert shard_of(p) == Shard(0, ((4, 8),), 8)


@pytest.mark.parametrize("config, size, expert_parallel, field", [
    (_nemotron(), 3, False, "num_attention_heads (4)"),
    (_nemotron(num_attention_heads=12, num_key_value_heads=3), 2, False, "num_key_value_heads (3)"),
    (_nemotron(mamba_num_heads=6), 4, False, "mamba_num_heads (6)"),
    (_nemotron(num_attention_heads=12, mamba_num_heads=24, n_groups=4), 6, False, "n_groups (4)"),
    (_nemotron(intermediate_size=47), 2, False, "intermediate_size (47)"),
    (_nemotron(moe_intermediate_size=15), 2, False, "moe_intermediate_size (15)"),
    (_nemotron(moe_shared_expert_intermediate_size=25), 2, False, "moe_shared_expert_intermediate_size (25)"),
    (_nemotron(n_routed_experts=6), 4, True, "n_routed_experts (6)"),
    (_granite(mamba_n_heads=1, mamba_d_head=64, mamba_n_groups=1), 2, False, "mamba_n_heads (1)"),
    (_granite(mamba_expand=3, mamba_n_heads=12, mamba_d_head=8, mamba_n_groups=3), 2, False, "mamba_n_groups (3)"),
    (_granite(shared_intermediate_size=25), 2, False, "shared_intermediate_size (25)"),
    (_granite(intermediate_size=15), 2, False, "intermediate_size (15)"),
    (_granite(num_local_experts=6), 4, True, "num_local_experts (6)"),
])
def test_a_size_that_cannot_split_names_the_field_and_the_sizes_that_can(config, size, expert_parallel, field):
    allowed = tensor_parallel_sizes(config, expert_parallel)
    assert allowed[0] == 1 and size not in allowed
    with pytest.raises(ValueError) as error:
        validate_tensor_parallel(config, size, expert_parallel)
    mode = " with expert parallelism" if expert_parallel else ""
    assert str(error.value) == (f"tensor_parallel_size {size}{mode} cannot split {field}: "
                                f"sizes that split this model: {', '.join(map(str, allowed))}")
    for ok in tensor_parallel_sizes(config, expert_parallel):
        validate_tensor_parallel(config, ok, expert_parallel)


@pytest.mark.parametrize("size", [0, -2, 1.0, True])
def test_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        validate_tensor_parallel(_nemotron(), size, False)


def test_allowed_sizes():
    assert tensor_parallel_sizes(_nemotron(), False) == [1, 2, 4]
    # Expert parallelism does not split the experts' intermediate size, only their number.
    assert tensor_parallel_sizes(_nemotron(moe_intermediate_size=6), False) == [1, 2]
    assert tensor_parallel_sizes(_nemotron(moe_intermediate_size=6), True) == [1, 2, 4]
    assert tensor_parallel_sizes(_granite(GRANITE_DENSE_NOPE), False) == [1, 2, 4]
    # KV heads and groups replicate past their number; the vocabulary never constrains.
    assert tensor_parallel_sizes(_granite(GRANITE_DENSE_NOPE, num_attention_heads=8, mamba_n_heads=16,
                                          mamba_d_head=4), False, limit=8) == [1, 2, 4, 8]
    latent = parse_hf_config(dict(NEMOTRON_LATENT, architectures=["NemotronHForCausalLM"]))
    assert tensor_parallel_sizes(latent, False) == [1]
    validate_tensor_parallel(latent, 1, True)  # expert parallelism at size 1: nothing to split

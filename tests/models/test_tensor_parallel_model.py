"""The tensor- and expert-parallel model: N gloo processes on the CPU each hold their share
of a tiny HF checkpoint and run a prompt then decode steps; rank 0's logits must be the
world-size-1 model's and transformers'. Dummy weights at any N must be the cuts of N=1's."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_engine.models.config import parse_hf_config
from hybrid_engine.models.loader import CheckpointError, create_model, init_dummy_weights, load_model, read_config
from layers.kernels import REFERENCE_OPS
from layers.parallel import SINGLE, ParallelContext, shard_of
from tests.models.conftest import (CHECKPOINTS, GRANITE_DENSE_NOPE, GRANITE_MOE_ROPE, NEMOTRON_LATENT, NEMOTRON_MOE,
                                   SingleSequence, is_hf_oracle, make_hf_checkpoint)

# NEMOTRON_LATENT's 3 attention heads split over no N > 1; this variant's do, and its biases
# (MLP, shared expert, latent projections, Mamba projections) check that each is added once.
NEMOTRON_LATENT_BIAS = dict(NEMOTRON_LATENT, num_attention_heads=4, num_key_value_heads=2, mlp_bias=True,
                            use_bias=True)
MODELS = {
    "nemotron_moe": CHECKPOINTS["nemotron_moe"],  # N=4: KV heads and Mamba groups replicated
    "nemotron_latent_bias": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_LATENT_BIAS),
    "granite_moe_rope": CHECKPOINTS["granite_moe_rope"],  # tied embeddings, attention biases
    "granite_dense_nope": CHECKPOINTS["granite_dense_nope"],  # one Mamba group: the norm spans ranks
}
MOE_MODELS = ("nemotron_moe", "nemotron_latent_bias", "granite_moe_rope")
PROMPT = [5, 17, 33, 9, 41, 12, 7, 28, 3]
DECODE = [11, 40, 6, 22]


def _drive(path: str, tp: ParallelContext) -> torch.Tensor:
    """Logits of the prompt (one prefill chunk) and of each decode token fed after it."""
    seq = SingleSequence(path, tp=tp)
    logits = [seq.feed(PROMPT)]
    logits += [seq.feed([t], decode=True) for t in DECODE]
    return torch.cat(logits)


def _worker(rank: int, world_size: int, store: str, jobs: list[tuple[str, str, bool]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        for name, path, expert_parallel in jobs:
            tp = ParallelContext(rank, world_size, expert_parallel, dist.group.WORLD)
            torch.save(_drive(path, tp), os.path.join(out, f"{name}-{expert_parallel}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """name -> (checkpoint dir, world-size-1 logits, transformers' prompt logits)."""
    out = {}
    for name, spec in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        hf = make_hf_checkpoint(path, spec)
        with torch.no_grad():  # (None: this transformers is no oracle for it, `is_hf_oracle`)
            hf_logits = hf(torch.tensor([PROMPT])).logits[0].float() if is_hf_oracle(hf) else None
        out[name] = (str(path), _drive(str(path), SINGLE), hf_logits)
    return out


def _run_parallel(checkpoints, tmp_path, world_size: int, jobs: list[tuple[str, bool]]) -> None:
    """Run every (model, expert_parallel) job on `world_size` ranks; check each rank's
    logits against the world-size-1 model, rank 0's prompt logits against transformers',
    and expert- against tensor-parallel ones."""
    out = tmp_path / "logits"
    out.mkdir()
    mp.spawn(_worker, args=(world_size, str(tmp_path / "store"), [(n, checkpoints[n][0], ep) for n, ep in jobs],
                            str(out)), nprocs=world_size)
    for name, expert_parallel in jobs:
        _, single, hf = checkpoints[name]
        ranks = [torch.load(out / f"{name}-{expert_parallel}-{r}.pt") for r in range(world_size)]
        torch.testing.assert_close(ranks[0], single, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        if hf is not None:
            torch.testing.assert_close(ranks[0][:len(PROMPT)], hf, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        for other in ranks[1:]:
            torch.testing.assert_close(other, ranks[0], atol=1e-6, rtol=0)
        if expert_parallel:
            tensor_parallel = torch.load(out / f"{name}-False-0.pt")
            torch.testing.assert_close(ranks[0], tensor_parallel, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_two_ranks_match_one(checkpoints, tmp_path):
    _run_parallel(checkpoints, tmp_path, 2, [(n, False) for n in MODELS] + [(n, True) for n in MOE_MODELS])


def test_four_ranks_match_one(checkpoints, tmp_path):
    # nemotron_latent_bias's 6 experts do not split 4 ways: tensor parallel only.
    _run_parallel(checkpoints, tmp_path, 4, [(n, False) for n in MODELS] + [("nemotron_moe", True),
                                                                            ("granite_moe_rope", True)])


def _config(kwargs: dict, architecture: str):
    return parse_hf_config(dict(kwargs, architectures=[architecture]))


@pytest.mark.parametrize("kwargs, architecture", [(NEMOTRON_LATENT_BIAS, "NemotronHForCausalLM"),
                                                  (GRANITE_MOE_ROPE, "GraniteMoeHybridForCausalLM")])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_dummy_weights_are_the_cuts_of_world_size_one(kwargs, architecture, expert_parallel):
    config = _config(kwargs, architecture)
    cpu = torch.device("cpu")
    full = create_model(config, cpu, torch.float32, ops=REFERENCE_OPS)
    init_dummy_weights(full, seed=3)
    full_params = dict(full.named_parameters())
    for rank in range(2):
        model = create_model(config, cpu, torch.float32, ops=REFERENCE_OPS,
                             tp=ParallelContext(rank, 2, expert_parallel))
        init_dummy_weights(model, seed=3)
        params = dict(model.named_parameters())
        assert params.keys() == full_params.keys()
        assert sum(shard_of(p) is not None for p in params.values()) > len(params) // 2
        for name, p in params.items():
            shard = shard_of(p)
            expected = full_params[name] if shard is None else shard.cut(full_params[name])
            assert torch.equal(p, expected), name


def test_pool_shape_is_the_local_share():
    config = _config(NEMOTRON_MOE, "NemotronHForCausalLM")
    for world_size, kv_heads, mamba_heads, groups in ((1, 2, 8, 2), (2, 1, 4, 1), (4, 1, 2, 1)):
        model = create_model(config, torch.device("cpu"), torch.float32, ops=REFERENCE_OPS,
                             tp=ParallelContext(world_size - 1, world_size))
        shape = model.pool_shape()
        assert (shape.num_attention_layers, shape.num_kv_heads, shape.head_dim) == (2, kv_heads, 8)
        assert (shape.num_mamba_layers, shape.mamba_num_heads, shape.mamba_head_dim) == (3, mamba_heads, 8)
        assert (shape.mamba_conv_dim, shape.ssm_state_size) == (mamba_heads * 8 + 2 * groups * 8, 8)
    dense = _config(GRANITE_DENSE_NOPE, "GraniteMoeHybridForCausalLM")
    model = create_model(dense, torch.device("cpu"), torch.float32, ops=REFERENCE_OPS, tp=ParallelContext(3, 4))
    assert (model.pool_shape().num_kv_heads, model.pool_shape().mamba_conv_dim) == (1, 2 * 8 + 2 * 8)


def test_a_model_that_does_not_split_is_refused_when_built():
    config = _config(NEMOTRON_LATENT, "NemotronHForCausalLM")
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 cannot split num_attention_heads \(3\): "
                                         r"sizes that split this model: 1$"):
        create_model(config, torch.device("cpu"), torch.float32, ops=REFERENCE_OPS, tp=ParallelContext(0, 2))


def test_checkpoint_shape_errors_report_the_full_shape(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = checkpoints["nemotron_moe"]
    key = "backbone.layers.0.mixer.in_proj.weight"
    tensors = load_file(os.path.join(path, "model.safetensors"))
    full_shape = tuple(tensors[key].shape)
    tensors[key] = tensors[key][:-1]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(CheckpointError, match=rf"in_proj\.weight.*has shape \({full_shape[0] - 1}, 32\), "
                                              rf"the model expects \({full_shape[0]}, 32\)"):
        load_model(read_config(str(bad)), str(bad), torch.device("cpu"), torch.float32, tp=ParallelContext(1, 2))

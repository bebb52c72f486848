"""scripts/bench_decode.py's floors and routing recorder (decode_floors.py), kernel
attribution (step_kernels.py) and results table, on CPU with tiny models (the script itself
needs a GPU)."""
import itertools
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hybrid_engine import LLM
from layers.kernels import REFERENCE_OPS
from layers.moe import GraniteMoE, NemotronHMoE
from tests.models.conftest import make_hf_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_decode import floor_columns, print_table  # noqa: E402
from decode_floors import (  # noqa: E402
    RoutingRecorder, StepFloors, distinct_experts, expected_distinct_experts, measure_distinct_experts, moe_blocks,
    step_floors, weight_bytes)
from step_kernels import (  # noqa: E402
    GLUE, KERNEL_NAME_CHARS, LAYER, OUTSIDE, RANGE_PREFIX, TOP_KERNELS, UNATTRIBUTED, KernelRun, Span, count_kernels,
    print_kernel_counts, profiled_step, profiler_ranges, report_kernel_counts)
from step_probe import checked_step, finish, start_decoding  # noqa: E402

MOE_CHECKPOINTS = ("nemotron_moe_sharp", "granite_moe_rope_sharp")
DENSE_CHECKPOINT = "granite_dense_nope"
# Checkpoint names of the stacked routed-expert tensors (everything else is read every step).
ROUTED_EXPERT_SUFFIXES = ("experts.up_proj", "experts.down_proj", "block_sparse_moe.input_linear.weight",
                          "block_sparse_moe.output_linear.weight")


@pytest.fixture(scope="module")
def checkpoint_llm(tmp_path_factory):
    """`checkpoint_llm(name)`: a CPU float32 LLM of a tiny checkpoint of tests/models/conftest.py."""
    cache = {}

    def build(name: str) -> LLM:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            make_hf_checkpoint(path, name)
            cache[name] = LLM(model=str(path), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                              cuda_graphs=False)
        return cache[name]
    return build


def old_step_bytes(engine, batch: int, context: int) -> int:
    """The floor the script printed before active-weight floors: every parameter + state,
    except that an input embedding table the LM head does not share counts only `batch`
    of its rows (the rows the step looks up)."""
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.input_embeddings().weight
    if table is not model.lm_head.weight:
        weights -= (table.shape[0] - batch) * table[0].numel() * table.element_size()
    mamba = engine.mamba
    per_seq = (mamba.conv_states[:, 0].numel() * mamba.conv_states.element_size()
               + mamba.ssm_states[:, 0].numel() * mamba.ssm_states.element_size())
    per_token_kv = sum(k[0, 0].numel() * k.element_size() * 2 for k, _ in engine.kv.kv_caches)
    return weights + batch * (2 * per_seq + context * per_token_kv)


@pytest.mark.parametrize("num_experts,top_k,batch", [(4, 2, 2), (6, 3, 3), (5, 1, 4), (8, 2, 1)])
def test_expected_distinct_experts_matches_enumeration(num_experts, top_k, batch):
    """The closed form equals the mean union size over every way `batch` tokens can each
    pick `top_k` distinct experts (all choices equally likely)."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    unions = [len(set().union(*picks)) for picks in itertools.product(choices, repeat=batch)]
    assert expected_distinct_experts(num_experts, top_k, batch) == pytest.approx(statistics.fmean(unions), rel=1e-12)


def test_distinct_experts_hand_count():
    ids = torch.tensor([[0, 3], [3, 1], [0, 1], [7, 3]])
    assert distinct_experts(ids) == 4  # {0, 1, 3, 7}
    assert distinct_experts(ids[:3]) == 3  # {0, 1, 3}: padding rows sliced off are not counted
    assert distinct_experts(ids[:1]) == 2


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_weight_bytes_splits_out_the_routed_experts(checkpoint_llm, name):
    model = checkpoint_llm(name).engine.model
    params = dict(model.named_parameters())
    routed = [p for n, p in params.items() if n.endswith(ROUTED_EXPERT_SUFFIXES)]
    weights = weight_bytes(model)
    assert weights.total == sum(p.numel() * p.element_size() for p in params.values())
    table = params["model.embeddings.weight" if "model.embeddings.weight" in params else "model.embed_tokens.weight"]
    # Neither checkpoint ties its LM head to the table: a step reads 3 of its rows.
    assert "lm_head.weight" in params and weights.lookup_table == table.numel() * table.element_size() > 0
    unread = (table.shape[0] - 3) * table.shape[1] * table.element_size()
    assert weights.non_expert(3) == weights.total - sum(p.numel() * p.element_size() for p in routed) - unread
    assert len(weights.moe_layers) == len(routed) // 2
    top_k = model.config.top_k
    assert all(layer.num_experts == 4 and layer.top_k == top_k for layer in weights.moe_layers)
    # Every expert read: the all-weights bytes; a batch as large as the vocabulary reads the whole table.
    assert weights.active([layer.num_experts for layer in weights.moe_layers], 3) == weights.every_expert(3)
    assert weights.every_expert(3) == weights.total - unread
    assert weights.every_expert(table.shape[0] + 5) == weights.total
    with pytest.raises(ValueError, match="distinct"):
        weights.active([1], 3)


def test_weight_bytes_counts_a_shared_table_whole(checkpoint_llm):
    model = checkpoint_llm("granite_moe_rope").engine.model
    assert model.lm_head.weight is model.input_embeddings().weight  # tied: the LM head reads it all
    weights = weight_bytes(model)
    assert weights.lookup_table == 0
    assert weights.every_expert(1) == weights.total == sum(p.numel() * p.element_size() for p in model.parameters())
    routed = sum(layer.num_experts * layer.expert_bytes for layer in weights.moe_layers)
    assert routed > 0 and weights.non_expert(1) == weights.total - routed


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_moe_active_floor_below_all_weights(checkpoint_llm, name):
    engine = checkpoint_llm(name).engine
    top_k, num_experts = engine.model.config.top_k, engine.model.config.num_experts
    # One token picks exactly top_k distinct experts in every MoE layer.
    distinct = measure_distinct_experts(checkpoint_llm(name), 1, 8)
    assert distinct == [top_k] * len(moe_blocks(engine.model))
    floors = step_floors(engine, 1, 20, distinct)
    assert floors.all_weights == old_step_bytes(engine, 1, 20)
    assert floors.active < floors.all_weights
    assert floors.active == pytest.approx(floors.expected_active)  # at B = 1 the expectation is top_k
    # Three tokens: between top_k and min(E, 3 top_k) per layer; the state bytes grow with B.
    distinct = measure_distinct_experts(checkpoint_llm(name), 3, 8)
    assert all(top_k <= d <= min(num_experts, 3 * top_k) for d in distinct)
    floors = step_floors(engine, 3, 20, distinct)
    assert floors.all_weights == old_step_bytes(engine, 3, 20)
    assert floors.active <= floors.all_weights
    assert not engine.has_unfinished_requests()


def test_dense_floor_unchanged(checkpoint_llm):
    llm = checkpoint_llm(DENSE_CHECKPOINT)
    assert measure_distinct_experts(llm, 2, 8) == []
    floors = step_floors(llm.engine, 2, 20, [])
    assert floors.all_weights == floors.active == floors.expected_active == old_step_bytes(llm.engine, 2, 20)


@pytest.mark.parametrize("make_block", [
    lambda: GraniteMoE(32, 6, 2, 16, ops=REFERENCE_OPS),
    lambda: NemotronHMoE(32, 8, 3, 16, 24, n_group=2, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=1.0, ops=REFERENCE_OPS),
], ids=["granite", "nemotron"])
def test_routing_recorder_keeps_the_routers_ids(make_block):
    torch.manual_seed(0)
    block = make_block()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(5, 32)
    with RoutingRecorder(block) as recorder, torch.no_grad():
        out = block(x)
    assert block.ops is REFERENCE_OPS  # restored
    with torch.no_grad():
        if isinstance(block, GraniteMoE):
            expected = REFERENCE_OPS.route_softmax_topk(x, block.router.layer.weight, block.top_k)[1]
        else:
            expected = REFERENCE_OPS.route_sigmoid_grouped(
                x, block.gate.weight, block.gate.e_score_correction_bias, block.top_k, block.n_group,
                block.topk_group, block.norm_topk_prob, block.routed_scaling_factor)[1]
        assert torch.equal(out, block(x))  # recording changed nothing
    assert len(recorder.ids) == 1 and len(recorder.ids[0]) == 1
    assert torch.equal(recorder.ids[0][0], expected)


def test_profiler_ranges_mark_every_layer_part():
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64, cuda_graphs=False)  # embedded
    engine = llm.engine
    kinds = engine.model.config.layer_types
    ids = start_decoding(engine, 2, 8, "ranges")
    with profiler_ranges(engine.model), profile(activities=[ProfilerActivity.CPU]) as prof:
        checked_step(engine)
    spans = profiled_step(prof.events())[0]
    assert sum(s.kind == LAYER for s in spans) == len(kinds)
    for kind in ("mamba", "attention", "mlp", "moe"):  # the embedded model has each twice or more
        assert sum(s.kind == kind for s in spans) == kinds.count(kind) >= 2
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # hooks removed on exit
        checked_step(engine)
    assert profiled_step(prof.events())[0] == []
    finish(engine, ids)
    assert not engine.has_unfinished_requests()


def test_count_kernels_attributes_by_launch_time():
    S, K = Span, KernelRun
    spans = [S(LAYER, 0, 10), S("mamba", 1, 4), S("moe", 5, 9), S(LAYER, 20, 30), S("mamba", 21, 25)]
    kernels = [K(2, 1.0), K(3, 2.0), K(4.5, 0.5), K(6, 4.0), K(12, 8.0), K(22, 1.5), K(26, 0.25), K(None, 3.0)]
    c = count_kernels(1, 2, spans, kernels, copies=2)
    assert c.kernels == {"mamba": 3, "attention": 0, "moe": 1, "mlp": 0, GLUE: 2, OUTSIDE: 1, UNATTRIBUTED: 1}
    assert c.gpu_us["mamba"] == 4.5 and c.gpu_us[GLUE] == 0.75 and c.gpu_us[OUTSIDE] == 8.0
    assert c.calls["mamba"] == 2 and c.calls["moe"] == 1 and c.calls[GLUE] == 2
    assert c.total == 8 and c.in_layers == 6 and c.copies == 2
    assert c.by_name == {"": (8, 20.25)}  # nameless stand-ins: one entry for all


@pytest.mark.parametrize("moe", [True, False])
def test_table_rows_have_the_header_columns(moe, capsys):
    floors = StepFloors(3e9, 1e9, 1.5e9, (6, 8) if moe else (), (6.0, 7.0) if moe else ())
    cols = floor_columns(floors, bandwidth=1e12, step_ms=2.0)
    assert cols["roofline_ms"] == pytest.approx(3.0) and cols["vs_roofline"] == pytest.approx(2 / 3)
    if moe:
        assert cols["active_floor_ms"] == pytest.approx(1.0) and cols["vs_active_floor"] == pytest.approx(2.0)
        assert cols["distinct_experts_mean"] == 7 and cols["analytic_distinct_experts"] == 6.5
    else:
        assert "active_floor_ms" not in cols
    timed = dict(mode="async+graphs", batch=1, tok_s=100.0, itl_mean_ms=2.0, itl_p50_ms=2.0, itl_p99_ms=2.5,
                 gpu_idle=0.01, **cols)
    print_table([timed, dict(mode="HF transformers generate", batch=1, tok_s=10.0, itl_mean_ms=9.0)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert {line.count("|") for line in lines} == {11 if moe else 7}
    assert ("active-weight floor" in lines[0]) == moe


def _event(name, device, start, end, id=0, linked=0, annotation=False):
    """A stand-in for torch.profiler's FunctionEvent with the fields `profiled_step` reads."""
    device_type = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device_type, time_range=span, id=id, linked_correlation_id=linked,
                           is_user_annotation=annotation)


def test_profiled_step_finds_kernel_launch_times():
    """Kernels get their launch call's host time (same correlation id), else the start of
    the op they are linked to; range annotations on the GPU and copies are not kernels."""
    p = RANGE_PREFIX
    events = [
        _event(p + "layer", "cpu", 0, 10, id=1, annotation=True),
        _event(p + "moe", "cpu", 2, 8, id=2, annotation=True),
        _event("aten::mm", "cpu", 3, 4, id=3),
        _event("cudaLaunchKernel", "cpu", 3.5, 3.6, id=101, linked=3),
        _event("cuLaunchKernelEx", "cpu", 9, 9.1, id=102, linked=1),
        _event("gemm_kernel", "cuda", 20, 25, id=101, linked=3),
        _event("triton_norm", "cuda", 26, 27, id=102, linked=1),
        _event("triton_route", "cuda", 28, 30, id=103, linked=2),  # no launch event: the linked range's start
        _event("lost", "cuda", 31, 32, id=104),  # neither
        _event("Memcpy HtoD (Pinned -> Device)", "cuda", 0, 1, id=105, linked=3),
        _event(p + "moe", "cuda", 20, 30, id=2, annotation=True),
    ]
    spans, kernels, copies = profiled_step(events)
    assert spans == [Span("layer", 0, 10), Span("moe", 2, 8)]
    assert kernels == [KernelRun(3.5, 5, "gemm_kernel"), KernelRun(9, 1, "triton_norm"), KernelRun(2, 2, "triton_route"),
                       KernelRun(None, 1, "lost")]
    assert copies == 1
    c = count_kernels(1, 1, spans, kernels, copies)
    assert (c.kernels["moe"], c.kernels[GLUE], c.kernels[UNATTRIBUTED]) == (2, 1, 1)
    assert c.by_name == {"gemm_kernel": (1, 5), "triton_norm": (1, 1), "triton_route": (1, 2), "lost": (1, 1)}


def test_kernel_table_names_the_kernels_with_the_most_gpu_time(capsys):
    """The by-name table: kernels summed over their launches, the most GPU time first,
    TOP_KERNELS rows per batch; long names clipped when profiled."""
    runs = [KernelRun(1, 2.0, "norm"), KernelRun(2, 5.0, "gemm"), KernelRun(3, 2.5, "norm")]
    runs += [KernelRun(4, 0.1, f"tiny{i}") for i in range(TOP_KERNELS)]
    print_kernel_counts("m", [count_kernels(1, 1, [Span(LAYER, 0, 10)], runs, copies=0)])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "launches" in line) + 2
    rows = lines[start:]
    assert rows[:2] == ["| 1 | gemm | 1 | 5 | 5.00 |", "| 1 | norm | 2 | 4 | 2.25 |"]
    assert len(rows) == TOP_KERNELS
    long_name = _event("void at::native::" + "x" * 200, "cuda", 0, 1, id=7)
    assert profiled_step([long_name])[1][0].name == long_name.name[:KERNEL_NAME_CHARS]


def test_count_kernels_option_skips_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert report_kernel_counts("unused", "unused", [1], 8) == []
    assert "skipped: no CUDA" in capsys.readouterr().out

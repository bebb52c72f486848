"""Decode benchmark: output tok/s, inter-token latency, GPU idle fraction and the memory
floors of a decode step, for our engine in three modes (async + graphs, serial + graphs,
serial eager); `--count-kernels` also counts the CUDA kernels of one eager decode step.

    python scripts/bench_decode.py --model peer --batches 1 8 32 128 256 --prompt-len 256 --output-len 128
    python scripts/bench_decode.py --model preset:nemotron-h-8b --batches 1 8 --hf-batch 8 --json out.json
    python scripts/bench_decode.py --model preset:granite-4.0-h-tiny --batches 1 32 128 --modes async+graphs
    python scripts/bench_decode.py --model preset:granite-4.0-h-tiny --batches 1 32 --count-kernels --modes

`--model peer` is a NemotronH config with the shapes of the Megatron-Core peer harness
(../shared/peers/megatron): hidden 1024, pattern M*-M-M*-M-M*-M-M*-M-, relu2 MLP 4096,
16/4 heads, no RoPE, Mamba-2 32x64 heads, 8 groups, state 128, vocab 32768. Weights are
random (load_format="dummy"), bf16. Each row is the median of `--repeats` timed runs after
a warm-up run; the GPU idle fraction and host time per phase come from `StepProbe` (CUDA
events, no profiler). `--hf-batch N` adds HF transformers' `generate` on the same config.

Floors: the bytes one decode step must move over the device copy bandwidth measured in the
same run. Both count Mamba state read + write per sequence (conv + SSM, all Mamba layers)
and the KV read (mean context x KV bytes per token of the attention layers), plus
- all-weights floor: every parameter (for a dense model the only floor);
- active-weight floor (MoE models): every parameter except the routed experts' stacked
  weights (router, shared expert, mixers, norms, embeddings and LM head stay), plus the
  routed experts the step uses: one eager decode step of the batch (distinct random
  prompts, graph padding rows excluded) with each MoE layer's router output recorded,
  counting distinct experts per layer. The analytic count for uniform routing,
  E * (1 - (1 - k/E)^B), is printed beside the measured one.
`--count-kernels`: one eager decode step per batch (a separate serial, graphs-off LLM of the
same model) under torch.profiler; CUDA kernels per step, per layer and per layer part
(mamba / attention / mlp / moe mixers, the norms and residual adds between them, the work
outside the layers) with their GPU time. Without CUDA it prints why it skipped.
`--modes` with no value skips the timed runs. Prints tables; `--json` also writes the
rows. Numbers and commands: docs/benchmarks.md.
"""
import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.loader import read_config
from hybrid_engine.models.presets import get_preset
from layers.attention import PagedAttention
from layers.mamba2 import Mamba2Mixer
from layers.mlp import Relu2MLP, SwiGLUMLP
from layers.moe import GraniteMoE, NemotronHMoE

PEER_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 32768,
    "hidden_size": 1024, "hybrid_override_pattern": "M*-M-M*-M-M*-M-M*-M-", "intermediate_size": 4096,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "mamba_num_heads": 32,
    "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
    "max_position_embeddings": 4096, "eos_token_id": 2,
}
MODES = {
    "async+graphs": dict(async_scheduling=True, cuda_graphs=True),
    "serial+graphs": dict(async_scheduling=False, cuda_graphs=True),
    "serial eager": dict(async_scheduling=False, cuda_graphs=False),
}
MOE_BLOCKS = (NemotronHMoE, GraniteMoE)


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s (read + write counted), measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3)


# ---- floors ------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks in layer order."""
    return [m for m in model.modules() if isinstance(m, MOE_BLOCKS)]


def routed_expert_weights(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's stacked routed-expert weights (up, down), each [E, ...]."""
    if isinstance(block, NemotronHMoE):
        return block.experts.up, block.experts.down
    return block.input_linear.weight, block.output_linear.weight


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens route to when each token picks `top_k`
    of `num_experts` uniformly and independently: an expert is missed by one token with
    probability 1 - k/E, by all of them with (1 - k/E)^B."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def distinct_experts(ids: torch.Tensor) -> int:
    """Distinct expert ids in a [tokens, k] routing."""
    return int(torch.unique(ids).numel())


@dataclass(frozen=True)
class MoeLayerBytes:
    """One MoE layer's routing shape and the bytes of one routed expert (up + down)."""

    num_experts: int
    top_k: int
    expert_bytes: int


@dataclass(frozen=True)
class WeightBytes:
    """A model's weight bytes: all of them, and the routed experts' per MoE layer."""

    total: int
    moe_layers: tuple[MoeLayerBytes, ...]

    @property
    def non_expert(self) -> int:
        """What every step reads whatever the routing: all but the routed experts (the
        router, the shared expert, mixers, norms, embeddings and LM head included)."""
        return self.total - sum(layer.num_experts * layer.expert_bytes for layer in self.moe_layers)

    def active(self, distinct: Sequence[float]) -> float:
        """Weight bytes of a step in which MoE layer i reads `distinct[i]` routed experts."""
        if len(distinct) != len(self.moe_layers):
            raise ValueError(f"distinct: {len(distinct)} counts for {len(self.moe_layers)} MoE layers")
        return self.non_expert + sum(d * layer.expert_bytes for d, layer in zip(distinct, self.moe_layers))

    def expected_distinct(self, batch: int) -> list[float]:
        """`expected_distinct_experts` of each MoE layer for a decode step of `batch` tokens."""
        return [expected_distinct_experts(layer.num_experts, layer.top_k, batch) for layer in self.moe_layers]


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Split the model's parameters (each shared tensor once) into routed experts and the rest."""
    total = sum(tensor_bytes(p) for p in model.parameters())
    layers = []
    for block in moe_blocks(model):
        up, down = routed_expert_weights(block)
        layers.append(MoeLayerBytes(up.shape[0], block.top_k, (tensor_bytes(up) + tensor_bytes(down)) // up.shape[0]))
    return WeightBytes(total, tuple(layers))


def state_bytes(engine, batch: int, context: int) -> int:
    """Bytes of a decode step's cache traffic: per sequence, the Mamba state (conv + SSM,
    all Mamba layers) read and written, and `context` tokens of KV read (all attention layers)."""
    mamba = engine.mamba
    per_seq_state = tensor_bytes(mamba.conv_states[:, 0]) + tensor_bytes(mamba.ssm_states[:, 0])
    per_token_kv = sum(2 * tensor_bytes(k[0, 0]) for k, _ in engine.kv.kv_caches)
    return batch * (2 * per_seq_state + context * per_token_kv)


@dataclass(frozen=True)
class StepFloors:
    """Bytes one decode step must move at least, three ways (see the module docstring)."""

    all_weights: float
    active: float  # the routed experts measured in a step
    expected_active: float  # the routed experts of `expected_distinct_experts`
    distinct: tuple[int, ...]  # measured distinct experts, per MoE layer
    expected_distinct: tuple[float, ...]


def step_floors(engine, batch: int, context: int, distinct: Sequence[int]) -> StepFloors:
    """The floors of a decode step of `batch` sequences at `context` tokens whose MoE layers
    read `distinct` routed experts each (empty for a dense model: all three floors agree)."""
    weights, state = weight_bytes(engine.model), state_bytes(engine, batch, context)
    expected = weights.expected_distinct(batch)
    return StepFloors(weights.total + state, weights.active(distinct) + state, weights.active(expected) + state,
                      tuple(distinct), tuple(expected))


# ---- requests -----------------------------------------------------------------------------
def random_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`batch` distinct random prompts, the same for the same batch size in every run."""
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def checked_step(engine) -> list:
    """`engine.step()`, raising if the step failed (the engine turns errors into finishes)."""
    outs = engine.step()
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"benchmark step failed: request {failed[0].request_id}: {failed[0].finish_reason}")
    return outs


def start_decoding(engine, batch: int, prompt_len: int, tag: str, max_tokens: int | None = None) -> list[str]:
    """Add `batch` requests with random prompts (and `max_tokens`, default: all the room the
    context leaves) and step until every one is past its prefill and a few decode steps, so
    the next step is decode-only; returns their ids."""
    max_tokens = max_tokens or engine.max_model_len - prompt_len
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, prompt_len, engine.model_config.vocab_size)):
        engine.add_request(rid, prompt, params)
    while any(r.num_computed < len(r.prompt_token_ids) + 4 for r in engine.requests.values()):
        checked_step(engine)
    return ids


def finish(engine, ids: list[str]) -> None:
    """Abort the given requests and step until the engine is empty."""
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


# ---- routing ------------------------------------------------------------------------------
class _RecordingOps:
    """An op set that passes every call through and keeps the expert ids its routers return."""

    def __init__(self, ops, into: list[torch.Tensor]):
        self.inner, self._into = ops, into

    def __getattr__(self, name: str):
        op = getattr(self.inner, name)
        if not name.startswith("route_"):
            return op

        def recorded(*args, **kwargs):
            weights, ids = op(*args, **kwargs)
            self._into.append(ids)
            return weights, ids
        return recorded


class RoutingRecorder:
    """While open, `ids[i]` collects the [tokens, k] expert ids that MoE layer i's router
    returns, one tensor per forward (eager forwards only: a graph replay runs no Python)."""

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.blocks]

    def __enter__(self) -> "RoutingRecorder":
        for block, into in zip(self.blocks, self.ids):
            block.ops = _RecordingOps(block.ops, into)
        return self

    def __exit__(self, *exc) -> None:
        for block in self.blocks:
            block.ops = block.ops.inner


def measure_distinct_experts(llm: LLM, batch: int, prompt_len: int) -> list[int]:
    """Distinct routed experts per MoE layer in one decode step of `batch` requests with
    distinct random prompts ([] for a dense model). That step runs eager even under CUDA
    graphs (so the routers' outputs can be recorded); rows padding it to a graph size are
    not counted."""
    engine, runner = llm.engine, llm.engine.runner
    if not moe_blocks(engine.model):
        return []
    ids = start_decoding(engine, batch, prompt_len, "route")
    launched = []
    launch = runner.launch

    def eager_launch(plan):
        launched.append(plan)
        graphs, runner.graphs = runner.graphs, None
        try:
            return launch(plan)
        finally:
            runner.graphs = graphs

    runner.launch = eager_launch
    try:
        with RoutingRecorder(engine.model) as recorder:
            checked_step(engine)
    finally:
        del runner.launch  # the instance attribute: the class method shows through again
    finish(engine, ids)
    if len(launched) != 1 or launched[0].num_prefill or len(launched[0].sched.decodes) != batch:
        raise RuntimeError(f"expected one decode-only launch of {batch} rows, got {len(launched)} launches")
    if any(len(per_layer) != 1 for per_layer in recorder.ids):
        raise RuntimeError("expected one router call per MoE layer in the recorded step")
    return [distinct_experts(per_layer[0][:batch]) for per_layer in recorder.ids]


# ---- kernels per step ---------------------------------------------------------------------
RANGE_PREFIX = "bench_decode/"
PART_TYPES = (("mamba", Mamba2Mixer), ("attention", PagedAttention), ("moe", MOE_BLOCKS),
              ("mlp", (Relu2MLP, SwiGLUMLP)))
LAYER = "layer"
GLUE, OUTSIDE, UNATTRIBUTED = "norms + residuals (in layers)", "outside layers", "unattributed"
PARTS = tuple(kind for kind, _ in PART_TYPES) + (GLUE, OUTSIDE, UNATTRIBUTED)


def layer_parts(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each decoder layer (kind LAYER) and the outermost mamba / attention / moe / mlp
    modules with their kind (a MoE block's shared-expert MLP is part of the block)."""
    parts = [(layer, LAYER) for layer in model.model.layers]
    inside: set[int] = set()
    for module in model.modules():  # parents come before their children
        kind = next((k for k, types in PART_TYPES if isinstance(module, types)), None)
        if kind is not None and id(module) not in inside:
            parts.append((module, kind))
            inside.update(id(m) for m in module.modules())
    return parts


@contextmanager
def profiler_ranges(model: nn.Module) -> Iterator[None]:
    """While open, each `layer_parts` module's forward runs inside a profiler range named
    RANGE_PREFIX + its kind (forward hooks: the model code is not touched)."""
    open_ranges = []

    def enter(kind: str):
        def hook(module, args):
            rf = torch.autograd.profiler.record_function(RANGE_PREFIX + kind)
            rf.__enter__()
            open_ranges.append(rf)
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for module, kind in layer_parts(model):
        handles += [module.register_forward_pre_hook(enter(kind)), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class Span:
    """A profiler range on the host: the part it names and its start / end (us)."""

    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class KernelRun:
    """One CUDA kernel: the host time (us) it was launched at (None: unknown), its GPU time."""

    launched_at: float | None
    gpu_us: float


def profiled_step(events) -> tuple[list[Span], list[KernelRun], int]:
    """(our ranges, the CUDA kernels, the memcpy + memset count) of torch.profiler events. A
    kernel's launch time is that of its launch call (cudaLaunchKernel, cuLaunchKernelEx...:
    the same correlation id), else the start of the op the profiler links it to."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    spans = [Span(e.name[len(RANGE_PREFIX):], e.time_range.start, e.time_range.end)
             for e in host if e.name.startswith(RANGE_PREFIX)]
    launches = {e.id: e.time_range.start for e in host if e.name.startswith("cu") and "Launch" in e.name}
    # FunctionEvent has linked_correlation_id only in recent torch versions (0: a top-level op).
    ops = {e.id: e.time_range.start for e in host if getattr(e, "linked_correlation_id", 0) == 0}
    kernels, copies = [], 0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation or e.name.startswith(RANGE_PREFIX):
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            copies += 1
            continue
        linked = getattr(e, "linked_correlation_id", 0)
        kernels.append(KernelRun(launches.get(e.id, ops.get(linked) if linked else None), e.time_range.elapsed_us()))
    return spans, kernels, copies


@dataclass(frozen=True)
class KernelCount:
    """The CUDA kernels of one decode step by part (PARTS): how many, their GPU time, and
    how often the part ran in the step."""

    batch: int
    num_layers: int
    calls: dict[str, int]
    kernels: dict[str, int]
    gpu_us: dict[str, float]
    copies: int

    @property
    def total(self) -> int:
        """Kernels in the step."""
        return sum(self.kernels.values())

    @property
    def in_layers(self) -> int:
        """Kernels launched inside the decoder layers."""
        return self.total - self.kernels[OUTSIDE] - self.kernels[UNATTRIBUTED]


def count_kernels(batch: int, num_layers: int, spans: list[Span], kernels: list[KernelRun],
                  copies: int) -> KernelCount:
    """Attribute each kernel to the part whose range holds its launch: a mixer / MLP / MoE
    range, else GLUE inside a layer range, else OUTSIDE (embedding, final norm, LM head,
    sampling, the step's input gathers); UNATTRIBUTED when its launch time is unknown."""
    layers = [s for s in spans if s.kind == LAYER]
    parts = [s for s in spans if s.kind != LAYER]
    counts, gpu_us = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0.0)
    for k in kernels:
        t = k.launched_at
        if t is None:
            kind = UNATTRIBUTED
        else:
            kind = next((s.kind for s in parts if s.start <= t <= s.end), None)
            kind = kind or (GLUE if any(s.start <= t <= s.end for s in layers) else OUTSIDE)
        counts[kind] += 1
        gpu_us[kind] += k.gpu_us
    calls = {kind: sum(s.kind == kind for s in parts) for kind, _ in PART_TYPES}
    calls.update({GLUE: len(layers), OUTSIDE: 1, UNATTRIBUTED: 1})
    return KernelCount(batch, num_layers, calls, counts, gpu_us, copies)


def profile_decode_step(llm: LLM, batch: int, prompt_len: int) -> KernelCount:
    """The kernels of one decode step of `batch` requests, profiled (`llm`: serial, graphs
    off, so the step is one eager forward and sampling)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    ids = start_decoding(engine, batch, prompt_len, "kernels")  # also compiles / autotunes the step's kernels
    torch.cuda.synchronize()
    with profiler_ranges(engine.model), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        checked_step(engine)
        torch.cuda.synchronize()
    finish(engine, ids)
    return count_kernels(batch, len(engine.model.model.layers), *profiled_step(prof.events()))


def print_kernel_counts(model_name: str, counts: list[KernelCount]) -> None:
    """The per-step table, then the per-part table."""
    print(f"\nCUDA kernels of one eager decode step (serial, graphs off), model {model_name}")
    print("| batch | kernels / step | memcpy + memset / step | GPU us / step | kernels / layer (in layers) | "
          "kernels / layer (whole step) |")
    print("|---|---|---|---|---|---|")
    for c in counts:
        print(f"| {c.batch} | {c.total} | {c.copies} | {sum(c.gpu_us.values()):.0f} | "
              f"{c.in_layers / c.num_layers:.1f} | {c.total / c.num_layers:.1f} |")
    print("\n| batch | part | calls | kernels | kernels / call | GPU us | GPU us / call |")
    print("|---|---|---|---|---|---|---|")
    for c in counts:
        for part in PARTS:
            n, calls = c.kernels[part], c.calls[part]
            if n or (calls and part not in (OUTSIDE, UNATTRIBUTED)):
                print(f"| {c.batch} | {part} | {calls} | {n} | {n / max(calls, 1):.1f} | {c.gpu_us[part]:.0f} | "
                      f"{c.gpu_us[part] / max(calls, 1):.1f} |")


def report_kernel_counts(model: str, model_name: str, batches: list[int], prompt_len: int) -> list[dict]:
    """`--count-kernels`: profile one eager decode step per batch on a separate small LLM,
    print the tables, return their rows. Without CUDA: a message and no rows."""
    if not torch.cuda.is_available():
        print("--count-kernels skipped: no CUDA device (it counts CUDA kernels with torch.profiler)")
        return []
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(batches),
              max_model_len=prompt_len + 64, async_scheduling=False, cuda_graphs=False)
    counts = [profile_decode_step(llm, batch, prompt_len) for batch in batches]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    print_kernel_counts(model_name, counts)
    return [dict(mode="kernel count (serial eager)", batch=c.batch, kernels=c.total, copies=c.copies,
                 kernels_per_layer=c.in_layers / c.num_layers, part_calls=c.calls, part_kernels=c.kernels,
                 part_gpu_us=c.gpu_us) for c in counts]


class StepProbe:
    """Instruments an engine for a few decode steps without a profiler.

    GPU idle: a timing event is recorded just before each step's host-to-device copy
    (the first device work of a step) and just after its sample copy (the last). The GPU
    is idle between one step's end and the next step's start whenever the host had not
    yet enqueued the next step; idle fraction = 1 - sum(end_i - start_i) / (end_last -
    start_first). Host phases: wall time the CPU spends in each call of the step loop
    (`wait` is the time blocked on the device).
    """

    PHASES = ("schedule", "prepare", "launch", "wait", "retire", "reconcile")

    def __init__(self, engine):
        self.engine = engine
        self.starts: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []
        self.host = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def _timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[phase] += time.perf_counter() - t0
        return wrapper

    def _event(self, into: list):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        into.append(ev)

    def run(self, steps: int) -> dict:
        """Run `steps` engine steps instrumented; returns idle fraction and host µs per step."""
        engine = self.engine
        runner, buffer = engine.runner, engine.runner.buffer
        sync, launch = buffer.sync, runner.launch

        def probed_sync():
            self._event(self.starts)
            sync()

        def probed_launch(plan):
            handle = launch(plan)
            self._event(self.ends)
            handle.wait = self._timed("wait", handle.wait)
            return handle

        patches = {(buffer, "sync"): probed_sync, (runner, "launch"): self._timed("launch", probed_launch),
                   (runner, "prepare"): self._timed("prepare", runner.prepare),
                   (engine.scheduler, "schedule"): self._timed("schedule", engine.scheduler.schedule),
                   (engine, "_retire"): self._timed("retire", engine._retire),
                   (engine, "_reconcile"): self._timed("reconcile", engine._reconcile)}
        for (obj, name), fn in patches.items():
            setattr(obj, name, fn)
        if engine._inflight is not None:  # the in-flight step's wait was not wrapped
            engine._inflight.wait = self._timed("wait", engine._inflight.wait)
        try:
            for _ in range(steps):
                engine.step()
        finally:
            for obj, name in patches:
                delattr(obj, name)
        torch.cuda.synchronize()
        # The first recorded end may belong to a step launched before probing began.
        pairs = list(zip(self.starts, self.ends[len(self.ends) - len(self.starts):]))
        busy = sum(s.elapsed_time(e) for s, e in pairs)
        wall = pairs[0][0].elapsed_time(pairs[-1][1])
        gaps = sorted((e.elapsed_time(s) for (_, e), (s, _) in zip(pairs, pairs[1:])), reverse=True)
        return dict(gpu_idle=1.0 - busy / wall, gpu_busy_ms_per_step=busy / len(pairs),
                    largest_gaps_ms=[round(g, 3) for g in gaps[:3]],
                    **{f"host_{k}_us": 1e6 * v / steps for k, v in self.host.items()})


def probe_decode(llm: LLM, batch: int, prompt_len: int, steps: int = 96) -> dict:
    """GPU idle fraction and host time per phase over decode-only steps of `batch` requests
    with distinct random prompts (identical greedy rows would all route to the same experts)."""
    engine = llm.engine
    ids = start_decoding(engine, batch, prompt_len, "idle", max_tokens=steps + 16)
    result = StepProbe(engine).run(steps)
    finish(engine, ids)
    return result


def peer_model_dir() -> str:
    """A checkpoint directory holding only the peer-shaped config.json (weights are dummy)."""
    path = tempfile.mkdtemp(prefix="peer-model-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(PEER_CONFIG, f)
    return path


def run_batch(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    """Generate `batch` requests; returns throughput and inter-token latencies."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, engine.model_config.vocab_size)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    first_token_time = start
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.new_token_ids)
            tokens += n
            if o.request_id in last_token_time and n:
                gaps.append((now - last_token_time[o.request_id]) / n)
            elif n:
                first_token_time = now
            last_token_time[o.request_id] = now
    wall = time.perf_counter() - start
    gaps.sort()
    # all_first_token_s: until the last request got its first token (every prompt prefilled).
    return dict(tok_s=tokens / wall, itl_mean_ms=1e3 * statistics.fmean(gaps), itl_p50_ms=1e3 * gaps[len(gaps) // 2],
                itl_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], wall_s=wall,
                all_first_token_s=first_token_time - start)


def run_hf_generate(hf_config: dict, batch: int, prompt_len: int, output_len: int) -> dict:
    """Baseline: HF transformers' `generate` (greedy, random bf16 weights built on the GPU)."""
    import transformers

    arch = hf_config["architectures"][0]
    # transformers' torch Mamba-2 scan materializes [batch, chunks, L, L, heads, state]:
    # 64 GB for the 8B preset at batch 32 x 256 with L = 128, so it runs with 32-token
    # chunks (the same math, blocked finer).
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**hf_config, "chunk_size": 32})
    with torch.device("cuda"):
        model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen).cuda()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    del model
    torch.cuda.empty_cache()
    return dict(tok_s=tokens / wall, wall_s=wall, itl_mean_ms=1e3 * wall / output_len)


def floor_columns(floors: StepFloors, bandwidth: float, step_ms: float) -> dict:
    """A row's floor columns (ms at `bandwidth`) and the step's ratios to them; the active
    floor's only for MoE models."""
    all_ms = 1e3 * floors.all_weights / bandwidth
    cols = dict(roofline_ms=all_ms, vs_roofline=step_ms / all_ms)
    if floors.distinct:
        active_ms = 1e3 * floors.active / bandwidth
        cols.update(active_floor_ms=active_ms, vs_active_floor=step_ms / active_ms,
                    analytic_active_floor_ms=1e3 * floors.expected_active / bandwidth,
                    distinct_experts=list(floors.distinct), distinct_experts_mean=statistics.fmean(floors.distinct),
                    analytic_distinct_experts=statistics.fmean(floors.expected_distinct))
    return cols


def time_modes(args: argparse.Namespace, model: str, bandwidth: float) -> list[dict]:
    """The timed rows: every mode x batch, each with its probe and floors."""
    rows = []
    distinct: dict[int, list[int]] = {}  # per batch: routing does not depend on the mode
    for mode in args.modes:
        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_model_len=args.prompt_len + args.output_len + 64, **MODES[mode])
        for batch in args.batches:
            run_batch(llm, batch, args.prompt_len, 4)  # warm-up: Triton compiles / autotunes per shape
            runs = sorted((run_batch(llm, batch, args.prompt_len, args.output_len) for _ in range(args.repeats)),
                          key=lambda x: x["tok_s"])
            r = runs[len(runs) // 2]  # the median run (host jitter on shared machines moves single runs)
            if batch not in distinct:
                distinct[batch] = measure_distinct_experts(llm, batch, args.prompt_len)
            floors = step_floors(llm.engine, batch, args.prompt_len + args.output_len // 2, distinct[batch])
            probe = probe_decode(llm, batch, args.prompt_len)
            row = dict(mode=mode, batch=batch, **r, **probe, **floor_columns(floors, bandwidth, r["itl_p50_ms"]))
            rows.append(row)
            host = " ".join(f"{k}={probe[f'host_{k}_us']:.0f}" for k in StepProbe.PHASES)
            moe = ""
            if "active_floor_ms" in row:
                moe = (f"  floors all/active {row['roofline_ms']:.3f}/{row['active_floor_ms']:.3f} ms  experts/layer "
                       f"{row['distinct_experts_mean']:.1f} (analytic {row['analytic_distinct_experts']:.1f})  "
                       f"step/active floor {row['vs_active_floor']:.2f}x")
            print(f"{mode:14s} B={batch:4d} {r['tok_s']:9.0f} tok/s  itl mean/p50/p99 {r['itl_mean_ms']:.2f}/"
                  f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms  idle {probe['gpu_idle']:.1%}  gpu busy "
                  f"{probe['gpu_busy_ms_per_step']:.3f} ms/step  largest gaps {probe['largest_gaps_ms']} ms  prefill "
                  f"{r['all_first_token_s']:.3f} s  step/floor {row['vs_roofline']:.2f}x{moe}  host us/step: {host}",
                  flush=True)
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    """The timed rows as one markdown table; MoE models get the active-weight floor columns."""
    moe = any("active_floor_ms" in r for r in rows)
    header = "| mode | batch | output tok/s | ITL mean / p50 / p99 (ms) | GPU idle |"
    header += (" all-weights floor (ms) | active-weight floor (ms) | experts / layer: measured (analytic) |"
               " decode step / all-weights floor | decode step / active floor |" if moe
               else " decode step / roofline floor |")
    print(header)
    print("|---" * header.count(" | ") + "|---|")
    for r in rows:
        if "gpu_idle" not in r:  # the HF baseline: throughput and mean step only
            print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_mean_ms']:.2f} (wall / output len) |"
                  + " |" * (header.count(" | ") - 3))
            continue
        cells = [r["mode"], r["batch"], f"{r['tok_s']:.0f}",
                 f"{r['itl_mean_ms']:.2f} / {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f}", f"{r['gpu_idle']:.1%}"]
        if moe:
            cells += [f"{r['roofline_ms']:.3f}", f"{r['active_floor_ms']:.3f}",
                      f"{r['distinct_experts_mean']:.1f} ({r['analytic_distinct_experts']:.1f})"]
        cells.append(f"{r['vs_roofline']:.2f}x")
        if moe:
            cells.append(f"{r['vs_active_floor']:.2f}x")
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="peer", help="'peer', 'preset:NAME' or a checkpoint directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                    help="timed modes (none: no timed runs, e.g. with --count-kernels)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median run is reported")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="also time HF transformers generate at this batch (0: skip)")
    ap.add_argument("--count-kernels", action="store_true",
                    help="also count the CUDA kernels of one eager decode step per batch, per layer and layer part")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    model = peer_model_dir() if args.model == "peer" else args.model
    bandwidth = copy_bandwidth() if args.modes else None
    rows = time_modes(args, model, bandwidth) if args.modes else []
    if args.hf_batch:
        hf_config = read_config(model) if os.path.isdir(model) else get_preset(model.removeprefix("preset:"))
        r = run_hf_generate(hf_config, args.hf_batch, args.prompt_len, args.output_len)
        rows.append(dict(mode="HF transformers generate", batch=args.hf_batch, **r))
        print(f"HF generate    B={args.hf_batch:4d} {r['tok_s']:9.0f} tok/s  mean step {r['itl_mean_ms']:.2f} ms", flush=True)
    if rows:
        print(f"\nmodel {args.model}, prompt {args.prompt_len}, output {args.output_len}, bf16"
              + (f", copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
        print_table(rows)
    if args.count_kernels:
        rows += report_kernel_counts(model, args.model, args.batches, args.prompt_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""bench_decode.py's `--count-kernels`: the CUDA kernels of one eager decode step under
torch.profiler, attributed to the layer part (mamba / attention / mlp / moe mixers, the
norms and residual adds between them, the work outside the layers) whose profiler range
holds each kernel's host launch, with their GPU time; the same kernels by name; and the
tables that print them.
"""
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from decode_floors import MOE_BLOCKS
from hybrid_engine import LLM
from layers.attention import PagedAttention
from layers.mamba2 import Mamba2Mixer
from layers.mlp import Relu2MLP, SwiGLUMLP
from step_probe import checked_step, finish, start_decoding

RANGE_PREFIX = "bench_decode/"
PART_TYPES = (("mamba", Mamba2Mixer), ("attention", PagedAttention), ("moe", MOE_BLOCKS),
              ("mlp", (Relu2MLP, SwiGLUMLP)))
LAYER = "layer"
GLUE, OUTSIDE, UNATTRIBUTED = "norms + residuals (in layers)", "outside layers", "unattributed"
PARTS = tuple(kind for kind, _ in PART_TYPES) + (GLUE, OUTSIDE, UNATTRIBUTED)
KERNEL_NAME_CHARS = 80
TOP_KERNELS = 12  # rows of the by-name table


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
    """One CUDA kernel: the host time (us) it was launched at (None: unknown), its GPU time,
    its name (clipped to KERNEL_NAME_CHARS: C++ template names run long)."""

    launched_at: float | None
    gpu_us: float
    name: str = ""


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
        kernels.append(KernelRun(launches.get(e.id, ops.get(linked) if linked else None), e.time_range.elapsed_us(),
                                 e.name[:KERNEL_NAME_CHARS]))
    return spans, kernels, copies


@dataclass(frozen=True)
class KernelCount:
    """The CUDA kernels of one decode step by part (PARTS): how many, their GPU time, and
    how often the part ran in the step; and by kernel name: (launches, GPU us)."""

    batch: int
    num_layers: int
    calls: dict[str, int]
    kernels: dict[str, int]
    gpu_us: dict[str, float]
    copies: int
    by_name: dict[str, tuple[int, float]]

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
    by_name: dict[str, tuple[int, float]] = {}
    for k in kernels:
        launches, us = by_name.get(k.name, (0, 0.0))
        by_name[k.name] = (launches + 1, us + k.gpu_us)
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
    return KernelCount(batch, num_layers, calls, counts, gpu_us, copies, by_name)


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
    print(f"\n| batch | kernel (the {TOP_KERNELS} with the most GPU time) | launches | GPU us | GPU us / launch |")
    print("|---|---|---|---|---|")
    for c in counts:
        top = sorted(c.by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
        for name, (launches, us) in top:
            print(f"| {c.batch} | {name} | {launches} | {us:.0f} | {us / launches:.2f} |")


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
                 part_gpu_us=c.gpu_us, kernel_launches_gpu_us=c.by_name) for c in counts]

"""bench_decode.py's `--graph-timeline`: where the time of a decode step goes as it really
runs (the timed LLM: CUDA graphs, launch-ahead where the mode has it), kernel by kernel.

torch.profiler records every kernel of a few decode steps on the device, graph nodes
included. Their durations do not add up to the step: under programmatic dependent launch a
kernel starts while the one before it still runs and waits inside for it, so durations
overlap. Each kernel (and copy) is charged its *marginal* time instead: how far its end
lies past the latest end of everything that started before it (nothing if it ends
earlier), less any time the device sat idle before it started, which is charged to IDLE
(waiting for the host, say). The charges add up to the profiled span, from the first
kernel's start to the last one's end, and a kernel's wait for its predecessor is not
charged to it. The eager `--count-kernels` step's GPU times (each kernel launched alone,
with its ramp) are another measure.
"""
from dataclasses import dataclass

import torch

from hybrid_engine import LLM
from step_kernels import KERNEL_NAME_CHARS
from step_probe import checked_step, finish, start_decoding

PROFILED_STEPS = 20
TIMELINE_ROWS = 15  # kernels per batch in the table, most time first
IDLE = "(device idle: nothing running)"  # the gaps' row; its launches count the gaps


@dataclass(frozen=True)
class DeviceRun:
    """One kernel or copy on the device: its name (clipped to KERNEL_NAME_CHARS) and its
    start and end (us)."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class NameTotals:
    """One kernel name's runs in the profiled steps: how many, their marginal time and their
    durations (us, summed)."""

    launches: int
    marginal_us: float
    busy_us: float


@dataclass(frozen=True)
class Timeline:
    """The profiled decode steps of one batch: their count, span and kernels by name."""

    batch: int
    steps: int
    span_us: float
    by_name: dict[str, NameTotals]

    def per_step(self, value: float) -> float:
        """`value` (a sum over the profiled steps) per step."""
        return value / self.steps


def charge(runs: list[DeviceRun]) -> dict[str, NameTotals]:
    """Each run's marginal time (module docstring), summed by name, and the idle gaps under
    IDLE, in start order."""
    totals: dict[str, NameTotals] = {}

    def add(name: str, marginal: float, busy: float) -> None:
        t = totals.get(name, NameTotals(0, 0.0, 0.0))
        totals[name] = NameTotals(t.launches + 1, t.marginal_us + marginal, t.busy_us + busy)

    latest_end = min((r.start for r in runs), default=0.0)
    for r in sorted(runs, key=lambda r: r.start):
        if r.start > latest_end:
            add(IDLE, r.start - latest_end, 0.0)
        add(r.name, max(0.0, r.end - max(latest_end, r.start)), r.end - r.start)
        latest_end = max(latest_end, r.end)
    return totals


def device_runs(events) -> list[DeviceRun]:
    """The device-side kernels and copies of torch.profiler events."""
    return [DeviceRun(e.name[:KERNEL_NAME_CHARS], e.time_range.start, e.time_range.end) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]


def profile_graph_steps(llm: LLM, batch: int, prompt_len: int, steps: int = PROFILED_STEPS) -> Timeline:
    """`steps` decode steps of `batch` requests on `llm` as it is configured, profiled."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    ids = start_decoding(engine, batch, prompt_len, "timeline", max_tokens=steps + 16)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            checked_step(engine)
        torch.cuda.synchronize()
    finish(engine, ids)
    runs = device_runs(prof.events())
    span = max(r.end for r in runs) - min(r.start for r in runs)
    return Timeline(batch, steps, span, charge(runs))


def print_timeline(mode: str, t: Timeline) -> None:
    """The TIMELINE_ROWS kernels with the most marginal time, then the rest in one row."""
    launches = sum(n.launches for name, n in t.by_name.items() if name != IDLE)
    print(f"\n{mode}, batch {t.batch}: {t.per_step(t.span_us):.1f} us / step over {t.steps} profiled steps, "
          f"{t.per_step(launches):.0f} kernels and copies / step")
    print("| kernel | launches / step | us / step (marginal) | us / launch | busy us / step (durations) |")
    print("|---|---|---|---|---|")
    ranked = sorted(t.by_name.items(), key=lambda item: -item[1].marginal_us)
    rest = ranked[TIMELINE_ROWS:]
    rows = ranked[:TIMELINE_ROWS]
    if rest:
        rows.append((f"({len(rest)} others)", NameTotals(sum(n.launches for _, n in rest),
                                                         sum(n.marginal_us for _, n in rest),
                                                         sum(n.busy_us for _, n in rest))))
    for name, n in rows:
        print(f"| {name} | {t.per_step(n.launches):.1f} | {t.per_step(n.marginal_us):.1f} | "
              f"{n.marginal_us / n.launches:.2f} | {t.per_step(n.busy_us):.1f} |")

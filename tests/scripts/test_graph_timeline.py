"""scripts/graph_timeline.py (bench_decode.py's `--graph-timeline`): the marginal-time
charges and the table on CPU, a profile of graphed decode steps on the GPU."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybrid_engine import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from graph_timeline import (  # noqa: E402
    IDLE, TIMELINE_ROWS, DeviceRun, NameTotals, Timeline, charge, device_runs, print_timeline, profile_graph_steps)
from step_kernels import KERNEL_NAME_CHARS  # noqa: E402


def test_charge_gives_each_kernel_its_marginal_time():
    """Overlapping runs (a dependent launch that starts early and waits) are charged from the
    latest earlier end; a run inside another gets nothing; an idle gap is IDLE's; the
    charges add up to the span."""
    runs = [DeviceRun("norm", 0, 10), DeviceRun("gemm", 2, 15), DeviceRun("tiny", 14, 14.5),
            DeviceRun("gemm", 20, 22), DeviceRun("norm", 21, 30), DeviceRun("copy", 31, 32)]
    totals = charge(runs[::-1])  # any order in: charged in start order
    assert totals == {"norm": NameTotals(2, 10 + 8, 10 + 9), "gemm": NameTotals(2, 5 + 2, 13 + 2),
                      "tiny": NameTotals(1, 0.0, 0.5), "copy": NameTotals(1, 1.0, 1.0),
                      IDLE: NameTotals(2, 5 + 1, 0.0)}
    assert sum(t.marginal_us for t in totals.values()) == 32  # the span: 0 to 32
    assert charge([]) == {}


def _event(name, device, start, end, annotation=False):
    device_type = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)


def test_device_runs_keep_device_kernels_and_copies_only():
    long_name = "void at::native::" + "x" * 200
    events = [_event("aten::mm", "cpu", 0, 5), _event("gemm", "cuda", 1, 4), _event("range", "cuda", 0, 9, True),
              _event("Memcpy HtoD (Pinned -> Device)", "cuda", 0, 1), _event(long_name, "cuda", 4, 6)]
    assert device_runs(events) == [DeviceRun("gemm", 1, 4), DeviceRun("Memcpy HtoD (Pinned -> Device)", 0, 1),
                                   DeviceRun(long_name[:KERNEL_NAME_CHARS], 4, 6)]


def test_timeline_table_ranks_by_marginal_time_and_sums_the_rest(capsys):
    by_name = {f"k{i}": NameTotals(2, float(i), 3.0 * i) for i in range(TIMELINE_ROWS + 3)}
    print_timeline("async+graphs", Timeline(batch=1, steps=2, span_us=400.0, by_name=by_name))
    lines = capsys.readouterr().out.strip().splitlines()
    assert "200.0 us / step over 2 profiled steps" in lines[0] and f"{TIMELINE_ROWS + 3} kernels" in lines[0]
    rows = lines[3:]
    assert len(rows) == TIMELINE_ROWS + 1
    last = TIMELINE_ROWS + 2
    assert rows[0] == f"| k{last} | 1.0 | {last / 2:.1f} | {last / 2:.2f} | {3 * last / 2:.1f} |"
    assert rows[-1] == "| (3 others) | 3.0 | 1.5 | 0.50 | 4.5 |"  # k0, k1, k2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decode_steps_are_charged_in_full():
    llm = LLM(max_num_seqs=4, max_model_len=128)  # the embedded model: launch-ahead, CUDA graphs
    t = profile_graph_steps(llm, batch=2, prompt_len=16, steps=5)
    assert t.steps == 5 and t.span_us > 0
    assert sum(n.marginal_us for n in t.by_name.values()) == pytest.approx(t.span_us)
    assert t.by_name["_logits_argmax_kernel"].launches == 5  # greedy: one argmax per step
    assert sum(n.launches for name, n in t.by_name.items() if name.startswith("Memcpy HtoD")) == 5
    assert not llm.engine.has_unfinished_requests()

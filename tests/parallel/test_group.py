"""TensorParallelGroup's teardown order (no processes needed): NCCL frees a communicator
only once no CUDA graph holding its collectives is left, so shutdown destroys the graphs
registered with the group before it frees the collectives -- the other order hung every
two-GPU run at shutdown."""
import torch

from hybrid_engine.parallel.group import TensorParallelGroup
from layers.parallel import ParallelContext


class _Graphs:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def release(self) -> None:
        self.log.append(f"release {self.name}")


def test_shutdown_stops_workers_then_destroys_graphs_then_frees_collectives(monkeypatch):
    log: list[str] = []
    group = TensorParallelGroup(ParallelContext(0, 2), channel_group=None, device=torch.device("cpu"))
    group.graphs.extend([_Graphs(log, "target"), _Graphs(log, "draft")])
    monkeypatch.setattr(group, "_release_collectives", lambda: log.append("free collectives"))
    group.shutdown(send_stop=lambda: log.append("stop"))
    assert log == ["stop", "release target", "release draft", "free collectives"]
    assert group.graphs == []
    group.shutdown(send_stop=lambda: log.append("stop"))  # idempotent
    assert len(log) == 4


class _ExitedWorker:
    pid = 4242

    def poll(self) -> int:
        return -9


def test_watch_thread_marks_a_dead_worker_and_destroys_the_graphs_before_aborting(monkeypatch):
    """The CUDA driver's watch thread (run here on CPU, with no process group): a worker's
    exit marks the group broken, and the graphs go before the communicator's abort (which
    waits for them)."""
    log: list[str] = []
    group = TensorParallelGroup(ParallelContext(0, 2), channel_group=None, device=torch.device("cpu"))
    group.workers = [_ExitedWorker()]
    group.graphs.append(_Graphs(log, "target"))
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: log.append("abort") or False)
    group._watch_workers()
    assert log == ["release target", "abort"]
    assert group.broken is not None and "rank 1 (pid 4242) exited with code -9" in group.broken
    assert group.graphs == []

"""A tensor-parallel group of processes: starting it from the driver, joining it from a
worker, telling when it broke, and tearing it down.

Rank 0 is the driver: the process that built the `LLM` (or the server). It owns
scheduling and the CPU bookkeeping; ranks 1..N-1 are worker processes that it starts
itself as `python -m hybrid_engine.parallel.worker` (no `if __name__ == "__main__"` guard
needed in the user's script, nothing forked after CUDA is up), each holding one shard of
the model and following the driver's steps (`hybrid_engine/parallel/channel.py`).

Rendezvous on one node: the driver opens a TCPStore on a free port of 127.0.0.1 and hands
it to its workers on their command line; no environment variables are needed. Across
nodes: with `MASTER_ADDR`, `MASTER_PORT` and `WORLD_SIZE` set, every rank joins through
torch.distributed's `env://`; the driver (RANK 0) starts ranks 1..LOCAL_WORLD_SIZE-1 on
its node and each other node runs `python -m hybrid_engine.parallel.worker
--node-rank K --nproc-per-node L` (docs/parallel.md).

Two process groups: the default group (NCCL on CUDA, gloo on CPU) carries the model's
collectives; a gloo group carries the start-up messages and, across nodes, the per-step
messages, waiting without a deadline (a worker idles there between requests). On one
node the step messages go through a shared-memory ring instead (`transport.py`). A
worker that dies breaks the collectives of every rank at once (gloo reports the closed
connection); the driver also polls its local workers before every step, while it waits
for a worker to free a slot of the ring, and after every wait for a step's samples.
NCCL does not notice a dead peer: its kernels wait for it forever, and so would the
driver's wait for that step. So on CUDA a thread of the driver watches its local workers
and aborts the NCCL communicators when one exits, which ends those kernels (their
results are garbage; the engine then fails every request). Every rank aborts its groups
at shutdown too, on CUDA, where destroying them could wait for the other ranks.

NCCL frees a communicator (abort or destroy) only once every CUDA graph that captured
its collectives is destroyed, so each rank's decode graphs (`graphs`) go first: at
shutdown, or from the watch thread when a worker dies.
"""
import dataclasses
import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.parallel.transport import GlooTransport, MessageTransport, SharedMemoryTransport
from layers.parallel import ParallelContext

logger = logging.getLogger(__name__)

# The model's collectives: long enough for a first step that compiles kernels on every rank.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The gloo channel: across nodes a worker waits here for the next step as long as the server idles.
CHANNEL_TIMEOUT = datetime.timedelta(days=365)
# How long shutdown waits for workers to exit by themselves before killing them.
WORKER_EXIT_TIMEOUT_S = 10.0
# How long a failed collective waits for a local worker's exit to explain it.
DEATH_NOTICE_S = 1.0
# How often the driver's watch thread (CUDA) polls its local workers.
WATCH_INTERVAL_S = 0.05
ENV_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
_JOINED_KEY, _ERROR_KEY = "hybrid_engine/joined", "hybrid_engine/error"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ParallelGroupError(RuntimeError):
    """The tensor-parallel group broke: a worker died or a collective failed. The engine
    ends every request with finish_reason "error" and serves no more."""


def uses_env_rendezvous() -> bool:
    """Whether torch.distributed's env:// variables describe the group (multi-node)."""
    return all(os.environ.get(name) for name in ENV_RENDEZVOUS)


@dataclass
class TensorParallelGroup:
    """This process's membership in a tensor-parallel group.

    `context` is what the layers see (rank, world size, expert parallelism, the device
    group); `channel_group` carries the step messages; `workers` are the processes the
    driver started (empty on a worker).
    """

    context: ParallelContext
    channel_group: Any
    device: torch.device
    workers: list[subprocess.Popen] = field(default_factory=list)
    store: Any = None  # the one-node rendezvous store (startup errors travel through it)
    # The per-step messages from the driver (`channel.py`): a shared-memory ring when every
    # rank is on the driver's node, gloo broadcasts across nodes.
    messages: MessageTransport | None = None
    broken: str | None = None  # why the group broke, once it has
    # CUDA graphs (`DecodeGraphs`) that captured this group's collectives: destroyed before
    # the communicators are freed, which NCCL does only once no such graph is left.
    graphs: list[Any] = field(default_factory=list)
    _closed: bool = False
    # Teardown once, from the watch thread or shutdown (re-entrant: a garbage-collected
    # engine's finalizer can run shutdown on whichever thread allocates, the watch thread too).
    _teardown: threading.RLock = field(default_factory=threading.RLock)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def is_driver(self) -> bool:
        return self.context.rank == 0

    # ---- starting and joining -------------------------------------------------------
    @classmethod
    def start(cls, world_size: int, expert_parallel: bool, device: str) -> "TensorParallelGroup":
        """Start the group from the driver (rank 0): launch the workers of this node, join
        the rendezvous with them, and return once every rank is in."""
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 needs torch.distributed uninitialized in this process: "
                               "another tensor-parallel engine is alive (call its shutdown() first), or the "
                               "process group was initialized elsewhere")
        device_type = torch.device(device).type
        on_cuda = device_type == "cuda"
        if on_cuda:
            # Rank r runs on cuda:r of its node: the driver is rank 0.
            if torch.device(device).index not in (None, 0):
                raise ValueError(f"tensor_parallel_size > 1 puts rank r on cuda:r, the driver on cuda:0: "
                                 f"device must be 'cuda' or 'cuda:0', got {device!r}")
            device = "cuda:0"
            if torch.cuda.device_count() < world_size and not uses_env_rendezvous():
                raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs on this node; "
                                 f"{torch.cuda.device_count()} are visible")
        store, rendezvous = None, "env://"
        if uses_env_rendezvous():
            if int(os.environ["WORLD_SIZE"]) != world_size or int(os.environ.get("RANK", "0")) != 0:
                raise ValueError(f"env:// rendezvous: WORLD_SIZE must equal tensor_parallel_size ({world_size}) "
                                 f"and the driver's RANK must be 0, got WORLD_SIZE={os.environ['WORLD_SIZE']} "
                                 f"RANK={os.environ.get('RANK', '0')}")
            # Ranks on this node: LOCAL_WORLD_SIZE, else one per visible GPU (one on CPU).
            local = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE")
                                        or (torch.cuda.device_count() if on_cuda else 1)))
            workers = [_spawn_worker(["--env", "--device-type", device_type], {"RANK": str(r), "LOCAL_RANK": str(r)})
                       for r in range(1, local)]
        else:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=COLLECTIVE_TIMEOUT)
            address = f"127.0.0.1:{store.port}"
            messages = SharedMemoryTransport.create(world_size - 1)
            try:
                workers = [_spawn_worker(["--store", address, "--rank", str(r), "--world-size", str(world_size),
                                          "--device-type", device_type, "--step-messages-fd", str(messages.fd)],
                                         {}, pass_fds=(messages.fd,))
                           for r in range(1, world_size)]
            finally:
                messages.close_fd()  # (each worker has it open now)
            rendezvous = None
        try:
            if store is not None:
                _wait_for_workers(store, workers)
            group = cls._join(0, world_size, expert_parallel, device, store, rendezvous)
        except BaseException:
            _stop(workers, 0.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        group.workers, group.store = workers, store
        group.messages = messages if store is not None else GlooTransport(group.channel_group)
        if on_cuda and workers:
            threading.Thread(target=group._watch_workers, name="tp-worker-watch", daemon=True).start()
        return group

    @classmethod
    def join(cls, rank: int, world_size: int, device_type: str, local_rank: int, store_address: str | None,
             messages_fd: int | None = None) -> tuple["TensorParallelGroup", Any]:
        """Join the group from a worker; returns it and the driver's engine config.
        `messages_fd`: the inherited descriptor of the driver's shared-memory ring of step
        messages (one node)."""
        store = messages = None
        if messages_fd is not None:
            messages = SharedMemoryTransport(messages_fd, reader=rank - 1)
            messages.close_fd()
        if store_address is not None:
            host, port = store_address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
            store.set(f"{_JOINED_KEY}/{rank}", "1")
        device = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
        group = cls._join(rank, world_size, False, device, store, None if store else "env://")
        group.store = store
        group.messages = messages or GlooTransport(group.channel_group)
        config = group.receive_object()
        group.context = ParallelContext(rank, world_size, config.enable_expert_parallel, group.context.group)
        return group, dataclasses.replace(config, device=str(group.device))

    @classmethod
    def _join(cls, rank: int, world_size: int, expert_parallel: bool, device: str, store: Any,
              init_method: str | None) -> "TensorParallelGroup":
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, store=store, rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        channel = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
        context = ParallelContext(rank, world_size, expert_parallel, dist.group.WORLD)
        return cls(context, channel, torch.device(device))

    # ---- small collectives on the channel -------------------------------------------
    def send_object(self, obj: Any) -> None:
        """Driver: send a picklable object to every worker (`receive_object`)."""
        dist.broadcast_object_list([obj], src=0, group=self.channel_group)

    def receive_object(self) -> Any:
        """Worker: the object the driver sent with `send_object`."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.channel_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank has (e.g. free device memory: pools are sized to
        fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel_group)
        return int(t.item())

    def confirm_started(self, error: BaseException | None = None) -> None:
        """Every rank, once its engine is built (or failed to build: `error`): a worker
        leaves its error where the driver finds it (`startup_error`) and exits; the others
        meet in a barrier, which fails on the driver when a worker did not make it, so
        `LLM(...)` fails instead of its first request."""
        if error is None:
            dist.barrier(group=self.channel_group)
        elif self.store is not None:
            self.store.set(f"{_ERROR_KEY}/{self.rank}", f"{type(error).__name__}: {error}")

    def startup_error(self, error: BaseException) -> RuntimeError:
        """Driver: the error to raise when building the group's engines failed with
        `error` -- a worker's own error message if one left it, else `error`."""
        _stop(self.workers, 1.0)
        for rank in range(1, self.world_size):
            key = f"{_ERROR_KEY}/{rank}"
            if self.store is not None and self.store.check([key]):
                return RuntimeError(f"tensor-parallel worker rank {rank} failed to start: "
                                    f"{self.store.get(key).decode(errors='replace')}")
        return RuntimeError(f"tensor-parallel group failed to start: {type(error).__name__}: {error}")

    # ---- health and teardown --------------------------------------------------------
    def check_workers(self) -> None:
        """Driver: raise ParallelGroupError if the group broke or a local worker exited."""
        if self.broken is None:
            self.broken = self._worker_exit()
        if self.broken is not None:
            raise ParallelGroupError(self.broken)

    def _worker_exit(self) -> str | None:
        """Which local worker has exited, if one has."""
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {worker.pid}) exited with code {code}"
        return None

    def _watch_workers(self) -> None:
        """Driver on CUDA, a thread of its own: once a local worker exits, mark the group
        broken and abort the device collectives, so that no kernel (nor the driver's wait
        for a step) waits for the dead rank. (Local workers only: a rank on another node
        that dies leaves NCCL waiting, as in any NCCL program.)"""
        while not self._closed:
            exit_ = self._worker_exit()
            if exit_ is not None and not self._closed:  # (not a worker that shutdown stopped)
                self.broken = self.broken or exit_
                try:
                    self._abort_device_collectives()
                except Exception:  # (the main thread then fails on the broken group)
                    logger.exception("aborting the collectives after a worker's exit failed")
                return
            time.sleep(WATCH_INTERVAL_S)

    def _abort_device_collectives(self) -> None:
        """The watch thread: destroy the graphs, then abort the NCCL communicator. Its
        kernels quit at once, the graphs they ran in are freed as they end, and the abort
        returns then (it waits for those graphs). The main thread may be waiting for that
        step, or blocked in a collective of an eager step: it waits for this abort, then
        fails on the broken group. Not `_abort_process_group`, which would wait holding the
        interpreter lock."""
        with self._teardown:
            self._release_graphs()
            if dist.is_initialized():
                dist.group.WORLD._get_backend(self.device).abort()

    def _release_graphs(self) -> None:
        for graphs in self.graphs:
            graphs.release()
        self.graphs.clear()

    def _release_collectives(self) -> None:
        """Free this rank's process groups, once, whichever thread comes first. On CUDA they
        are aborted, not destroyed: an abort waits for no other rank (NCCL's teardown of a
        healthy group may wait for every rank's; of a broken one, forever) and ends kernels
        still waiting for a dead rank."""
        with self._teardown:
            if not dist.is_initialized():
                return
            if self.device.type == "cuda":
                dist.distributed_c10d._abort_process_group()  # (every group, the default one included)
            else:
                dist.destroy_process_group()

    def mark_broken(self, error: BaseException) -> None:
        """A collective or a step message failed mid-step: the ranks are out of step for
        good. Records why (a dead worker's exit, if one is known)."""
        if self.broken is not None:
            return
        # A collective usually fails because a peer died: give its exit a moment to show.
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            try:
                self.check_workers()
            except ParallelGroupError:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self.broken = f"a tensor-parallel collective failed: {type(error).__name__}: {error}"

    def shutdown(self, send_stop: Any = None) -> None:
        """Stop the workers (driver: `send_stop()` tells them, when the group is healthy),
        destroy the CUDA graphs holding the group's collectives, free the process groups,
        then wait for the workers to exit (killing them after a while). A worker calls it
        at its end. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if send_stop is not None and self.broken is None:
            try:
                send_stop()
            except Exception as error:  # a worker already gone: it is killed below
                logger.warning("could not tell the tensor-parallel workers to stop: %s", error)
                self.broken = f"could not tell the workers to stop: {type(error).__name__}: {error}"
        with self._teardown:
            self._release_graphs()
        # Before waiting for the workers: they free theirs once told to stop, and NCCL's
        # teardown of a healthy group may wait for every rank's.
        self._release_collectives()
        _stop(self.workers, WORKER_EXIT_TIMEOUT_S if self.broken is None else 0.1)


def _stop(workers: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` s for each worker to exit, then kill it; close its stdin (the
    pipe whose end tells a worker its driver is gone)."""
    for worker in workers:
        try:
            worker.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        if worker.stdin is not None:
            worker.stdin.close()


def _wait_for_workers(store: Any, workers: list[subprocess.Popen]) -> None:
    """Driver: wait until every worker has reached the store; a worker that exits first
    fails the start at once (not after the rendezvous timeout)."""
    keys = [f"{_JOINED_KEY}/{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, worker in enumerate(workers, start=1):
            if worker.poll() is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code {worker.returncode} "
                                   f"before joining (its stderr says why)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not join within {COLLECTIVE_TIMEOUT}")
        time.sleep(0.01)


def _spawn_worker(args: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start one worker process running `hybrid_engine.parallel.worker`; the package root
    goes first on its PYTHONPATH so it imports the same code as the driver."""
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    # stdin is a pipe the worker watches: its end means the driver process is gone.
    # start_new_session: a terminal's Ctrl-C reaches the driver only (which decides).
    return subprocess.Popen([sys.executable, "-m", "hybrid_engine.parallel.worker", "--watch-stdin", *args],
                            env=child_env, stdin=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds)


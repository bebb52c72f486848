"""A tensor-parallel worker process: `python -m hybrid_engine.parallel.worker`.

The driver starts one per rank 1..N-1 of its node (`TensorParallelGroup.start`), passing
the rendezvous on the command line (`--store HOST:PORT --rank R --world-size N`) or, in a
multi-node group, in torch.distributed's env:// variables (`--env`). On another node,
`--node-rank K --nproc-per-node L` starts that node's L ranks (RANK = K * L + i,
LOCAL_RANK = i) with the env:// variables the user set (docs/parallel.md).

A worker receives the driver's engine config, builds the same engine around its shard of
the model (the same pool sizes, the same CUDA graphs, captured in step with the other
ranks), then follows the driver's steps (`channel.follow`) until told to stop. It exits
when the driver's process is gone (the stdin pipe the driver holds closes), or on any
error, which the driver sees as a broken group (or, while starting, as the error of
`LLM(...)` itself, naming the rank).
"""
import argparse
import logging
import os
import subprocess
import sys
import threading

import torch


def _exit_when_stdin_closes() -> None:
    """Exit as soon as the driver process is gone, however it went: the driver holds the
    other end of this worker's stdin pipe, and the pipe reads EOF once it is closed. (The
    file descriptor is read directly: a thread blocked in `sys.stdin.buffer.read` holds the
    buffer's lock, and a worker that exits normally then dies at interpreter shutdown with
    "Fatal Python error: could not acquire lock for <stdin>".)"""
    fd = sys.stdin.fileno()

    def watch() -> None:
        while os.read(fd, 1 << 16):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def run_rank(rank: int, world_size: int, local_rank: int, store: str | None, device_type: str,
             messages_fd: int | None = None) -> None:
    """Join the group as `rank`, build the engine, follow the driver's steps (`messages_fd`:
    the inherited descriptor of the driver's shared-memory ring of step messages, one node)."""
    from hybrid_engine.engine import LLMEngine
    from hybrid_engine.parallel.channel import follow
    from hybrid_engine.parallel.group import TensorParallelGroup

    group, config = TensorParallelGroup.join(rank, world_size, device_type, local_rank, store, messages_fd)
    if config.device.startswith("cpu"):
        # Ranks share the node's cores: one rank per core group, not all ranks on all cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        engine = LLMEngine(config, group=group)
    except BaseException as error:
        group.confirm_started(error)  # the driver raises it, naming this rank
        group.shutdown()
        raise
    group.confirm_started()
    targets = {0: engine.device_op_targets()}
    if engine.draft_engine is not None:
        targets[1] = engine.draft_engine.device_op_targets()
    try:
        follow(group, targets)
    finally:  # (the graphs go before the communicator, or its teardown at exit waits for them)
        group.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="hybrid-engine tensor-parallel worker (started by the driver)")
    p.add_argument("--store", help="HOST:PORT of the driver's TCPStore (one node)")
    p.add_argument("--rank", type=int)
    p.add_argument("--world-size", type=int)
    p.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the driver's device type (default: cuda when available)")
    p.add_argument("--step-messages-fd", type=int,
                   help="inherited descriptor of the driver's shared-memory ring of step messages (one node)")
    p.add_argument("--env", action="store_true", help="rendezvous through env:// (RANK, WORLD_SIZE, MASTER_ADDR, ...)")
    p.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes (the driver is gone)")
    p.add_argument("--node-rank", type=int, help="start this node's ranks of a multi-node group (env://)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (with --node-rank)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[tp worker %(process)d] %(levelname)s %(name)s: %(message)s")
    if args.node_rank is not None:
        _start_node(args.node_rank, args.nproc_per_node, args.device_type)
        return
    if args.watch_stdin:
        _exit_when_stdin_closes()
    if args.env:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run_rank(rank, world, int(os.environ.get("LOCAL_RANK", rank)), None, args.device_type)
    else:
        run_rank(args.rank, args.world_size, args.rank, args.store, args.device_type, args.step_messages_fd)


def _start_node(node_rank: int, nproc: int, device_type: str) -> None:
    """Start `nproc` env:// ranks of node `node_rank` and wait for them; exit with the
    first non-zero code."""
    if not nproc or nproc < 1:
        raise SystemExit("--node-rank needs --nproc-per-node N (N >= 1)")
    if node_rank < 1:
        raise SystemExit("--node-rank must be >= 1: node 0 is the driver's, which starts its own ranks")
    procs = []
    for local in range(nproc):
        env = dict(os.environ, RANK=str(node_rank * nproc + local), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(nproc))
        procs.append(subprocess.Popen([sys.executable, "-m", "hybrid_engine.parallel.worker", "--env",
                                       "--device-type", device_type], env=env))
    codes = [proc.wait() for proc in procs]
    raise SystemExit(next((code for code in codes if code), 0))


if __name__ == "__main__":
    main()

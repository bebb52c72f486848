"""How long a tensor-parallel step message takes to reach the workers, per transport
(hybrid_engine/parallel/transport.py): the shared-memory ring against gloo broadcasts.

The driver process sends `--messages` messages of `--bytes` bytes, one every
`--interval-ms` (a decode step's cadence), to `--workers` worker processes. Each message
carries its send time (CLOCK_MONOTONIC, shared by the processes of one machine); each
worker records when it had the whole message. Printed per transport: the driver's time
inside `send` and the one-way latency to the last worker (p50 / p99, microseconds).

    python scripts/bench_step_messages.py --workers 1 3 --bytes 300 65536
"""
import argparse
import multiprocessing
import os
import sys
import time

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid_engine.parallel.transport import GlooTransport, SharedMemoryTransport  # noqa: E402


def _open(kind: str, rank: int, world: int, port: int, ring: str | None):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if kind == "gloo":
        return GlooTransport(dist.group.WORLD)
    return SharedMemoryTransport(os.open(ring, os.O_RDWR), reader=rank - 1)  # (the driver's fd, via /proc)


def _worker(kind: str, rank: int, world: int, port: int, ring: str | None, count: int, results) -> None:
    pipe = _open(kind, rank, world, port, ring)
    dist.barrier()
    arrivals = []
    for _ in range(count):
        message = pipe.receive()
        arrivals.append(time.perf_counter_ns() - int(message[:8].view(np.int64)[0]))
    results.put((rank, arrivals))
    dist.barrier()
    dist.destroy_process_group()


def run(kind: str, workers: int, size: int, count: int, interval_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(driver's send times, one-way latencies to the last worker), nanoseconds."""
    world = workers + 1
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ring = SharedMemoryTransport.create(workers) if kind == "shm" else None
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ring_path = ring and f"/proc/{os.getpid()}/fd/{ring.fd}"  # (Linux)
    procs = [context.Process(target=_worker, args=(kind, r, world, store.port, ring_path, count, results))
             for r in range(1, world)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=world)
    pipe = ring or GlooTransport(dist.group.WORLD)
    dist.barrier()
    if ring is not None:
        ring.close_fd()
    message = np.zeros(max(size, 8), dtype=np.uint8)
    sends = []
    for _ in range(count):
        start = time.perf_counter_ns()
        message[:8] = np.array([start], dtype=np.int64).view(np.uint8)
        pipe.send(message)
        sends.append(time.perf_counter_ns() - start)
        time.sleep(interval_s)
    arrivals = [results.get(timeout=60)[1] for _ in procs]
    dist.barrier()
    dist.destroy_process_group()
    for p in procs:
        p.join(timeout=60)
    return np.array(sends), np.max(np.array(arrivals), axis=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    p.add_argument("--bytes", type=int, nargs="+", default=[300, 65536])
    p.add_argument("--messages", type=int, default=500)
    p.add_argument("--interval-ms", type=float, default=1.0)
    args = p.parse_args()
    print("| transport | workers | bytes | driver's send p50 / p99 (us) | to the last worker p50 / p99 (us) |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        for size in args.bytes:
            for kind in ("shm", "gloo"):
                sends, latency = run(kind, workers, size, args.messages, args.interval_ms / 1e3)
                sends, latency = sends[args.messages // 10:] / 1e3, latency[args.messages // 10:] / 1e3  # (warm)
                print(f"| {kind} | {workers} | {size} | {np.percentile(sends, 50):.1f} / {np.percentile(sends, 99):.1f}"
                      f" | {np.percentile(latency, 50):.1f} / {np.percentile(latency, 99):.1f} |", flush=True)


if __name__ == "__main__":
    main()

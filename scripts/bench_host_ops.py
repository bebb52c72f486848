"""Host-side costs that the unit tests do not time: KV block allocate/free churn in a small
and in a huge half-full pool (O(1) means the two per-operation costs match; a scan of the
free list would make the big pool ~10^4 times slower), and building the embedded byte
tokenizer (paid by every `LLM()` of the embedded model).

    python scripts/bench_host_ops.py

Prints figures only; nothing is asserted.
"""
import argparse
import time

import torch

from cache.kv_cache import KVBlockAllocator
from hybrid_engine.tokenizer import build_byte_tokenizer


def best_of(fn, repeats: int) -> float:
    """Fastest of `repeats` wall-clock runs of `fn`, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def churn_us(num_blocks: int, rounds: int, repeats: int) -> float:
    """Microseconds per allocate(2) + free of those 2 blocks, in a half-full pool of `num_blocks`."""
    kv = KVBlockAllocator(num_blocks, 16, 0, 1, 1, torch.float32, torch.device("cpu"))
    kv.allocate(num_blocks // 2)

    def churn() -> None:
        for _ in range(rounds):
            kv.release(kv.allocate(2))

    return best_of(churn, repeats) / rounds * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool-sizes", type=int, nargs="+", default=[100, 1_000_000])
    p.add_argument("--rounds", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for size in args.pool_sizes:
        cost = churn_us(size, args.rounds, args.repeats)
        print(f"kv allocate(2)+free, pool {size:>9,} blocks (half full): {cost:.3f} us")
    build_byte_tokenizer()  # warm imports
    print(f"build_byte_tokenizer(): {best_of(build_byte_tokenizer, args.repeats) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

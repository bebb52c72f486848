#!/usr/bin/env python
"""Load generator for the OpenAI-compatible server (a benchmark, not a test).

Sends `--num-requests` streamed completions with random token-id prompts of exactly
`--prompt-len` tokens and exactly `--output-len` generated tokens (ignore_eos), at most
`--concurrency` at once, arriving as a Poisson process of `--request-rate` per second
(inf: all at once), after `--warmup-requests` untimed ones, from `--client-processes`
processes (one Python client saturates its core at ~5-10k streamed chunks/s, so the
default is one per 32 concurrent streams). Reports request throughput,
output tokens/s, time to first token, the gaps between streamed chunks (ITL; a chunk holds
several tokens when the server fell behind and merged them) percentiles, and the mean time
per output token after the first (TPOT).

    python scripts/serve_hybrid.py --port 8000 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 --num-requests 200
"""
import argparse
import asyncio
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

# Token ids drawn for prompts: printable ASCII for the embedded byte tokenizer, and
# ordinary (non-special) ids for real vocabularies.
PROMPT_IDS = range(32, 127)
# How long a client process waits for the others to be ready (start-up, imports).
BARRIER_TIMEOUT_S = 120.0


@dataclass
class Result:
    """One request's measurements (times in seconds from its start)."""

    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> Result:
    """Stream one completion and time its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return Result(ok=False, error=event["error"]["message"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if any(c["text"] for c in event["choices"]):
                    arrivals.append(time.perf_counter() - start)
    except httpx.HTTPError as exc:
        return Result(ok=False, error=f"{type(exc).__name__}: {exc}")
    if not arrivals:
        return Result(ok=False, error="no text streamed")
    return Result(ok=True, latency=time.perf_counter() - start, ttft=arrivals[0],
                  chunk_gaps=[b - a for a, b in zip(arrivals, arrivals[1:])], output_tokens=tokens)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank; NaN when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass(frozen=True)
class Share:
    """The part of the workload one client process sends."""

    concurrency: int
    num_requests: int
    request_rate: float
    warmup_requests: int
    seed: int


def shares(args: argparse.Namespace) -> list[Share]:
    """The timed workload split over `--client-processes` (concurrency, requests and rate
    divided as evenly as they go; the warm-up is the parent's, before the split)."""
    n = args.client_processes

    def part(total: int, i: int) -> int:
        return total // n + (i < total % n)

    return [Share(part(args.concurrency, i), part(args.num_requests, i), args.request_rate / n, 0, args.seed + 1 + i)
            for i in range(n)]


@dataclass
class Timed:
    """One share's results and the `time.perf_counter()` stamps of its timed part (one
    clock for every process of the machine, so shares' stamps compare)."""

    results: list[Result]
    start: float
    end: float
    model: str


async def run(args: argparse.Namespace, share: Share, ready: Callable[[], object] | None = None) -> Timed:
    """Fire one share of the workload after its warm-up; `ready` (blocking) is called with
    the client set up, right before the clock starts."""
    rng = random.Random(share.seed)
    limits = httpx.Limits(max_connections=share.concurrency, max_keepalive_connections=share.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(share.concurrency)

        async def gated(prompt: list[int]) -> Result:
            async with gate:
                return await one_request(client, model, prompt, args.output_len)

        # Untimed: the server's first requests compile and autotune kernels for new shapes.
        await asyncio.gather(*(gated([rng.choice(PROMPT_IDS) for _ in range(args.prompt_len)])
                               for _ in range(share.warmup_requests)))
        if ready is not None:
            await asyncio.to_thread(ready)
        tasks = []
        start = time.perf_counter()
        for _ in range(share.num_requests):
            prompt = [rng.choice(PROMPT_IDS) for _ in range(args.prompt_len)]
            tasks.append(asyncio.create_task(gated(prompt)))
            if share.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(share.request_rate))
        results = await asyncio.gather(*tasks)
        return Timed(results, start, time.perf_counter(), model)


def client_process(args: argparse.Namespace, share: Share, barrier, out: multiprocessing.Queue) -> None:
    """A client process: its share, started together with the others' (`barrier`), its
    `Timed` put on `out`; a failure is reported as every one of its requests failing."""
    try:
        out.put(asyncio.run(run(args, share, lambda: barrier.wait(BARRIER_TIMEOUT_S))))
    except Exception as exc:
        barrier.abort()  # the others stop waiting for this one
        now = time.perf_counter()
        failed = Result(ok=False, error=f"client process failed: {type(exc).__name__}: {exc}")
        out.put(Timed([failed] * share.num_requests, now, now, args.model))


def run_all(args: argparse.Namespace) -> tuple[list[Result], float, str]:
    """The warm-up, then the timed workload over `--client-processes` processes (one
    Python client streams only ~5-10k chunks/s: at high concurrency a single one measures
    itself, not the server). Wall time: from the first share's start to the last one's end."""
    warmup = Share(args.concurrency, 0, args.request_rate, args.warmup_requests, args.seed)
    args.model = asyncio.run(run(args, warmup)).model
    if args.client_processes == 1:
        parts = [asyncio.run(run(args, shares(args)[0]))]
    else:
        # spawn, not fork: the parent may hold threads (asyncio's resolver, a test's server)
        context = multiprocessing.get_context("spawn")
        barrier, out = context.Barrier(args.client_processes), context.Queue()
        processes = [context.Process(target=client_process, args=(args, share, barrier, out))
                     for share in shares(args)]
        for process in processes:
            process.start()
        parts = [out.get() for _ in processes]
        for process in processes:
            process.join()
    timed = [part for part in parts if part.end > part.start] or parts  # (failed shares have no span)
    wall = max(max(part.end for part in timed) - min(part.start for part in timed), 1e-9)
    return [r for part in parts for r in part.results], wall, args.model


def report(args: argparse.Namespace, results: list[Result], wall: float, model: str) -> str:
    """The summary table."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    gaps = [g * 1000 for r in ok for g in r.chunk_gaps]
    tpot = [(r.latency - r.ttft) * 1000 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in ok)
    lines = [
        f"model {model} at {args.base_url}: {args.num_requests} requests, prompt {args.prompt_len} / output "
        f"{args.output_len} tokens, concurrency {args.concurrency}, request rate {args.request_rate}/s, "
        f"{args.client_processes} client process(es)",
        f"{'successful requests':<28}{len(ok)} (failed {len(results) - len(ok)})",
        f"{'duration (s)':<28}{wall:.2f}",
        f"{'request throughput (req/s)':<28}{len(ok) / wall:.2f}",
        f"{'output throughput (tok/s)':<28}{output_tokens / wall:.1f}",
        f"{'TTFT p50 / p99 (ms)':<28}{percentile(ttft, 50):.1f} / {percentile(ttft, 99):.1f}",
        f"{'ITL p50 / p99 (ms)':<28}{percentile(gaps, 50):.1f} / {percentile(gaps, 99):.1f}",
        f"{'TPOT mean (ms)':<28}{statistics.fmean(tpot) if tpot else float('nan'):.1f}",
    ]
    errors = sorted({r.error for r in results if not r.ok})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def main() -> None:
    """Parse flags, run, print the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens")
    p.add_argument("--client-processes", type=int, default=None,
                   help="client processes the timed requests are split over (default: one per 32 of "
                        "--concurrency)")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="untimed requests of the same shape sent first, --concurrency at a time "
                        "(default: --concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args()
    if args.warmup_requests is None:
        args.warmup_requests = args.concurrency
    if args.client_processes is None:
        args.client_processes = min(math.ceil(args.concurrency / 32), args.num_requests)
    if min(args.concurrency, args.num_requests, args.prompt_len, args.output_len, args.client_processes) < 1 \
            or args.request_rate <= 0 or args.warmup_requests < 0:
        p.error("--concurrency, --num-requests, --prompt-len, --output-len, --client-processes and --request-rate "
                "must be positive, --warmup-requests not negative")
    if args.client_processes > min(args.concurrency, args.num_requests):
        p.error("--client-processes must not exceed --concurrency or --num-requests")
    print(report(args, *run_all(args)))


if __name__ == "__main__":
    main()

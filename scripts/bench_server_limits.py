#!/usr/bin/env python
"""Does one big or hostile client stall everyone else? (a benchmark, not a test)

Starts `scripts/serve_hybrid.py` (the embedded model on CPU, plus `--server-flag`s) and, while a
probe times /health on a fresh connection every 20 ms and a long streamed completion records
its inter-chunk gaps, runs one scenario at a time:

  baseline           nothing else;
  N MB prompt body   a completions body of N MB (--body-mb; over --max-request-body-bytes: a 413),
                     posted again and again for --hold seconds;
  logprobs response  one non-streamed request of --logprob-prompts x --logprob-tokens tokens with
                     logprobs 20 (a response of many MB, built after the last token);
  N idle conns       N connections holding half a request head for --hold seconds (--idle).

One row per scenario: the big request's status and time, /health latency p50 / max and
failures, the stream's longest gap, the server's peak RSS and open files, and at the end how
many lines and tracebacks the server logged.

    python scripts/bench_server_limits.py                  # CPU, embedded model, defaults
    python scripts/bench_server_limits.py --idle 2000 3000 --server-flag=--max-connections=2048
"""
import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx

SERVE_SCRIPT = Path(__file__).resolve().parent / "serve_hybrid.py"
PROBE_INTERVAL_S = 0.02
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\n"


@dataclass
class Window:
    """What the probe and the background stream saw during one scenario."""

    health_ms: list[float] = field(default_factory=list)
    health_status: Counter = field(default_factory=Counter)  # status code, or the error's name
    chunk_times: list[float] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    peak_fds: int = 0

    def max_gap_ms(self) -> float:
        """The longest wait between two streamed chunks."""
        times = self.chunk_times
        return max((b - a for a, b in zip(times, times[1:])), default=float("nan")) * 1000


def _proc_stats(pid: int) -> tuple[float, int]:
    """(RSS in MB, open files) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def _probe(url: str, pid: int, window: Window, stop: asyncio.Event) -> None:
    """Time GET /health on a new connection every PROBE_INTERVAL_S until `stop`."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status: int | str = (await client.get(f"{url}/health")).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            window.health_ms.append((time.perf_counter() - start) * 1000)
            window.health_status[status] += 1
            rss, fds = _proc_stats(pid)
            window.peak_rss_mb, window.peak_fds = max(window.peak_rss_mb, rss), max(window.peak_fds, fds)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)


async def _stream(url: str, window: Window, stop: asyncio.Event) -> None:
    """Keep a streamed completion running until `stop`, recording when each chunk arrives."""
    body = {"prompt": "stream", "max_tokens": 4000, "ignore_eos": True, "temperature": 0.0, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        window.chunk_times.append(time.perf_counter())
                    if stop.is_set():
                        return


async def measure(url: str, pid: int, scenario: Callable[[], str]) -> tuple[str, float, Window]:
    """Run `scenario` in a child process (so its client work cannot stall the measuring one)
    under the probe and the stream; returns (its result, its seconds, what was seen meanwhile)."""
    window, stop = Window(), asyncio.Event()
    stream = asyncio.create_task(_stream(url, window, stop))
    while not window.chunk_times:  # the stream is running before the scenario starts
        await asyncio.sleep(0.01)
    probe = asyncio.create_task(_probe(url, pid, window, stop))
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=1) as pool:
        result = await asyncio.get_running_loop().run_in_executor(pool, scenario)
    seconds = time.perf_counter() - start
    stop.set()
    await asyncio.gather(probe, stream)
    return result, seconds, window


# ---- scenarios: (url, *args) -> what happened; module-level, as they run in a child process --
def pause(_url: str, seconds: float) -> str:
    """Nothing for `seconds` (the baseline)."""
    time.sleep(seconds)
    return "-"


def big_body(url: str, megabytes: int, seconds: float) -> str:
    """Post a completions body of `megabytes` MB (a prompt of "a " repeated), again and again
    for at least `seconds` (a refused body is answered at once)."""
    data = json.dumps({"prompt": "a " * (megabytes * 1_000_000 // 2), "max_tokens": 1}).encode()
    answers: Counter = Counter()
    end = time.perf_counter() + seconds
    while not answers or time.perf_counter() < end:
        r = httpx.post(f"{url}/v1/completions", content=data, headers={"content-type": "application/json"},
                       timeout=600)
        answers[f"{r.status_code} {r.json()['error']['code'] if r.status_code >= 400 else ''}".strip()] += 1
    return ", ".join(f"{answer} x{count}" for answer, count in answers.items())


def logprobs_response(url: str, prompts: int, tokens: int) -> str:
    """One non-streamed request of `prompts` x `tokens` tokens with 20 logprobs each."""
    body = {"prompt": [f"p{i}" for i in range(prompts)], "max_tokens": tokens, "ignore_eos": True, "logprobs": 20}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
    return f"{r.status_code}, {len(r.content) / 1e6:.1f} MB"


def idle_connections(url: str, count: int, hold: float) -> str:
    """Open `count` connections that send half a request head, hold them, close them."""
    host, port = url.removeprefix("http://").split(":")
    socks, refused = [], 0
    for _ in range(count):
        try:
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(PARTIAL_HEAD)
            socks.append(sock)
        except OSError:
            refused += 1
    time.sleep(hold)
    closed = 0
    for sock in socks:
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            closed += sock.recv(1) == b""
        sock.close()
    return f"{len(socks)} open, {closed} closed by server, {refused} refused"


@contextlib.contextmanager
def server(flags: list[str], log) -> Iterator[tuple[str, subprocess.Popen]]:
    """serve_hybrid.py on a free port; (url, process) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, str(SERVE_SCRIPT), "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", "--log-level", "warning", *flags], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (exit {proc.poll()})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _row(name: str, result: str, seconds: float, w: Window) -> str:
    p50 = statistics.median(w.health_ms) if w.health_ms else float("nan")
    peak = max(w.health_ms, default=float("nan"))
    statuses = ", ".join(f"{k}:{v}" for k, v in sorted(w.health_status.items(), key=str))
    return (f"| {name} | {result} | {seconds:.1f} | {p50:.1f} / {peak:.0f} | {statuses} | {w.max_gap_ms():.0f} "
            f"| {w.peak_rss_mb:.0f} | {w.peak_fds} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--body-mb", type=int, nargs="*", default=[5, 10, 50], help="prompt body sizes to post, MB")
    p.add_argument("--logprob-prompts", type=int, default=16)
    p.add_argument("--logprob-tokens", type=int, default=1000, help="tokens per prompt (0: skip the scenario)")
    p.add_argument("--idle", type=int, nargs="*", default=[2000], help="idle connection counts to hold")
    p.add_argument("--hold", type=float, default=5.0,
                   help="seconds of the baseline, of posting each body, and of holding the idle connections")
    p.add_argument("--server-flag", action="append", default=[], help="extra serve_hybrid.py flag (repeatable)")
    args = p.parse_args()

    scenarios: list[tuple[str, Callable[..., str], tuple]] = [("baseline", pause, (args.hold,))]
    scenarios += [(f"{mb} MB prompt body", big_body, (mb, args.hold)) for mb in args.body_mb]
    if args.logprob_tokens:
        scenarios.append((f"logprobs response {args.logprob_prompts}x{args.logprob_tokens}", logprobs_response,
                          (args.logprob_prompts, args.logprob_tokens)))
    scenarios += [(f"{n} idle conns", idle_connections, (n, args.hold)) for n in args.idle]

    print("| scenario | big request | s | /health p50 / max ms | /health results | stream max gap ms "
          "| peak RSS MB | peak open files |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryFile() as log:
        with server(args.server_flag, log) as (url, proc):
            for name, scenario, scenario_args in scenarios:
                run = functools.partial(scenario, url, *scenario_args)
                result, seconds, window = asyncio.run(measure(url, proc.pid, run))
                print(_row(name, result, seconds, window), flush=True)
        log.seek(0)
        text = log.read().decode(errors="replace")
    print(f"\nserver log: {len(text.splitlines())} lines, {text.count('Traceback')} tracebacks")


if __name__ == "__main__":
    main()

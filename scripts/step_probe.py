"""Decode-only engine steps for the decode benchmarks: requests with distinct random prompts
brought past their prefill, a checked step, the clean-up, and `StepProbe`, which measures
the GPU idle fraction and host time per phase of decode steps with CUDA events (no
profiler). Used by bench_decode.py (and its floors and kernel counts), bench_spec.py and
bench_async.py.
"""
import time

import torch

from hybrid_engine import LLM, SamplingParams


def random_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`batch` distinct random prompts, the same for the same batch size in every run."""
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def checked_step(engine) -> list:
    """`engine.step()`, raising if the step failed (the engine turns errors into finishes)."""
    outs = engine.step()
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"benchmark step failed: request {failed[0].request_id}: {failed[0].finish_reason}")
    return outs


def start_decoding(engine, batch: int, prompt_len: int, tag: str, max_tokens: int | None = None) -> list[str]:
    """Add `batch` requests with random prompts (and `max_tokens`, default: all the room the
    context leaves) and step until every one is past its prefill and a few decode steps, so
    the next step is decode-only; returns their ids."""
    max_tokens = max_tokens or engine.max_model_len - prompt_len
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, prompt_len, engine.model_config.vocab_size)):
        engine.add_request(rid, prompt, params)
    while any(r.num_computed < len(r.prompt_token_ids) + 4 for r in engine.requests.values()):
        checked_step(engine)
    return ids


def finish(engine, ids: list[str]) -> None:
    """Abort the given requests and step until the engine is empty."""
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


class StepProbe:
    """Instruments an engine for a few decode steps without a profiler.

    GPU idle: a timing event is recorded just before each step's host-to-device copy
    (the first device work of a step) and just after its sample copy (the last). The GPU
    is idle between one step's end and the next step's start whenever the host had not
    yet enqueued the next step; idle fraction = 1 - sum(end_i - start_i) / (end_last -
    start_first). Host phases: wall time the CPU spends in each call of the step loop
    (`wait` is the time blocked on the device).
    """

    PHASES = ("schedule", "prepare", "launch", "wait", "retire", "reconcile")

    def __init__(self, engine):
        self.engine = engine
        self.starts: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []
        self.host = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def _timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[phase] += time.perf_counter() - t0
        return wrapper

    def _event(self, into: list):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        into.append(ev)

    def run(self, steps: int) -> dict:
        """Run `steps` engine steps instrumented; returns idle fraction and host µs per step."""
        engine = self.engine
        runner, buffer = engine.runner, engine.runner.buffer
        sync, launch = buffer.sync, runner.launch

        def probed_sync():
            self._event(self.starts)
            sync()

        def probed_launch(plan):
            handle = launch(plan)
            self._event(self.ends)
            handle.wait = self._timed("wait", handle.wait)
            return handle

        patches = {(buffer, "sync"): probed_sync, (runner, "launch"): self._timed("launch", probed_launch),
                   (runner, "prepare"): self._timed("prepare", runner.prepare),
                   (engine.scheduler, "schedule"): self._timed("schedule", engine.scheduler.schedule),
                   (engine, "_retire"): self._timed("retire", engine._retire),
                   (engine, "_reconcile"): self._timed("reconcile", engine._reconcile)}
        for (obj, name), fn in patches.items():
            setattr(obj, name, fn)
        if engine._inflight is not None:  # the in-flight step's wait was not wrapped
            engine._inflight.wait = self._timed("wait", engine._inflight.wait)
        try:
            for _ in range(steps):
                engine.step()
        finally:
            for obj, name in patches:
                delattr(obj, name)
        torch.cuda.synchronize()
        # The first recorded end may belong to a step launched before probing began.
        pairs = list(zip(self.starts, self.ends[len(self.ends) - len(self.starts):]))
        busy = sum(s.elapsed_time(e) for s, e in pairs)
        wall = pairs[0][0].elapsed_time(pairs[-1][1])
        gaps = sorted((e.elapsed_time(s) for (_, e), (s, _) in zip(pairs, pairs[1:])), reverse=True)
        return dict(gpu_idle=1.0 - busy / wall, gpu_busy_ms_per_step=busy / len(pairs),
                    largest_gaps_ms=[round(g, 3) for g in gaps[:3]],
                    **{f"host_{k}_us": 1e6 * v / steps for k, v in self.host.items()})


PROBE_STEPS = 96
PROBE_TOKENS = PROBE_STEPS + 16  # what each probed request may generate: the engine's max_model_len must fit it


def probe_decode(llm: LLM, batch: int, prompt_len: int) -> dict:
    """GPU idle fraction and host time per phase over PROBE_STEPS decode-only steps of
    `batch` requests with distinct random prompts (identical greedy rows would all route to
    the same experts); each request may generate PROBE_TOKENS tokens after its prompt."""
    engine = llm.engine
    ids = start_decoding(engine, batch, prompt_len, "idle", max_tokens=PROBE_TOKENS)
    result = StepProbe(engine).run(PROBE_STEPS)
    finish(engine, ids)
    return result

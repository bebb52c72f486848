"""Drive an LLMEngine step by step with staggered arrivals / aborts and check the
per-request output stream (exactly one final output, consistent streaming deltas)."""
from dataclasses import dataclass, field

from hybrid_engine import SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def seeded(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=seed,
                          ignore_eos=kw.pop("ignore_eos", True), **kw)


def byte_prompt(n: int, salt: int = 0) -> list[int]:
    """A deterministic n-token prompt of byte ids (no special tokens)."""
    return [(salt * 31 + i * 17 + 5) % 256 for i in range(n)]


@dataclass
class Run:
    finals: dict = field(default_factory=dict)  # request id -> final RequestOutput
    streams: dict = field(default_factory=dict)  # request id -> every RequestOutput, in order
    steps: int = 0
    step_of_final: dict = field(default_factory=dict)


def drive(engine, arrivals, aborts=None, max_steps=5000, on_step=None) -> Run:
    """arrivals: [(step, request_id, prompt, params)]; aborts: {step: [request_id]}.

    Adds/aborts before the given step() call, steps until nothing is unfinished, and checks
    the output stream of every request: exactly one final output, nothing after it, and the
    concatenated streaming deltas equal the cumulative fields.
    """
    aborts = aborts or {}
    pending = sorted(arrivals, key=lambda a: a[0])
    run = Run()
    last_event = max([a[0] for a in arrivals] + list(aborts) + [0])
    while pending or engine.has_unfinished_requests() or run.steps <= last_event:
        while pending and pending[0][0] <= run.steps:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid in aborts.get(run.steps, []):
            engine.abort_request(rid)
        for out in engine.step():
            stream = run.streams.setdefault(out.request_id, [])
            assert out.request_id not in run.finals, f"{out.request_id}: output after its final output"
            stream.append(out)
            if out.finished:
                run.finals[out.request_id] = out
                run.step_of_final[out.request_id] = run.steps
        if on_step is not None:
            on_step(engine, run)
        run.steps += 1
        assert run.steps < max_steps, "engine did not drain"
    ids = {a[1] for a in arrivals}
    for rid, stream in run.streams.items():
        final = run.finals.get(rid)
        assert final is not None, f"{rid}: no final output"
        assert sum(o.finished for o in stream) == 1
        if rid in ids:  # whole stream seen (requests added before drive() started are not)
            assert [t for o in stream for t in o.new_token_ids] == final.output_token_ids, rid
            if final.text is not None:
                assert "".join(o.new_text for o in stream) == final.text, rid
    assert ids <= set(run.finals), f"missing final outputs for {ids - set(run.finals)}"
    return run


def assert_mode_ran(engine) -> None:
    """In async mode launch-ahead really happened (and never in serial mode)."""
    ahead = engine.stats()["launch_ahead_steps"]
    assert (ahead > 0) if engine.config.async_scheduling else (ahead == 0), ahead


def assert_drained(engine) -> None:
    """Every KV block and Mamba slot is back; nothing is queued."""
    s = engine.stats()
    assert not engine.has_unfinished_requests()
    assert s["free_kv_blocks"] == s["total_kv_blocks"], s
    assert s["free_mamba_slots"] == s["total_mamba_slots"], s
    assert s["running"] == 0 and s["paused"] == 0 and s["waiting"] == 0, s

"""Fault injection under load: the model's forward raises at random steps (seeded) while many
clients stream, wait for whole responses, ask for logprobs, send several prompts, or hang up.

Afterwards every KV block and Mamba slot is back in its pool, every request the engine took
had exactly one final output (the failed ones finish_reason "error" with the fault's message),
every HTTP request ended exactly once (each choice one finish_reason, or one error), and the
server is healthy.
"""
import asyncio
import json
import random
from collections import Counter
from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from tests.server.conftest import MAX_MODEL_LEN, FaultyEngine, Server, serve_in_thread, wait_until

SEED = 1234
FAULT = "injected forward failure"
NUM_REQUESTS = 48
FAULT_RATE = 0.02  # per forward call


class FlakyForwardEngine(FaultyEngine):
    """The engine with a model whose forward raises with probability `fault_rate` (drawn from a
    seeded RNG), recording every request handed to it and each final output it gave out."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.fault_rate = 0.0
        self.faults = 0
        self.added: list[str] = []
        self.finals: Counter[str] = Counter()
        self.final_outputs = {}
        self._rng = random.Random(SEED)
        forward = self.model.forward

        def flaky_forward(*args, **kwargs):
            if self._rng.random() < self.fault_rate:
                self.faults += 1
                raise RuntimeError(FAULT)
            return forward(*args, **kwargs)

        self.model.forward = flaky_forward  # the instance attribute nn.Module.__call__ finds

    def add_requests(self, requests):
        super().add_requests(requests)
        self.added.extend(request_id for request_id, _, _ in requests)

    def step(self):
        outputs = super().step()
        for out in outputs:
            if out.finished:
                self.finals[out.request_id] += 1
                self.final_outputs[out.request_id] = out
        return outputs


@pytest.fixture(scope="module")
def flaky() -> Iterator[Server]:
    """A server over FlakyForwardEngine: 4 sequences (the rest wait), no 429 for this load."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    with serve_in_thread(lambda: FlakyForwardEngine(config), max_waiting_requests=4 * NUM_REQUESTS) as s:
        yield s


def _request(i: int, rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, hang up early) of the i-th request: a mix of endpoints, streaming or not,
    logprobs or not, one prompt or three."""
    kind = i % 6
    common = {"max_tokens": rng.randint(4, 24), "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]),
              "seed": rng.randrange(1000), "stream": kind in (1, 3, 4)}
    if kind in (2, 3):
        body = {**common, "messages": [{"role": "user", "content": f"hello {i}"}], "logprobs": True,
                "top_logprobs": 3}
        return "/v1/chat/completions", body, False
    prompt = [f"prompt {i} {j}" for j in range(3)] if kind == 4 else f"prompt {i}"
    body = {**common, "prompt": prompt, **({"logprobs": 2} if kind in (1, 4) else {})}
    return "/v1/completions", body, kind == 5 or (kind == 1 and i % 4 == 1)


def _check_stream(lines: list[str], num_choices: int) -> str:
    """A complete stream: [DONE] last; each choice finishes at most once, all of them unless an
    error event (the only one, just before [DONE]) ended it. Returns "ok" or "error"."""
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    errors = [e for e in events if "error" in e]
    finished = Counter(c["index"] for e in events if "choices" in e for c in e["choices"] if c["finish_reason"])
    assert all(count == 1 for count in finished.values()), finished
    if errors:
        assert len(errors) == 1 and "error" in events[-1] and FAULT in errors[0]["error"]["message"]
        return "error"
    assert set(finished) == set(range(num_choices))
    assert all(c["finish_reason"] == "length" for e in events for c in e.get("choices", ()) if c["finish_reason"])
    return "ok"


async def _one(client: httpx.AsyncClient, path: str, body: dict, hang_up: bool) -> str:
    """Send one request and check how it ended: "ok", "error" or "hung up" (a client that gives
    up after the first chunk, or after 50 ms without a response)."""
    num_choices = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if line and hang_up:
                    return "hung up"  # leaving the block closes the connection mid-stream
                if line:
                    lines.append(line)
            return _check_stream(lines, num_choices)
    try:
        r = await client.post(path, json=body, timeout=httpx.Timeout(120, read=0.05) if hang_up else 120)
    except httpx.ReadTimeout:
        return "hung up"
    if r.status_code == 500:
        assert FAULT in r.json()["error"]["message"]
        return "error"
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(num_choices))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == num_choices * body["max_tokens"]
    return "ok"


async def _load(url: str) -> Counter[str]:
    rng = random.Random(SEED)
    requests = [_request(i, rng) for i in range(NUM_REQUESTS)]
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        return Counter(await asyncio.gather(*(_one(client, *r) for r in requests)))


def test_forward_faults_under_load_leak_nothing(flaky: Server):
    engine: FlakyForwardEngine = flaky.engine
    engine.fault_rate = FAULT_RATE
    try:
        outcomes = asyncio.run(_load(flaky.url))
    finally:
        engine.fault_rate = 0.0
    assert engine.faults > 0 and min(outcomes["error"], outcomes["ok"], outcomes["hung up"]) > 0, outcomes
    wait_until(flaky.idle_and_free, what="every block and slot back in its pool")
    # Every request the engine took ended exactly once; the failed ones with the fault's message.
    assert set(engine.finals) == set(engine.added) and set(engine.finals.values()) == {1}
    reasons = Counter(out.finish_reason for out in engine.final_outputs.values())
    assert set(reasons) <= {"length", "error", "abort"} and reasons["error"] > 0, reasons
    for out in engine.final_outputs.values():
        assert (out.finish_reason == "error") == (out.error is not None and FAULT in out.error)
    flaky.assert_healthy()

"""Prefix caching through the server: `usage.prompt_tokens_details.cached_tokens` (as
OpenAI reports it) and the /metrics counters say how much of a prompt came from the cache,
and a cached response equals the one an engine without prefix caching gives
(docs/server.md, "Prefix caching")."""
import json
import os
from typing import Iterator

import httpx
import pytest

from hybrid_engine import SamplingParams
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.request import RequestOutput
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.server.conftest import MAX_MODEL_LEN, Server, serve_in_thread, wait_until

# A small interval (a multiple of the CPU KV block size, 16) puts Mamba state checkpoints
# inside these short prompts, so a shared system prompt hits too.
INTERVAL = 16
MAX_TOKENS = 8
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "top_k": 20, "seed": 1234}}


@pytest.fixture(scope="module")
def cached() -> Iterator[Server]:
    """A server with prefix caching on (checkpoints every 16 tokens)."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                          prefix_cache_checkpoint_interval=INTERVAL)
    with serve_in_thread(lambda: LLMEngine(config)) as s:
        yield s


@pytest.fixture(scope="module")
def uncached_engine() -> LLMEngine:
    """The oracle: the same engine without prefix caching, used directly."""
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                                  enable_prefix_caching=False))


def reference(engine: LLMEngine, prompt: list[int], sampling: dict) -> RequestOutput:
    """What the uncached engine answers to `prompt` (the request the tests send, logprobs on)."""
    engine.add_request("ref", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, **sampling))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    return final


def expected_logprobs(out: RequestOutput) -> list[float]:
    """The sampled tokens' logprobs."""
    return [entry[token] for token, entry in zip(out.output_token_ids, out.logprobs)]


def cached_tokens(usage: dict) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of a response."""
    return usage["prompt_tokens_details"]["cached_tokens"]


def complete(server: Server, prompt: list[int], sampling: dict) -> dict:
    """The JSON answer to a (non-streamed) completions request for `prompt`, logprobs on."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1, **sampling}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server: Server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response with a final usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def metric_delta(server: Server, before: dict[str, float], name: str) -> float:
    """How much metric `name` grew since `before`, once the server is idle."""
    wait_until(server.idle_and_free, what="the engine stats to show the request done")
    return server.metrics()[name] - before.get(name, 0.0)


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_next_turn_resumes_from_the_previous_turn(cached: Server, uncached_engine: LLMEngine, name: str):
    """Turn 2 resends turn 1's prompt and answer plus a new message: it reports cached prompt
    tokens (turn 1 reported none), the /metrics counters count them, and both turns' tokens
    and logprobs equal the uncached engine's."""
    sampling = SAMPLINGS[name]
    turn1 = list(f"[{name}] You are a terse assistant. Q1: colours?".encode())
    ref1 = reference(uncached_engine, turn1, sampling)
    turn2 = turn1 + ref1.output_token_ids + list(b" Q2: and shapes?")
    ref2 = reference(uncached_engine, turn2, sampling)

    wait_until(cached.idle_and_free, what="an idle server")
    before = cached.metrics()
    for prompt, ref, first in ((turn1, ref1, True), (turn2, ref2, False)):
        r = complete(cached, prompt, sampling)
        (choice,) = r["choices"]
        assert choice["text"] == ref.text
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected_logprobs(ref), abs=1e-5)
        usage = r["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), MAX_TOKENS)
        hits = metric_delta(cached, before, "hybrid_engine_prefix_cache_hits_total")
        if first:
            assert cached_tokens(usage) == 0 and hits == 0
            m = cached.metrics()  # turn 1's blocks and end state stay in the cache
            assert m["hybrid_engine_prefix_cache_checkpoints"] > 0 and m["hybrid_engine_kv_blocks_cached"] > 0
        else:
            # Turn 2 resumes from turn 1's end state: its prompt and answer but the answer's
            # last token, which turn 1 never fed to the model.
            assert cached_tokens(usage) == len(turn1) + MAX_TOKENS - 1 == hits
    queries = metric_delta(cached, before, "hybrid_engine_prefix_cache_queries_total")
    assert queries == len(turn1) + len(turn2)


def test_streamed_usage_sums_cached_tokens_over_prompts(cached: Server, uncached_engine: LLMEngine):
    """Two prompts in one streamed completions request, each extending an earlier exchange:
    the final usage chunk sums their cached tokens, as it sums their prompt tokens, and the
    streamed texts equal the uncached engine's."""
    sampling = SAMPLINGS["greedy"]
    first = list(b"<two prompts> Summarize: the cat sat on the mat.")
    ref = reference(uncached_engine, first, sampling)
    prompts = [first + ref.output_token_ids + list(suffix) for suffix in (b" Shorter.", b" In French.")]
    refs = [reference(uncached_engine, p, sampling) for p in prompts]
    assert cached_tokens(complete(cached, first, sampling)["usage"]) == 0

    wait_until(cached.idle_and_free, what="an idle server")
    before = cached.metrics()
    events = stream_events(cached, "/v1/completions",
                           {"prompt": prompts, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling})
    texts = ["", ""]
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [r.text for r in refs]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["prompt_tokens"] == sum(map(len, prompts))
    # Each prompt resumes from the earlier exchange's end state (its answer's last token unfed).
    assert cached_tokens(usage) == 2 * (len(first) + MAX_TOKENS - 1)
    assert cached_tokens(usage) == metric_delta(cached, before, "hybrid_engine_prefix_cache_hits_total")


def chat_prompt(messages: list[dict]) -> list[int]:
    """The token ids the server renders for `messages` (ChatML of the byte tokenizer)."""
    tokenizer = build_byte_tokenizer()
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_shared_system_prompt(cached: Server, uncached_engine: LLMEngine, stream: bool):
    """Chats sharing a system prompt: the second resumes from a checkpoint inside it and
    reports cached tokens (in the final usage chunk when streamed); the reply equals the
    uncached engine's."""
    # Distinct from the first token of the text on: the other case's chats must not hit.
    system = {"role": "system", "content": f"{'Streamed' if stream else 'Full'}: answer in one short sentence."}
    chats = [[system, {"role": "user", "content": question}] for question in ("Why is the sky blue?", "Why?")]
    sampling = SAMPLINGS["seeded"]
    usages = []
    for messages in chats:
        ref = reference(uncached_engine, chat_prompt(messages), sampling)
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
        if stream:
            events = stream_events(cached, "/v1/chat/completions", body)
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
            usage = events[-1]["usage"]
        else:
            r = httpx.post(f"{cached.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            text, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
        assert text == ref.text and usage["prompt_tokens"] == len(ref.prompt_token_ids)
        usages.append(usage)
    shared = len(os.path.commonprefix([chat_prompt(messages) for messages in chats]))
    assert cached_tokens(usages[0]) == 0
    # The deepest interval checkpoint inside the shared prefix.
    assert cached_tokens(usages[1]) == shared // INTERVAL * INTERVAL > 0


def test_no_prefix_caching_reports_no_cached_tokens(uncached_engine: LLMEngine):
    """With prefix caching off (--no-enable-prefix-caching) a repeated conversation is
    computed in full: cached_tokens stays 0 and nothing is looked up."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                          prefix_cache_checkpoint_interval=INTERVAL)
    sampling = SAMPLINGS["greedy"]
    turn1 = list(b"No cache here, please: Q1?")
    turn2 = turn1 + reference(uncached_engine, turn1, sampling).output_token_ids + list(b" Q2?")
    with serve_in_thread(lambda: LLMEngine(config)) as server:
        for prompt in (turn1, turn2, turn2):
            assert cached_tokens(complete(server, prompt, sampling)["usage"]) == 0
        wait_until(server.idle_and_free, what="the requests done")
        m = server.metrics()
    assert m["hybrid_engine_prefix_cache_queries_total"] == m["hybrid_engine_prefix_cache_hits_total"] == 0
    assert m["hybrid_engine_prefix_cache_checkpoints"] == m["hybrid_engine_kv_blocks_cached"] == 0

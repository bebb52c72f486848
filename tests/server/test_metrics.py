"""/metrics counts what happened: tokens, requests, engine steps, pool usage while a
request runs, and speculative drafts (docs/server.md, "Metrics")."""
import httpx
import pytest

from hybrid_engine import SamplingParams
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, FaultyEngine, Server, serve_in_thread, wait_until

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 7


def test_counters_after_one_known_request(server: Server):
    """One greedy request of 5 prompt tokens and 7 generated tokens, alone on the server."""
    wait_until(server.idle_and_free, what="an idle server")
    before = server.metrics()
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # Another test's prompt may be a prefix of this one (the shared server caches prefixes).
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    wait_until(server.idle_and_free, what="the engine stats to show the request done")
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("hybrid_engine_prompt_tokens_total") == len(PROMPT)
    assert delta("hybrid_engine_generation_tokens_total") == MAX_TOKENS
    assert delta("hybrid_engine_requests_total{finish_reason=length}") == 1
    # The prompt is looked up in the prefix cache and its uncached part prefilled once
    # (nothing evicted); the prefill step samples the first token and each of the other 6
    # is one decode token, one engine step each.
    assert delta("hybrid_engine_prefix_cache_queries_total") == len(PROMPT)
    assert delta("hybrid_engine_prefix_cache_hits_total") == cached
    assert delta("hybrid_engine_prefill_tokens_total") == len(PROMPT) - cached
    assert delta("hybrid_engine_decode_tokens_total") == MAX_TOKENS - 1
    assert delta("hybrid_engine_engine_steps_total") == MAX_TOKENS
    # A step advances a request by at most one token, so 7 tokens took at least 7 timed steps.
    assert delta("hybrid_engine_step_seconds_count") >= MAX_TOKENS
    assert delta("hybrid_engine_step_seconds_sum") > 0


def test_usage_gauges_follow_a_running_request(server: Server, engine_switches: FaultyEngine):
    """While one request streams it holds one of the Mamba slots and some KV blocks; the usage
    gauges say so, and drop back to 0 when it is done."""
    engine_switches.step_delay = 0.02  # still generating while we look
    wait_until(server.idle_and_free, what="an idle server")
    body = {"prompt": "usage", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        m = server.metrics()
        assert m["hybrid_engine_num_requests_in_flight"] == m["hybrid_engine_num_requests_running"] == 1
        used_blocks = m["hybrid_engine_kv_blocks_total"] - m["hybrid_engine_kv_blocks_free"]
        assert used_blocks >= 1
        assert m["hybrid_engine_kv_cache_usage"] == pytest.approx(used_blocks / m["hybrid_engine_kv_blocks_total"])
        assert m["hybrid_engine_mamba_slot_usage"] == pytest.approx(1 / m["hybrid_engine_mamba_slots_total"])
        assert [line for line in lines if line][-1] == "data: [DONE]"
    wait_until(server.idle_and_free, what="the request's blocks and slot to be freed")
    m = server.metrics()
    assert m["hybrid_engine_kv_cache_usage"] == 0 and m["hybrid_engine_mamba_slot_usage"] == 0


def test_speculative_decoding_counters():
    """A server with n-gram speculation: /metrics has the drafts verified and accepted (as
    the engine counted them) and their ratio, and the text equals a plain engine's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, speculative_config=spec)
    prompt = "abcabcabcabcabc"
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0}
    plain = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN))
    plain.add_request("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    while plain.has_unfinished_requests():
        outputs = plain.step()
    with serve_in_thread(lambda: LLMEngine(config)) as spec_server:
        r = httpx.post(f"{spec_server.url}/v1/completions", timeout=60, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == outputs[0].text
        wait_until(spec_server.idle_and_free, what="the request done")
        metrics, stats = spec_server.metrics(), spec_server.engine.stats()
    proposed = metrics["hybrid_engine_spec_decode_num_draft_tokens_total"]
    accepted = metrics["hybrid_engine_spec_decode_num_accepted_tokens_total"]
    assert (proposed, accepted) == (stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]) and proposed > 0
    assert metrics["hybrid_engine_spec_decode_steps_total"] == stats["spec_steps"] > 0
    assert metrics["hybrid_engine_spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / proposed)

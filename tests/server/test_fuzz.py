"""Property: whatever JSON is posted, the server never answers 5xx and stays healthy."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import Server

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
          "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options", "n", "user",
          "include_stop_str_in_output", "skip_special_tokens"]
INNER_KEYS = ["role", "content", "type", "text", "include_usage", "name"]

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
           | st.sampled_from([0, 1, -1, 2, 20, 21, 2**31, 2**63, 10**30, 1e308, 5e-324, -0.0, 0.5, "user", "text"]))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(INNER_KEYS) | st.text(max_size=6),
                                                                inner, max_size=4),
    max_leaves=12,
)
# Valid requests to mutate, so the fuzz also reaches the paths past validation.
BASES = {
    "/v1/completions": {"prompt": "fuzz", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 3},
}


# Right JSON types with edgy values: these get past type checks into range, context,
# vocabulary, sampling and streaming code.
_floats = st.floats(-3.0, 3.0)
TYPED = {
    "prompt": st.text(max_size=20) | st.lists(st.integers(-1, 300), max_size=20)
    | st.lists(st.text(max_size=5), max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                                "content": st.text(max_size=10)}), max_size=3),
    "max_tokens": st.integers(-1, 200), "max_completion_tokens": st.integers(-1, 200),
    "temperature": _floats, "top_p": _floats, "top_k": st.integers(-3, 2**32), "min_p": _floats,
    "presence_penalty": _floats, "frequency_penalty": _floats, "repetition_penalty": st.floats(-1.0, 200.0),
    "seed": st.integers(-5, 2**65), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 300), max_size=3), "logprobs": st.integers(-1, 22) | st.booleans(),
    "top_logprobs": st.integers(-1, 22), "n": st.integers(0, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}


def bodies(path: str) -> st.SearchStrategy:
    """Random request bodies for `path`: junk objects, junk JSON, typed mutations of a valid body."""
    random_object = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=6)
    mutated = st.fixed_dictionaries({}, optional=TYPED).map(lambda extra: {**BASES[path], **extra})
    # Typed mutations of a valid body listed twice: half the examples are near-valid.
    return st.one_of(random_object, json_values, mutated, mutated)


@pytest.mark.parametrize("path", sorted(BASES))
def test_random_bodies_never_5xx(server: Server, path):
    """Hypothesis posts random bodies (derandomized: the same ones every run): never a 5xx,
    errors always OpenAI-shaped."""
    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def post(body):
        # allow_nan: Python's JSON parser accepts NaN/Infinity, so clients can send them.
        raw = json.dumps(body, allow_nan=True)
        r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code < 500, (raw, r.status_code, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    post()
    server.assert_healthy()

"""The library and the server accept exactly the same sampling values.

For every ranged field of `SamplingParams`, the values at and just beyond each end of its
range (and inf / nan for floats) get the same verdict from `SamplingParams(...)` (accepted,
or a ParameterError naming the field) and from both endpoints (200, or a 400 naming the
field). A hand-written list pins the ranges themselves to what a vLLM user expects, and
the OpenAPI schema shows the same bounds.
"""
import json
import math

import httpx
import pytest

from hybrid_engine.sampling_params import (FLOAT32_MAX, MAX_LOGPROBS, MAX_SEED, MAX_STOP_STRINGS, MIN_SEED, RANGES,
                                          TOP_K_OFF, ParameterError, Range, SamplingParams)
from tests.server.conftest import Server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
NONFINITE = (math.inf, -math.inf, math.nan)


def _beside(value: int | float, kind: type, direction: int) -> int | float:
    """The next representable value of `kind` after `value` in `direction` (+1 / -1)."""
    if kind is int:
        return value + direction
    return math.nextafter(value, direction * math.inf)


def edge_values(valid: Range) -> list[int | float]:
    """Each finite end of `valid` with its two neighbours, and inf / nan for floats."""
    values: list[int | float] = []
    for end in (valid.lo, valid.hi):
        if end is not None:
            values += [_beside(end, valid.kind, -1), end, _beside(end, valid.kind, +1)]
    if valid.kind is float:
        values += NONFINITE
    return values


# The ranges a vLLM user expects (field, value, accepted by both), written out independently
# of RANGES: no cap on temperature or repetition_penalty, finite floats only, 64-bit-safe seeds.
PINNED = [
    ("temperature", 0.0, True), ("temperature", 2.5, True), ("temperature", 1e6, True),
    ("temperature", -1e-9, False), ("temperature", math.inf, False), ("temperature", math.nan, False),
    ("repetition_penalty", 250.0, True), ("repetition_penalty", 1e-6, True), ("repetition_penalty", 0.0, False),
    ("repetition_penalty", math.inf, False),
    ("top_p", 1.0, True), ("top_p", 1e-6, True), ("top_p", 0.0, False), ("top_p", 1.0001, False),
    ("min_p", 0.0, True), ("min_p", 1.0, True), ("min_p", -0.01, False), ("min_p", 1.01, False),
    ("presence_penalty", -2.0, True), ("presence_penalty", 2.0, True), ("presence_penalty", 2.01, False),
    ("frequency_penalty", -2.01, False), ("frequency_penalty", math.nan, False),
    ("top_k", 0, True), ("top_k", 5, True), ("top_k", 2**70, True), ("top_k", -1, True), ("top_k", -2, False),
    ("seed", 0, True), ("seed", 2**63 - 1, True), ("seed", 2**63, False), ("seed", -1, True),
    ("seed", -2**63, True), ("seed", -2**63 - 1, False),
    ("logprobs", 0, True), ("logprobs", 20, True), ("logprobs", 21, False), ("logprobs", -1, False),
    ("max_tokens", 1, True), ("max_tokens", 0, False),
]
CASES = [(name, value) for name, valid in RANGES.items() for value in edge_values(valid)]
CASES += [(name, value) for name, value, _ in PINNED]


def _library_accepts(name: str, value: object) -> bool:
    """SamplingParams' verdict; a rejection must name the field."""
    try:
        SamplingParams(**{name: value})
    except ParameterError as exc:
        assert exc.param == name and name in str(exc), (name, value, str(exc))
        return False
    return True


def _request(path: str, name: str, value: int | float) -> tuple[str, dict]:
    """(request field, body) setting library field `name` to `value` through endpoint `path`."""
    if path == COMPLETIONS:
        body: dict = {"prompt": [1, 2, 3], "max_tokens": 1}
        field = name
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        field = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}.get(name, name)
        if name == "logprobs":
            body["logprobs"] = True
    body[field] = value
    return field, body


def _server_accepts(server: Server, path: str, name: str, value: int | float) -> bool:
    """The server's verdict; a rejection must be a 400 naming the request field."""
    field, body = _request(path, name, value)
    # json.dumps writes inf/nan as Infinity/NaN, which the server's JSON parser reads.
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    if r.status_code == 200:
        return True
    assert r.status_code == 400, (body, r.text)
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], (body, error)
    return False


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_library_and_server_agree(server: Server, path: str, name: str, value: int | float):
    assert _server_accepts(server, path, name, value) == _library_accepts(name, value)


@pytest.mark.parametrize("name, value, accepted", PINNED, ids=[f"{n}={v!r}" for n, v, _ in PINNED])
def test_pinned_ranges(name: str, value: int | float, accepted: bool):
    assert _library_accepts(name, value) == accepted


def test_top_k_off_spellings(server: Server):
    """vLLM's top_k -1 ("off") is the same as 0: the library keeps 0, and the server gives
    the same tokens for either."""
    def tokens(top_k: int) -> list[str]:
        _, body = _request(COMPLETIONS, "top_k", top_k)
        body.update(max_tokens=6, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
        r = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert TOP_K_OFF == -1 and SamplingParams(top_k=TOP_K_OFF).top_k == 0
    assert tokens(TOP_K_OFF) == tokens(0)


def test_negative_seeds_are_their_own_streams(server: Server):
    """Seeds take vLLM's int64 range: a negative seed is reproducible and not its absolute
    value's stream."""
    def tokens(seed: int) -> list[str]:
        body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.0, "seed": seed, "logprobs": 0,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(-5) == tokens(-5) != tokens(5)
    assert tokens(-2**63) == tokens(-2**63)


def test_empty_stop_string_is_refused(server: Server):
    """An empty stop string would match before every token: a 400 naming `stop`, as vLLM's."""
    for stop in ("", ["x", ""]):
        r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": [1, 2], "max_tokens": 1, "stop": stop},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "empty string" in r.json()["error"]["message"]
    assert not _library_accepts("stop", [""]) and not _library_accepts("stop", "")


@pytest.mark.parametrize("count", [MAX_STOP_STRINGS, MAX_STOP_STRINGS + 1])
def test_stop_string_count_agrees(server: Server, count: int):
    stop = [f"<{i}>" for i in range(count)]
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": [1, 2], "max_tokens": 1, "stop": stop}, timeout=60)
    assert r.status_code == (200 if count <= MAX_STOP_STRINGS else 400), r.text
    assert _library_accepts("stop", stop) == (r.status_code == 200)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "stop"


def test_constants_are_the_ranges():
    """The shared limits are the ends of the ranges that use them."""
    assert RANGES["logprobs"].hi == MAX_LOGPROBS == 20
    assert (RANGES["seed"].lo, RANGES["seed"].hi) == (MIN_SEED, MAX_SEED) == (-2**63, 2**63 - 1)
    assert RANGES["top_k"].lo == TOP_K_OFF == -1
    assert RANGES["temperature"].hi == RANGES["repetition_penalty"].hi == FLOAT32_MAX
    assert float(FLOAT32_MAX) == 2.0**128 * (1 - 2.0**-24)  # the largest finite float32


def _schema_bounds(prop: dict) -> dict:
    """minimum / exclusiveMinimum / maximum of an OpenAPI property (looking inside anyOf)."""
    keys = ("minimum", "exclusiveMinimum", "maximum")
    for option in [prop, *prop.get("anyOf", [])]:
        found = {k: option[k] for k in keys if k in option}
        if found:
            return found
    return {}


def test_openapi_schema_shows_the_ranges(server: Server):
    """The request schema's bounds are RANGES'."""
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    fields = {"CompletionRequest": {name: name for name in RANGES},
              "ChatCompletionRequest": {**{name: name for name in RANGES if name != "logprobs"},
                                        "max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}}
    for schema, mapping in fields.items():
        props = schemas[schema]["properties"]
        for field, name in mapping.items():
            valid = RANGES[name]
            expected = {}
            if valid.lo is not None:
                expected["exclusiveMinimum" if valid.lo_open else "minimum"] = valid.lo
            if valid.hi is not None:
                expected["maximum"] = valid.hi
            # Exact: the seed's 2**63 - 1 stays an integer (the schema is pydantic's own).
            assert _schema_bounds(props[field]) == expected, (schema, field)

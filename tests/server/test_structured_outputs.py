"""Structured outputs over HTTP (docs/structured_outputs.md): OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` on both endpoints, and forced tool
calls (`tool_choice` "required" or a named function), on the embedded model. Its random
weights make the texts arbitrary; the grammar makes them valid, which is what is checked."""
import json
import re

from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from tests.server.conftest import Server, serve_in_thread

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Give me JSON."}]
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                          "n": {"type": "integer", "minimum": -3, "maximum": 40}},
         "required": ["color", "n"]}
WX = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
COMPACT = {"disable_any_whitespace": True}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The embedded model with room for JSON a random model pads with white space (16
    characters at most between tokens)."""
    with serve_in_thread(lambda: LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=1024))) as s:
        yield s


def _post(server: Server, path: str, **body) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"max_tokens": 400, "temperature": 0.0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server: Server, path: str, **body) -> tuple[str, list[dict]]:
    """The streamed text (content or text deltas) and the chunks."""
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json={"max_tokens": 400, "temperature": 0.0, "stream": True,
                                                            **body}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    texts = [c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content") or ""
             for c in chunks if c["choices"]]
    return "".join(texts), chunks


def test_json_schema_response_format(server: Server):
    body = _post(server, CHAT, messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}})
    choice = body["choices"][0]
    value = json.loads(choice["message"]["content"])
    assert value["color"] in ("red", "green") and -3 <= value["n"] <= 40 and set(value) == {"color", "n"}
    assert choice["finish_reason"] == "stop"


def test_json_object_response_format_streams_the_same_text(server: Server):
    fields = dict(messages=USER, response_format={"type": "json_object"}, seed=3, temperature=1.0)
    whole = _post(server, CHAT, **fields)["choices"][0]
    streamed, _ = _stream_text(server, CHAT, **fields)
    assert streamed == whole["message"]["content"]
    if whole["finish_reason"] == "stop":  # (else max_tokens cut it: a prefix of an object)
        assert isinstance(json.loads(streamed), dict)
    else:
        assert streamed.startswith("{")


@pytest.mark.parametrize("structured, check", [
    ({"choice": ["yes", "no", "a.b|c"]}, lambda text: text in ("yes", "no", "a.b|c")),
    ({"regex": r"[a-f]{3}-\d{2}"}, lambda text: re.fullmatch(r"[a-f]{3}-\d{2}", text)),
    ({"json": COLOR, **COMPACT}, lambda text: json.loads(text)["color"] in ("red", "green")),
    ({"json": json.dumps(COLOR), **COMPACT}, lambda text: set(json.loads(text)) == {"color", "n"}),
    ({"json_object": True, **COMPACT}, lambda text: isinstance(json.loads(text), dict)),
])
def test_structured_outputs_on_completions(server: Server, structured: dict, check):
    body = _post(server, COMPLETIONS, prompt="Answer: ", structured_outputs=structured, n=2, temperature=1.0,
                 seed=5)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_named_tool_choice_is_a_call_of_that_function(server: Server):
    choice = _post(server, CHAT, messages=USER, tools=[WX, TIME], tool_choice={"type": "function",
                                                                               "function": {"name": "wx"}},
                   structured_outputs=None)["choices"][0]
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1, message
    call = message["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "wx" and set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    assert choice["finish_reason"] == "stop"  # (vLLM's: a call the request named)


def test_required_tool_choice_calls_some_tools(server: Server):
    choice = _post(server, CHAT, messages=USER, tools=[WX, TIME], tool_choice="required", temperature=1.0,
                   seed=11)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and choice["finish_reason"] == "tool_calls", choice
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        assert (call["function"]["name"], sorted(arguments)) in (("wx", ["city", "days"]), ("time", ["zone"]))
    _, chunks = _stream_text(server, CHAT, messages=USER, tools=[WX, TIME], tool_choice="required",
                             temperature=1.0, seed=11)
    streamed = [c for chunk in chunks for choice in chunk["choices"]
                for c in (choice.get("delta") or {}).get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": "^$"}}, "structured_outputs.regex"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": "a{0}"}}, "structured_outputs.regex"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                                          "schema": False}}},
     "response_format.json_schema"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"json": False, "regex": "a"}}, "structured_outputs"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"json_object": False}}, "structured_outputs"),
])
def test_grammars_that_cannot_be_met_are_400s_naming_the_field(server: Server, path: str, body: dict, param: str):
    """Streamed or not: a 400 before anything is generated (a grammar that accepts only the
    empty output, the `false` schema, two grammars or none)."""
    for stream in (False, True):
        r = httpx.post(f"{server.url}{path}", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (stream, r.text)


def test_json_schema_without_a_schema_is_any_object(server: Server):
    choice = _post(server, CHAT, messages=USER, response_format={"type": "json_schema", "json_schema": {
        "name": "anything"}}, structured_outputs=None)["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_auto_tool_parsing_leaves_a_constrained_reply_alone():
    """With --tool-call-parser, tools and tool_choice "auto", a reply a grammar constrained is
    that grammar's text: a tag inside a JSON string is no call (the choice below is the
    only text the grammar allows)."""
    text = '{"note": "<tool_call><function=wx></function></tool_call>"}'
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=1024)
    with serve_in_thread(lambda: LLMEngine(config), tool_call_parser="qwen3_coder") as s:
        choice = _post(s, CHAT, messages=USER, tools=[WX], structured_outputs={"choice": [text]})["choices"][0]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


ORDER = {"type": "function", "function": {"name": "order", "parameters": {
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
                                                        "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["sku", "qty"]}},
    "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1,
                                               "maxItems": 2}}, "required": ["items"]}}}
CHAIN = {"type": "function", "function": {"name": "chain", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"$ref": "#"}},
    "required": ["n"]}}}


def test_required_calls_of_tools_whose_parameters_refer_into_themselves(server: Server):
    """Each tool's `$ref`s ("#/$defs/Item", "#") keep pointing into its own parameters when
    "required" puts them all in one list schema. (A random model may write calls until
    max_tokens: of six seeds, the replies it finished are checked, at least two.)"""
    def chain_ok(value: dict) -> bool:
        return set(value) <= {"n", "next"} and 0 <= value["n"] <= 9 and ("next" not in value or chain_ok(value["next"]))

    finished = 0
    for seed in range(6):
        choice = _post(server, CHAT, messages=USER, tools=[ORDER, CHAIN], tool_choice="required", temperature=1.0,
                       seed=seed, max_tokens=900)["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        finished += 1
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "order":
                assert 1 <= len(arguments["items"]) <= 2
                assert all(len(item["sku"]) <= 4 and 1 <= item["qty"] <= 9 for item in arguments["items"])
            else:
                assert call["function"]["name"] == "chain" and chain_ok(arguments)
    assert finished >= 2


def test_forced_call_errors_name_the_path_inside_the_tool(server: Server):
    bad = {"type": "function", "function": {"name": "n", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer", "multipleOf": 3}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "n"}}):
        r = httpx.post(f"{server.url}{CHAT}", json={"messages": USER, "tools": [WX, bad], "tool_choice": choice},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        where = "tools[1].function.parameters.properties.k" if choice == "required" else "$.properties.k"
        assert f"'multipleOf' at {where}" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field, value", [("guided_json", {"type": "object"}), ("guided_regex", "a+"),
                                          ("guided_choice", ["a"])])
def test_older_vllm_fields_point_to_structured_outputs(server: Server, field: str, value):
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "a", field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "structured_outputs" in r.json()["error"]["message"]

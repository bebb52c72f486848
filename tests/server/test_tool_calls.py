"""`--enable-auto-tool-choice --tool-call-parser` (hybrid_engine/server/tool_calls.py): the
calls a reply writes between tags become `tool_calls`, the rest stays content; a stream
splits exactly as the whole reply does; requests with tools reach the template."""
import json
import random
from typing import Iterator

import httpx
import pytest
from tokenizers import AddedToken

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.chat import ReplySplit
from hybrid_engine.server.reasoning import ReasoningSplit
from hybrid_engine.server.tool_calls import TOOL_CALL_PARSERS, ToolCallSplit
from tests.server.conftest import MAX_MODEL_LEN, Server, serve_in_thread

HERMES, NEMOTRON, QWEN3_CODER = (TOOL_CALL_PARSERS[name] for name in ("hermes", "nemotron_json", "qwen3_coder"))
WX = {"type": "function", "function": {"name": "wx", "parameters": {"type": "object"}}}


def _whole(fmt, reply: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = ToolCallSplit(fmt).feed(reply, final=True)
    return content, [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("fmt, reply, content, calls", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "wx", "arguments": {"city": "Paris"}}\n</tool_call>\n', "Sure.",
     [("wx", '{"city": "Paris"}')]),
    (HERMES, '<tool_call>{"name": "a"}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\":1}"}</tool_call>',
     "", [("a", "{}"), ("b", '{"x":1}')]),  # arguments: an object written out, a string kept
    (HERMES, "No tools needed.  \n", "No tools needed.  \n", []),  # (white space stays when nothing is called)
    (HERMES, "<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>{"name": "wx"', '<tool_call>{"name": "wx"', []),  # left open, no call
    (HERMES, 'ok <tool_call>{"name": "wx"}', "ok", [("wx", "{}")]),  # left open by a stop string at "</tool_call>"
    (HERMES, '<tool_call>{"name": "wx", "arguments": null}</tool_call>', '<tool_call>{"name": "wx", '
     '"arguments": null}</tool_call>', []),  # arguments: an object or a string
    (HERMES, '<tool_call>{"name": "wx", "arguments": {"x": NaN}}</tool_call>', '<tool_call>{"name": "wx", '
     '"arguments": {"x": NaN}}</tool_call>', []),  # (no NaN in JSON)
    (HERMES, 'Sure. <tool_call>{"name": "wx"}</tool_call> Done. ', "Sure. Done.", [("wx", "{}")]),
    (HERMES, "see <tool_c", "see <tool_c", []),
    (HERMES, '<tool_call>{"name": "wx"}</tool_call>\nDone.', "\nDone.", [("wx", "{}")]),
    (NEMOTRON, '<TOOLCALL>[{"name": "wx", "arguments": {"c": "日本"}}, {"name": "t"}]</TOOLCALL>', "",
     [("wx", '{"c": "日本"}'), ("t", "{}")]),
    (NEMOTRON, '<TOOLCALL>{"name": "wx"}</TOOLCALL>', "", [("wx", "{}")]),  # an object for the list (as vLLM)
    (NEMOTRON, '<TOOLCALL>[{"name": "wx"}, 5, {"x": 1}]</TOOLCALL>', "", [("wx", "{}")]),  # items no call: skipped
    (NEMOTRON, 'Hi \n<TOOLCALL>[]</TOOLCALL>', 'Hi \n<TOOLCALL>[]</TOOLCALL>', []),  # no call: content as written
])
def test_whole_replies(fmt, reply: str, content: str, calls: list):
    assert _whole(fmt, reply) == (content, calls)


SCHEMA = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
    "opts": {"type": "object"}, "ids": {"type": "array"}}}}}


@pytest.mark.parametrize("reply, content, arguments", [
    ("<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
     "</function>\n</tool_call>", "", {"cmd": "ls -la", "n": 3}),
    ("Let me.\n<tool_call><function=run><parameter=x>2.5</parameter><parameter=ok>True</parameter>"
     "<parameter=opts>{\"a\": [1]}</parameter><parameter=ids>[1, 2]</parameter></function></tool_call>", "Let me.",
     {"x": 2.5, "ok": True, "opts": {"a": [1]}, "ids": [1, 2]}),
    # a string stays text, "null" is null, text that is not its type stays text, as do parameters the
    # schema does not know; an integral number is an int, an infinite one text
    ("<tool_call><function=run><parameter=cmd>42</parameter><parameter=n>null</parameter>"
     "<parameter=x>many</parameter><parameter=extra>\n 7 \n</parameter></function></tool_call>", "",
     {"cmd": "42", "n": None, "x": "many", "extra": " 7 "}),
    ("<tool_call><function=run><parameter=x>1e3</parameter><parameter=ok>yes</parameter></function></tool_call>"
     "<tool_call><function=run><parameter=x>1e400</parameter></function></tool_call>", "",
     {"x": 1000, "ok": "yes"}),
    # cut off: read as far as it goes (no </parameter>, no </function>)
    ("<tool_call><function=run><parameter=cmd>ls<parameter=n>2", "", {"cmd": "ls", "n": 2}),
    # nested past what JSON parsing can take: text, not a failed request
    ("<tool_call><function=run><parameter=ids>" + "[" * 3000 + "</parameter></function></tool_call>", "",
     {"ids": "[" * 3000}),
])
def test_qwen3_coder_calls(reply: str, content: str, arguments: dict):
    """Nemotron-3-Nano's and Qwen3-Coder's XML calls, each value read as its parameter's
    schema type in the request's tools."""
    got, calls = ToolCallSplit(QWEN3_CODER, [SCHEMA]).feed(reply, final=True)
    assert got == content and [(c.name, json.loads(c.arguments)) for c in calls][:1] == [("run", arguments)]


def test_call_ids_are_distinct():
    _, calls = ToolCallSplit(HERMES).feed('<tool_call>{"name": "a"}</tool_call>' * 3, final=True)
    assert len({call.id for call in calls}) == 3 and all(call.id.startswith("call_") for call in calls)


@pytest.mark.parametrize("fmt", [HERMES, NEMOTRON, QWEN3_CODER])
def test_a_stream_splits_as_the_whole_reply(fmt):
    """Every way of cutting a reply into deltas (tags cut anywhere) gives the whole reply's
    content and calls."""
    rng = random.Random(0)
    call = {HERMES: '{"name": "wx", "arguments": {"a": 1}}', NEMOTRON: '[{"name": "wx"}]',
            QWEN3_CODER: "<function=wx>\n<parameter=a>\n1\n</parameter>\n</function>"}[fmt]
    pieces = [fmt.open + call + fmt.close, fmt.open + "{bad" + fmt.close, fmt.open, fmt.close, fmt.open[:4], " ",
              "\n", "x", "<"]
    called = 0
    for _ in range(600):
        reply = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        whole = _whole(fmt, reply)
        called += bool(whole[1])
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 12))))
        split, content, calls = ToolCallSplit(fmt), "", []
        for start, end in zip([0] + cuts, cuts + [len(reply)]):
            c, parsed = split.feed(reply[start:end], final=end == len(reply))
            content, calls = content + c, calls + [(p.name, p.arguments) for p in parsed]
        assert (content, calls) == whole, (reply, cuts)
    assert called > 100  # (the replies call often enough for the cuts to land in tags)


def test_reasoning_first_then_calls():
    """With both parsers the calls come out of the content, never out of the reasoning, and a
    reply that stopped after calling finishes with "tool_calls"."""
    split = ReplySplit(ReasoningSplit.for_reply("<think>\n"), ToolCallSplit(HERMES))
    reply = 'I could <tool_call>{"name": "no"}</tool_call></think><tool_call>{"name": "wx"}</tool_call>'
    reasoning, content, calls = split.feed(reply, final=True)
    assert reasoning == 'I could <tool_call>{"name": "no"}</tool_call>' and content == ""
    assert [call.name for call in calls] == ["wx"]
    assert (split.finish_reason("stop"), split.finish_reason("length")) == ("tool_calls", "length")
    assert ReplySplit(None, ToolCallSplit(HERMES)).finish_reason("stop") == "stop"  # nothing called


@pytest.fixture(scope="module")
def tools_server() -> Iterator[Server]:
    """The embedded model with a template that writes the tools' names, serving tool calls;
    its tokenizer marks the call tags special (as some do; the model never samples them)."""
    def engine() -> LLMEngine:
        built = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN))
        built.tokenizer.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                                         "{{ messages[-1].content }}")
        built.tokenizer.add_tokens([AddedToken(tag, special=True) for tag in ("<tool_call>", "</tool_call>")])
        return built

    with serve_in_thread(engine, tool_call_parser="hermes") as server:
        yield server


def test_the_server_takes_tools(tools_server: Server):
    """The definitions reach the template; a reply that calls nothing (the embedded model's
    random text) is content as ever, with no `tool_calls` key; streams carry no calls."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WX], "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["prompt_tokens"] == len(b"[wx]hi")
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
    stream = httpx.post(f"{tools_server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
    assert all("tool_calls" not in d for d in deltas)


def test_replies_whose_call_tags_are_special_keep_special_tokens(tools_server: Server):
    """Where the tokenizer marks the call tags special, they must reach the text: the same
    tokens read as with `skip_special_tokens: false` when calls are parsed."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WX], "max_tokens": 80, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}

    def content(**fields) -> str:
        reply = httpx.post(f"{tools_server.url}/v1/chat/completions", json={**body, **fields}, timeout=60).json()
        return reply["choices"][0]["message"]["content"]

    parsed = content()
    assert any(special in parsed for special in ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"))
    assert parsed == content(tool_choice="none", skip_special_tokens=False) != content(tool_choice="none")

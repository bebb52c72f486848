"""`--reasoning-parser` (hybrid_engine/server/reasoning.py): a reply's thinking goes to
`reasoning`, the rest to `content`; where a reply starts is read off the prompt; a stream
splits exactly as the whole reply does."""
import json
import random
from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.reasoning import ReasoningSplit, opens_in_reasoning
from tests.server.conftest import MAX_MODEL_LEN, Server, serve_in_thread
from tests.server.test_chat_options import THINKING_TEMPLATE

OPEN, CLOSED, NONE = "<|im_start|>assistant\n<think>\n", "assistant\n<think></think>", "<|im_start|>assistant\n"


@pytest.mark.parametrize("tail, opens", [(OPEN, True), (CLOSED, False), (NONE, False),
                                         ("<think>a</think> b <think>", True), ("", False)])
def test_an_open_think_tag_at_the_prompts_end_opens_the_reply(tail: str, opens: bool):
    assert opens_in_reasoning(tail) == opens


@pytest.mark.parametrize("tail, reply, reasoning, content", [
    (OPEN, "Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),
    (OPEN, "<think>\nLet me see.</think>4", "\nLet me see.", "4"),  # a repeated open tag is dropped
    (OPEN, "Cut off by the token limit", "Cut off by the token limit", ""),
    (OPEN, "</think>4", "", "4"),
    (OPEN, "a</think>b</think>c", "a", "b</think>c"),  # thinking ends at the first close tag
    (CLOSED, "It is 4.", "", "It is 4."),
    (CLOSED, "<think>x</think>4", "x", "4"),  # a reply may still open a block at its start
    (NONE, " \n<think>hm</think>It is 4.", "hm", "It is 4."),
    (NONE, "It is <think> 4.", "", "It is <think> 4."),  # an open tag only counts first
    (NONE, "  ", "", "  "),
    (NONE, "<thin", "", "<thin"),
])
def test_whole_replies(tail: str, reply: str, reasoning: str, content: str):
    assert ReasoningSplit.for_reply(tail).feed(reply, final=True) == (reasoning, content)


@pytest.mark.parametrize("tail", [OPEN, NONE])
def test_a_stream_splits_as_the_whole_reply(tail: str):
    """Every way of cutting a reply into deltas (tags cut anywhere) gives the whole reply's
    split, and nothing comes out before it is known to be reasoning or content."""
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", " ", "\n", "a", "<", "b"]
    for _ in range(400):
        reply = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        whole = ReasoningSplit.for_reply(tail).feed(reply, final=True)
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 6))))
        split, reasoning, content = ReasoningSplit.for_reply(tail), "", ""
        for start, end in zip([0] + cuts, cuts + [len(reply)]):
            r, c = split.feed(reply[start:end], final=end == len(reply))
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == whole, (tail, reply, cuts)


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[Server]:
    """The embedded model with a template that opens a thinking block (closed with
    `enable_thinking: false`), served with a reasoning parser."""
    def engine() -> LLMEngine:
        built = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN))
        built.tokenizer.chat_template = THINKING_TEMPLATE
        return built

    with serve_in_thread(engine, reasoning_parser="deepseek_r1") as server:
        yield server


def _chat(server: Server, stream: bool = False, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_the_server_splits_replies(thinking_server: Server):
    """The embedded model's reply (random text, no close tag) to a prompt that opens a block
    is all reasoning; with the block closed in the prompt it is all content; streams carry
    the same text as `delta.reasoning` / `delta.content`."""
    thinking = _chat(thinking_server).json()["choices"][0]["message"]
    plain = _chat(thinking_server, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert thinking["content"] is None and thinking["reasoning"] and "</think>" not in thinking["reasoning"]
    assert "reasoning" not in plain and plain["content"]
    events = [json.loads(line[len("data: "):]) for line in _chat(thinking_server, stream=True).text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == thinking["reasoning"]
    assert all(not d.get("content") for d in deltas)


def test_reasoning_sent_back_is_accepted(thinking_server: Server):
    """A client sends the reply back whole (vLLM's `reasoning` or DeepSeek's
    `reasoning_content`); only an assistant message may carry it."""
    for key in ("reasoning", "reasoning_content"):
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4", key: "2+2"},
                   {"role": "user", "content": "and?"}]
        assert _chat(thinking_server, messages=history).status_code == 200
    r = _chat(thinking_server, messages=[{"role": "user", "content": "hi", "reasoning": "x"}])
    assert r.status_code == 400 and "reasoning" in r.json()["error"]["message"]


def test_include_reasoning_false_leaves_it_out(thinking_server: Server):
    """vLLM's `include_reasoning: false`: the reasoning is dropped, the content is as ever."""
    plain = _chat(thinking_server, include_reasoning=False).json()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": None}
    events = [json.loads(line[len("data: "):]) for line in
              _chat(thinking_server, stream=True, include_reasoning=False).text.splitlines()
              if line.startswith("data: {")]
    assert all("reasoning" not in e["choices"][0]["delta"] for e in events if e["choices"])


def test_reasoning_effort_reaches_the_template():
    """OpenAI's `reasoning_effort` is a template variable of that name (as vLLM hands it on),
    unless chat_template_kwargs sets it."""
    def engine() -> LLMEngine:
        built = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN))
        built.tokenizer.chat_template = "{{ messages[0].content }} effort={{ reasoning_effort | default('none') }}"
        return built

    with serve_in_thread(engine) as server:
        def prompt(**fields) -> bytes:
            body = {"messages": [{"role": "user", "content": "hi"}], **fields}
            return bytes(httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"])

        def chat_prompt_tokens(**fields) -> int:
            return _chat(server, **fields).json()["usage"]["prompt_tokens"]

        assert chat_prompt_tokens(reasoning_effort="low") == len(b"hi effort=low")
        assert chat_prompt_tokens() == len(b"hi effort=none")
        assert chat_prompt_tokens(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == \
            len(b"hi effort=high")
        assert prompt() == b"hi effort=none"
        assert _chat(server, reasoning_effort="extreme").status_code == 400

"""The OpenAI-compatible endpoints through the official `openai` client (and httpx)."""
import json

import httpx
import openai
import pytest
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.bodies import validated
from hybrid_engine.server.protocol import CompletionRequest
from hybrid_engine.sampling import derive_seed
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.server.conftest import MAX_MODEL_LEN, Server, serve_in_thread

MODEL = "hybrid-engine/embedded-tiny"
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    """The official OpenAI client pointed at the shared server (no retries)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(server: Server, client: openai.OpenAI):
    """/v1/models lists the served model with its context; /health is ok."""
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    card = client.models.retrieve(MODEL)  # the name holds a slash
    assert card.id == MODEL and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_completion_fields(client: openai.OpenAI):
    """A completion carries id, object, model, one choice and exact usage."""
    r = client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # no other test prompt starts with "Hello"


def test_completion_prompt_shapes(client: openai.OpenAI):
    """String, list of strings, token ids, list of token-id lists: one choice per prompt."""
    one = client.completions.create(model=MODEL, prompt="ab", **GREEDY).choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[97, 98], **GREEDY).choices[0].text
    assert ids == one  # the byte tokenizer: "ab" is [97, 98]
    many = client.completions.create(model=MODEL, prompt=["ab", "xyz", "ab"], **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == many.choices[2].text == one
    assert many.usage.prompt_tokens == 7 and many.usage.completion_tokens == 36
    lists = client.completions.create(model=MODEL, prompt=[[97, 98], [120, 121, 122]], **GREEDY)
    assert [c.text for c in lists.choices] == [c.text for c in many.choices[:2]]


SEEDED = dict(temperature=0.8, max_tokens=12, seed=7, extra_body={"ignore_eos": True})


def test_n_choices_per_prompt_match_the_library(client: openai.OpenAI):
    """n=2 over two prompts: choice j of prompt i has index 2i + j and draws with the
    request's seed (j = 0) or derive_seed(seed, -j), token for token the library's output
    with that seed; each prompt's tokens count once in usage."""
    r = client.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, **SEEDED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    llm = LLM(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    for i, prompt in enumerate(["ab", "xyz"]):
        for j in range(2):
            params = SamplingParams(max_tokens=12, temperature=0.8, seed=7 if j == 0 else derive_seed(7, -j),
                                    ignore_eos=True)
            assert r.choices[2 * i + j].text == llm.generate([prompt], params, use_tqdm=False)[0].text, (i, j)
    assert r.choices[0].text != r.choices[1].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 48)
    greedy = client.completions.create(model=MODEL, prompt="ab", n=3, **GREEDY)
    assert len({c.text for c in greedy.choices}) == 1  # greedy choices agree


def test_n_choices_stream_like_the_response(client: openai.OpenAI):
    """Streamed n=2 completions and n=3 chat choices concatenate, index by index, to the
    non-streamed ones; each chat choice's first chunk carries the role; usage is the same."""
    full = client.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, **SEEDED)
    texts, usage = ["", "", "", ""], None
    for chunk in client.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, stream=True,
                                           stream_options={"include_usage": True}, **SEEDED):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in full.choices] and usage == full.usage
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=3, **SEEDED)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 3
    single = client.chat.completions.create(model=MODEL, messages=messages, **SEEDED)
    assert chat.choices[0].message.content == single.choices[0].message.content  # choice 0 keeps the seed
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    contents, roles = ["", "", ""], []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=3, stream=True,
                                                stream_options={"include_usage": True}, **SEEDED):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            contents[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert roles == [0, 1, 2] and contents == [c.message.content for c in chat.choices]
    assert usage == chat.usage and usage.completion_tokens == 36


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_that_makes_too_many_sequences_names_n(server: Server, path: str):
    """Prompts x n beyond what one request may bring is a 400 naming n (the prompts alone
    fit), in both endpoints."""
    cap = server.llm.max_prompts_per_request
    prompts = 1 if "chat" in path else cap // 2 + 1
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": ["a"] * prompts}
    r = httpx.post(f"{server.url}{path}", json={**body, "n": 2 if prompts > 1 else cap + 1, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "n" and "sequences in one request" in error["message"], error


def test_too_many_prompts_with_n_counts_the_prompts(server: Server):
    """More prompts than the cap, each with n = 2 choices: the 400 names "prompt" and counts
    the prompts sent, not prompts x n."""
    cap = server.llm.max_prompts_per_request
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [[1]] * (cap + 1), "n": 2, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", error
    assert error["message"].startswith(f"prompt: {cap + 1} prompts in one request;"), error


def test_unseeded_choices_differ_from_each_other(client: openai.OpenAI):
    """Without a seed each choice gets an engine seed of its own: the choices differ."""
    r = client.completions.create(model=MODEL, prompt="ab", n=3, temperature=0.8, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert len({c.text for c in r.choices}) == 3


def test_unset_max_tokens_is_16_for_completions_and_the_room_left_for_chat(client: openai.OpenAI):
    """No max_tokens: a completion gets 16 tokens, as OpenAI's legacy completions and vLLM
    give it, or the room the context leaves where that is less; a chat completion gets all
    the room left, as OpenAI's chat and vLLM give it."""
    r = client.completions.create(model=MODEL, prompt="abcd", temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    r = client.completions.create(model=MODEL, prompt=[97] * (MAX_MODEL_LEN - 5), temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens > 16


def test_chat_completion(client: openai.OpenAI):
    """Chat renders the ChatML template; the reply is an assistant message."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    tokenizer = build_byte_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 12


def test_chat_tool_call_history(client: openai.OpenAI):
    """A tool-using client's second turn: the assistant's tool call (content null; `index`
    as streamed-delta collectors keep it) and the tool's answer (as text parts, joined with
    a newline) go through the chat template, the call's JSON arguments as a mapping."""
    call = {"id": "c1", "type": "function", "function": {"name": "wx", "arguments": '{"at": 1}'}}
    messages = [{"role": "user", "content": "wx?"},
                {"role": "assistant", "content": None, "tool_calls": [{**call, "index": 0}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "o"},
                                                                   {"type": "text", "text": "k"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    tokenizer = build_byte_tokenizer()
    rendered = [{"role": "user", "content": "wx?"}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": "o\nk", "tool_call_id": "c1"}]
    rendered[1]["tool_calls"] = [{**call, "function": {"name": "wx", "arguments": {"at": 1}}}]
    prompt = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "wx", "arguments": {"at": 1}}\n</tool_call>' in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_chat_marker_characters_in_markup_fields_are_refused(server: Server):
    """Message texts are marked in chat rendering with private-use characters
    (hybrid_engine/chat_markup.py); a field the template writes as it is (here a tool call's
    name) may not hold one, so that no piece of a marker in the markup is the client's: a
    400 naming the field. In a message's text they are characters like any other."""
    call = {"id": "c1", "type": "function", "function": {"name": "wx\ue0000\ue000", "arguments": "{}"}}
    messages = [{"role": "user", "content": "longer than it"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0.function.name", r.text
    texts = [{"role": "user", "content": "a \ue000\ue0010-0\ue003 b"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": texts, "max_tokens": 1}, timeout=60)
    tokenizer = build_byte_tokenizer()
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(
        tokenizer.apply_chat_template(texts, tokenize=False, add_generation_prompt=True)))


@pytest.mark.parametrize("max_tokens, max_completion_tokens", [(9, 3), (3, 9), (None, 4)])
def test_chat_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI, max_tokens, max_completion_tokens):
    """With both set, chat generates max_completion_tokens tokens, whichever is larger."""
    extra = {"ignore_eos": True} if max_tokens is None else {"ignore_eos": True, "max_tokens": max_tokens}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0,
                                       max_completion_tokens=max_completion_tokens, extra_body=extra)
    assert r.usage.completion_tokens == max_completion_tokens and r.choices[0].finish_reason == "length"


def test_chat_context_error_names_max_completion_tokens(server: Server):
    """A max_completion_tokens beyond the context is a 400 naming that field, even next to a
    max_tokens that would fit."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_completion_tokens": MAX_MODEL_LEN}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_completion_tokens"


@pytest.mark.parametrize("prompt", ["Once upon", ["a", "bc"]])
def test_completion_stream_equals_non_stream(client: openai.OpenAI, prompt):
    """Greedy streamed text, tokens, finish reasons and usage equal the non-streamed ones."""
    full = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **GREEDY)
    stream = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, tokens, reasons, usage = {}, {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    for c in full.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert reasons[c.index] == c.finish_reason == "length"
    assert usage == full.usage


def test_chat_stream_equals_non_stream(client: openai.OpenAI):
    """The chat stream starts with the role, then concatenates to the non-streamed message."""
    messages = [{"role": "user", "content": "tell me"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == full.usage


def test_stream_without_usage_option(server: Server):
    """A plain stream is SSE ending in [DONE]."""
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_completion_logprobs_legacy_format(client: openai.OpenAI):
    """logprobs=n gives parallel per-token lists with at most n alternatives."""
    r = client.completions.create(model=MODEL, prompt="abc", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Greedy: the sampled token is the most likely one (top_logprobs is keyed by text, so
    # tokens decoding to the same text -- partial UTF-8 bytes -- collapse into one entry).
    assert all(max(top.values()) <= v + 1e-4 for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs_content_format(client: openai.OpenAI):
    """logprobs + top_logprobs give the chat content-list format."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # Byte tokenizer: every non-special token is one byte, also when it is only part of a
    # character (its text is then U+FFFD, its bytes the real byte); together they spell the
    # content (special tokens are skipped there).
    special = set(build_byte_tokenizer().all_special_tokens)
    plain = [entry for entry in content if entry.token not in special]
    assert all(len(entry.bytes) == 1 for entry in plain)
    raw = b"".join(bytes(entry.bytes) for entry in plain)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4  # greedy: sampled = most likely
    without_top = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in without_top.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          **GREEDY).choices[0].logprobs is None


def test_seed_makes_sampling_reproducible(client: openai.OpenAI):
    """Same seed, same sampled text; different seeds differ."""
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="seed", max_tokens=16, temperature=1.0, seed=seed,
                                         top_p=0.9, presence_penalty=0.5, frequency_penalty=0.1,
                                         extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                                                     "ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stop_strings(client: openai.OpenAI):
    """A stop string (alone or in a list) truncates the text and is reported as stop_reason."""
    text = client.completions.create(model=MODEL, prompt="stop", **GREEDY).choices[0].text
    # The embedded model is seeded: this prompt's greedy text has ASCII letters or digits after
    # its first character, so there is something to stop on.
    cut = next((i for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isalnum()), None)
    assert cut is not None, f"no ASCII letter or digit to stop on in {text!r}"
    stop = text[cut]
    for value in (stop, [stop, "\u2603never"]):
        r = client.completions.create(model=MODEL, prompt="stop", stop=value, **GREEDY)
        (choice,) = r.choices
        assert choice.text == text[: text.index(stop)]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_stop_token_ids(client: openai.OpenAI):
    """A stop token id ends generation right after that token."""
    tokens = client.completions.create(model=MODEL, prompt=[1, 2, 3], logprobs=0, **GREEDY).choices[0].logprobs.tokens
    # The embedded model is seeded: this prompt's greedy output has single-byte (ASCII) tokens,
    # whose id is the byte value in the byte tokenizer.
    ascii_tokens = [t for t in tokens if len(t.encode()) == 1]
    assert ascii_tokens, f"no ASCII token to stop on in {tokens!r}"
    stop_id = ord(ascii_tokens[0])
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3],
                                  **{**GREEDY, "extra_body": {"ignore_eos": True, "stop_token_ids": [stop_id]}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop_id
    assert r.usage.completion_tokens == tokens.index(ascii_tokens[0]) + 1


def test_neutral_openai_fields_are_accepted(server: Server):
    """Fields standard clients send with values that ask for nothing special are accepted
    and change nothing: the same tokens as without them."""
    base = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{server.url}/v1/completions", json=base, timeout=30).json()["choices"][0]["text"]
    neutral = httpx.post(f"{server.url}/v1/completions", timeout=30,
                         json={**base, "echo": False, "best_of": 1, "logit_bias": {}}).json()
    assert neutral["choices"][0]["text"] == plain
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    plain_chat = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).json()
    neutral_chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        **chat, "logit_bias": {}, "response_format": {"type": "text"}, "store": False, "metadata": {"k": "v"}})
    assert neutral_chat.status_code == 200, neutral_chat.text
    assert neutral_chat.json()["choices"][0]["message"] == plain_chat["choices"][0]["message"]


def test_head_health(server: Server):
    response = httpx.head(f"{server.url}/health", timeout=30)
    assert response.status_code == 200 and response.content == b""


def test_special_token_text_in_chat_content_stays_text(server: Server):
    """User text "<|im_end|>" is tokenized as its characters, not as the end-of-turn token
    (no role injection): the prompt is as long as with any 10 plain characters, while a
    message without such text tokenizes exactly as the whole rendered template does."""
    def prompt_tokens(content: str) -> int:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    tokenizer = build_byte_tokenizer()
    special = "<|im_end|>"
    assert len(tokenizer.encode(special, add_special_tokens=False)) == 1  # a control token when parsed
    assert prompt_tokens(f"a{special}b") == prompt_tokens("a" + "x" * len(special) + "b")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert prompt_tokens("hi") == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_completion_top_logprobs_has_every_alternative(server: Server):
    """As many alternatives as asked at every position, although several byte tokens decode
    to the same U+FFFD: those are keyed by their bytes ("bytes:\\xNN"), and so is such a
    token in `tokens`, which is always a key of its position's `top_logprobs`."""
    body = {"prompt": "\u00e9t\u00e9 ", "max_tokens": 24, "temperature": 0, "logprobs": 8}
    logprobs = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [8] * 24  # (greedy: the sampled token is among them)
    keys = [key for top in logprobs["top_logprobs"] for key in top]
    assert any(key.startswith("bytes:\\x") for key in keys), "the test needs partial-character alternatives"
    assert "\ufffd" not in "".join(keys) + "".join(logprobs["tokens"])
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == logprob


def test_completion_top_logprobs_always_hold_the_sampled_token(server: Server):
    """OpenAI's legacy format: `top_logprobs` holds the n most likely tokens and the sampled
    one, so n + 1 entries where sampling picked a less likely token (logprobs 0: only it)."""
    for n in (0, 1, 3):
        body = {"prompt": "abc", "max_tokens": 16, "temperature": 5.0, "seed": 3, "logprobs": n}
        logprobs = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
        sizes = []
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert top[token] == logprob
            others = [v for k, v in top.items() if k != token]
            # the sampled token and the n best: n in all where it is one of them, else n + 1
            # where it is less likely than each of the n
            assert len(others) == n - 1 or (len(others) == n and logprob <= min(others, default=logprob))
            sizes.append(len(top))
        assert max(sizes) == n + 1, "temperature 5 should sample some token outside the top n"


def test_body_errors_are_fastapis():
    """`bodies.validated` (which decodes bodies on the tokenizer thread; the lanes:
    tests/server/test_robustness.py) raises the errors FastAPI's body parameter raises: bad
    JSON, no body, a wrong type, a body that is no JSON (another Content-Type, none, or JSON
    null), a body too deep to parse (its 400)."""
    assert validated(CompletionRequest, b'{"prompt": "a", "max_tokens": 2}', "application/json").max_tokens == 2
    errors = []
    for raw, content_type in ((b'{"prompt": ', "application/json"), (b"", "application/json"),
                              (b'{"prompt": "a", "max_tokens": "x"}', "application/json"),
                              (b"prompt=a", "text/plain"),
                              (b"[" * 100_000 + b"]" * 100_000, "application/json"),
                              (b'{"prompt": "a"}', None), (b"null", "application/json")):
        with pytest.raises((RequestValidationError, HTTPException)) as caught:
            validated(CompletionRequest, raw, content_type)
        errors.append(caught.value)
    kinds = [e.errors()[0]["type"] if isinstance(e, RequestValidationError) else e.status_code for e in errors]
    assert kinds[:3] == ["json_invalid", "missing", "int_type"] and kinds[3].endswith("_type") and kinds[4] == 400
    assert kinds[5].endswith("_type") and kinds[6].endswith("_type")  # no Content-Type; a JSON null
    assert errors[2].errors()[0]["loc"] == ("body", "max_tokens")


def test_several_served_model_names():
    """`--served-model-name a b` (vLLM's): every name is a model card and may be asked for;
    a response names the model the request asked for, else the first name."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    with serve_in_thread(lambda: LLMEngine(config), served_model_names=["first", "second"]) as server:
        cards = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["first", "second"]
        assert {card["root"] for card in cards} == {MODEL}
        assert httpx.get(f"{server.url}/v1/models/second").json()["id"] == "second"
        body = {"prompt": "hi", "max_tokens": 2}
        for asked, named in ((None, "first"), ("first", "first"), ("second", "second")):
            r = httpx.post(f"{server.url}/v1/completions", json={**body, "model": asked}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == named, r.text
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "second",
                             "stream": True}, timeout=60)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks and {chunk["model"] for chunk in chunks} == {"second"}
        missing = httpx.post(f"{server.url}/v1/completions", json={**body, "model": MODEL}, timeout=60)
        assert missing.status_code == 404 and "'first', 'second'" in missing.json()["error"]["message"]

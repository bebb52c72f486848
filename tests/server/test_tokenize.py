"""vLLM's /tokenize, /detokenize and /version: a prompt's or a chat's token ids are those
generation uses (the usage counts agree), ids decode back to the text, bad bodies are 400s
naming the field."""
import httpx
import pytest

from hybrid_engine import __version__
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.server.conftest import MAX_MODEL_LEN, Server

USER = [{"role": "user", "content": "h\u00e9llo <|im_end|>"}]  # (a special token's text stays text)


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _prompt_tokens(server: Server, path: str, body: dict) -> int:
    r = _post(server, path, {**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_tokenize_a_prompt_as_completions_encode_it(server: Server):
    r = _post(server, "/tokenize", {"prompt": "h\u00e9llo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tokenizer = build_byte_tokenizer()
    assert body["tokens"] == tokenizer.encode("h\u00e9llo") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["count"] == _prompt_tokens(server, "/v1/completions", {"prompt": "h\u00e9llo"})
    assert "token_strs" not in _post(server, "/tokenize", {"prompt": "a"}).json()


@pytest.mark.parametrize("options", [{}, {"tools": []}, {"add_generation_prompt": False},
                                     {"add_generation_prompt": False, "continue_final_message": True}])
def test_tokenize_messages_as_chat_renders_them(server: Server, options: dict):
    messages = USER + [{"role": "assistant", "content": "Hel"}] if options.get("continue_final_message") else USER
    r = _post(server, "/tokenize", {"messages": messages, **options})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == _prompt_tokens(server, "/v1/chat/completions", {"messages": messages, **options})
    # The user's "<|im_end|>" is characters: the token ends only the messages the template closes.
    closed = len(messages) - options.get("continue_final_message", False)
    assert r.json()["tokens"].count(build_byte_tokenizer().convert_tokens_to_ids("<|im_end|>")) == closed


def test_detokenize_returns_the_text(server: Server):
    for text in ("h\u00e9llo", "a\nb \u4e16\u754c"):
        ids = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
        r = _post(server, "/detokenize", {"tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"messages": USER, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function"),
    ("/detokenize", {"tokens": [1, 261]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(server: Server, path: str, body: dict, param: str):
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_other_models_are_404s_and_the_version(server: Server):
    assert _post(server, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    assert _post(server, "/detokenize", {"tokens": [1], "model": "other"}).status_code == 404
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}

"""A checkpoint without tokenizer files: token-id prompts work, text needs are 400s."""
import json
from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.models.embedded import EMBEDDED_CONFIG
from tests.server.conftest import Server, serve_in_thread


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory) -> Iterator[Server]:
    """A server over a tokenizer-less checkpoint directory (embedded config, random weights)."""
    # The embedded model's config as a checkpoint directory, random weights, no tokenizer.
    path = tmp_path_factory.mktemp("bare-checkpoint")
    (path / "config.json").write_text(json.dumps(EMBEDDED_CONFIG))
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", load_format="dummy", max_model_len=64)
    with serve_in_thread(lambda: LLMEngine(config)) as s:
        yield s


def test_token_id_prompts_work(bare_server: Server):
    """Token-id prompts generate (empty text, token_id:N logprob tokens), streamed or not."""
    body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "logprobs": 1, "ignore_eos": True}
    r = httpx.post(f"{bare_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["text"] == "" and choice["finish_reason"] == "length"
        assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
        assert len(choice["logprobs"]["tokens"]) == 4
    with httpx.stream("POST", f"{bare_server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "text"}),
    ("/v1/completions", {"prompt": [1, 2], "stop": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"prompt": "text"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_text_needs_a_tokenizer(bare_server: Server, path, body):
    """Text prompts, stop strings, chat and (de)tokenizing are 400s naming the missing tokenizer."""
    r = httpx.post(f"{bare_server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    assert httpx.get(f"{bare_server.url}/health").status_code == 200

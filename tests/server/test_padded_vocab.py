"""A checkpoint whose vocabulary is padded past its tokenizer (as real checkpoints pad to a
multiple of 64 or 128): prompt ids, sampled ids and logprob alternatives from the padded
range decode to empty text, never an error. The ids are not masked from sampling, so the
tokens stay the model's own."""
import json

import httpx
import pytest

from hybrid_engine import SamplingParams
from hybrid_engine.models.embedded import EMBEDDED_CONFIG
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.server.conftest import start_subprocess_server

PADDED_VOCAB = 320


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory):
    """Config of the embedded model with a vocabulary of 320 and its 261-token tokenizer
    (weights: load_format="dummy")."""
    path = tmp_path_factory.mktemp("padded")
    (path / "config.json").write_text(json.dumps({**EMBEDDED_CONFIG, "vocab_size": PADDED_VOCAB}))
    build_byte_tokenizer().save_pretrained(str(path))
    return str(path)


def test_library_generates_through_padded_ids(make_llm, padded_checkpoint):
    llm = make_llm(model=padded_checkpoint, load_format="dummy", max_num_seqs=2)
    known = len(llm.get_tokenizer())
    out = llm.generate([[5, 6, known + 3, 7]], SamplingParams(max_tokens=48, temperature=5.0, seed=1,
                                                              ignore_eos=True, logprobs=5), use_tqdm=False)[0]
    assert out.finish_reason == "length"
    ids = out.output_token_ids
    assert any(t >= known for t in ids), "the test needs a sampled id from the padded range"
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode([t for t in ids if t < known])


def test_server_answers_with_padded_ids(padded_checkpoint):
    with start_subprocess_server("--model", padded_checkpoint, "--load-format", "dummy", "--device", "cpu",
                                 "--max-num-seqs", "2") as (url, _):
        prompt = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"prompt": [5, 300, 6], "max_tokens": 4, "temperature": 0, "logprobs": 20})
        assert prompt.status_code == 200, prompt.text
        assert len(prompt.json()["choices"][0]["logprobs"]["tokens"]) == 4
        sampled = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 5.0, "seed": 1,
            "logprobs": True, "top_logprobs": 20, "stream": True})
        assert sampled.status_code == 200, sampled.text
        lines = [line for line in sampled.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")

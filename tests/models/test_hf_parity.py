"""Exact parity with transformers (the oracle) on tiny random checkpoints, CPU float32."""
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from tests.models.conftest import SingleSequence, hf_greedy, skip_unless_hf_oracle

PROMPT_LEN = 11


def _prompt(vocab: int, seed: int = 0, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_hf(hf_checkpoint):
    _, path, hf = hf_checkpoint
    ids = _prompt(hf.config.vocab_size)
    skip_unless_hf_oracle(hf)
    ours = SingleSequence(path).feed(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("logprobs", [1, None])  # None: the runner's greedy path (`greedy_tokens`)
def test_greedy_generation_and_logprobs_match_hf(hf_checkpoint, logprobs):
    _, path, hf = hf_checkpoint
    prompts = [_prompt(hf.config.vocab_size, seed=s, n=n) for s, n in ((0, PROMPT_LEN), (1, 3), (2, 19))]
    llm = LLM(model=path, device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=logprobs),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected, hf_logprobs = hf_greedy(hf, prompt, 32)
        assert out.output_token_ids == expected
        assert out.finish_reason == "length"
        if logprobs is None:
            assert out.logprobs is None
            continue
        ref = hf_logprobs.gather(1, torch.tensor(expected)[:, None])[:, 0]
        ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.output_token_ids)])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_one_shot(hf_checkpoint, chunk):
    _, path, hf = hf_checkpoint
    ids = _prompt(hf.config.vocab_size, n=23)
    one_shot = SingleSequence(path)
    expected = one_shot.feed(ids)[-1]
    chunked = SingleSequence(path)
    for i in range(0, len(ids), chunk):
        last = chunked.feed(ids[i:i + chunk])[-1]
    torch.testing.assert_close(last, expected, atol=1e-4, rtol=1e-4)
    for (conv_a, ssm_a), (conv_b, ssm_b) in zip(chunked.states(), one_shot.states()):
        torch.testing.assert_close(conv_a, conv_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm_a, ssm_b, atol=1e-4, rtol=1e-4)


def test_recurrent_decode_matches_chunked_scan(hf_checkpoint):
    """Feeding generated tokens one by one (decode path) equals prefilling them in one chunk."""
    _, path, hf = hf_checkpoint
    prompt, cont = _prompt(hf.config.vocab_size, n=9), _prompt(hf.config.vocab_size, seed=5, n=7)
    decoded = SingleSequence(path)
    decoded.feed(prompt)
    step_logits = torch.cat([decoded.feed([t], decode=True) for t in cont])
    scanned = SingleSequence(path)
    scanned.feed(prompt)
    scan_logits = scanned.feed(cont, prompt=False)  # generated tokens: no dt limit, like decode
    torch.testing.assert_close(step_logits, scan_logits, atol=1e-4, rtol=1e-4)
    for (conv_a, ssm_a), (conv_b, ssm_b) in zip(decoded.states(), scanned.states()):
        torch.testing.assert_close(conv_a, conv_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm_a, ssm_b, atol=1e-4, rtol=1e-4)

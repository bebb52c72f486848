"""The tensor-parallel tests' oracle: tiny checkpoints whose KV heads and Mamba groups
(2 each) are split at 2 ranks and replicated at 4, prompts, and transformers' greedy
answers (CPU float32) with their logprobs."""
import pytest
import torch

from hybrid_engine import SamplingParams
from tests.models.conftest import hf_greedy, make_hf_checkpoint

PROMPT_LENS = (5, 23, 11)
MAX_TOKENS = 10
LOGPROB_ATOL = 1e-4
MIN_TOP1_MARGIN = 1e-3
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


class Oracle:
    """A tiny checkpoint, prompts, and transformers' greedy answers with logprobs."""

    def __init__(self, path: str, hf, num_prompts: int = len(PROMPT_LENS), seed: int = 0):
        self.path = path
        gen = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()
                        for n in PROMPT_LENS[:num_prompts]]
        self.tokens, self.logprobs = [], []
        for prompt in self.prompts:
            tokens, logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
            top2 = logprobs.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP1_MARGIN, "near-tie in HF's greedy choice"
            self.tokens.append(tokens)
            self.logprobs.append(logprobs)

    def check(self, outputs) -> None:
        """Greedy tokens equal HF's; each sampled token's logprob within 1e-4 of HF's."""
        for out, tokens, logprobs in zip(outputs, self.tokens, self.logprobs):
            assert out.output_token_ids == tokens
            ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, tokens)])
            ref = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(ours, ref, atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory) -> Oracle:
    path = tmp_path_factory.mktemp("tp_nemotron")
    return Oracle(str(path), make_hf_checkpoint(path, "nemotron_moe_sharp"))


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Oracle:
    path = tmp_path_factory.mktemp("tp_granite")
    return Oracle(str(path), make_hf_checkpoint(path, "granite_moe_rope_sharp"))



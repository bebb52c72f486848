"""`speculative_config` validation (ValueError naming the field) and the n-gram proposer."""
import pytest

from hybrid_engine import LLM
from hybrid_engine.spec.config import SpeculativeConfig
from hybrid_engine.spec.ngram import NgramProposer


class _HasPropose:
    def propose(self, request_id, token_ids, num_tokens):
        return []


@pytest.mark.parametrize("config,field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ({"method": "proposer", "num_speculative_tokens": 2, "proposer": object()}, "proposer"),
    ({"method": "proposer", "num_speculative_tokens": 2}, "proposer"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x"}, "draft_model"),
    ("ngram", "speculative_config"),
])
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        LLM(device="cpu", speculative_config=config)


def test_ngram_defaults_follow_vllm():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = SpeculativeConfig.from_dict({"method": "proposer", "num_speculative_tokens": 1, "proposer": _HasPropose()})
    assert spec.method == "proposer"


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    # "7 8 9" occurs twice before the end; the latest occurrence (followed by 4 5) wins.
    assert ngram.propose("r", [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9], 2) == [4, 5]
    # A longer match beats a later shorter one: suffix "2 3" matched at 0, not "3" at 4.
    assert ngram.propose("r", [2, 3, 5, 6, 3, 7, 2, 3], 3) == [5, 6, 3]
    # The continuation is cut at the end of the context; no match gives no drafts.
    assert ngram.propose("r", [1, 2, 1], 5) == [2, 1]
    assert ngram.propose("r", [1, 2, 3], 2) == []
    assert NgramProposer(2, 2).propose("r", [5, 5], 2) == []

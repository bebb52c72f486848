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
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
    ("ngram", "speculative_config"),
])
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        LLM(device="cpu", speculative_config=config)


@pytest.mark.parametrize("bounds,message", [
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer, got 0"),
    ({"prompt_lookup_min": 0, "prompt_lookup_max": 3}, "prompt_lookup_min must be a positive integer, got 0"),
    # The bad value is the max's: the min (not given) does not take the blame.
    ({"prompt_lookup_max": 0}, "prompt_lookup_max must be a positive integer, got 0"),
    ({"prompt_lookup_min": False}, "prompt_lookup_min must be a positive integer, got False"),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 1.5}, "prompt_lookup_max must be a positive integer, got 1.5"),
])
def test_bad_prompt_lookup_bound_is_shown_as_given(bounds, message):
    """The error shows the value given, 0 and False included (not a defaulted None)."""
    with pytest.raises(ValueError, match=f"^speculative_config.{message}$"):
        LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2, **bounds})


def test_ngram_defaults_follow_vllm():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)
    spec = SpeculativeConfig.from_dict({"method": "proposer", "num_speculative_tokens": 1, "proposer": _HasPropose()})
    assert spec.method == "proposer"


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    # "7 8 9" occurs twice before the end; the latest occurrence (followed by 4 5) wins.
    assert ngram.propose("a", [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9], 2) == [4, 5]
    # A longer match beats a later shorter one: suffix "2 3" matched at 0, not "3" at 4.
    assert ngram.propose("b", [2, 3, 5, 6, 3, 7, 2, 3], 3) == [5, 6, 3]
    # Past the context's end the repeat goes on with its period (2 here, 1 below); no match
    # gives no drafts.
    assert ngram.propose("c", [1, 2, 1], 5) == [2, 1, 2, 1, 2]
    assert ngram.propose("f", [4, 5, 5, 5], 4) == [5, 5, 5, 5]
    assert ngram.propose("g", [4, 5, 5, 5], 4, num_committed=3) == [5, 5, 5, 5]  # the last 5 in flight
    assert ngram.propose("d", [1, 2, 3], 2) == []
    assert NgramProposer(2, 2).propose("e", [5, 5], 2) == []


def _scan(token_ids: list[int], num_tokens: int, committed: int, lo: int = 1, hi: int = 4) -> list[int]:
    """The n-gram search by brute force: the latest occurrence of the longest suffix among
    the n-grams that end inside the committed tokens, its continuation repeated with its
    period past the context's end."""
    length = len(token_ids)
    for n in range(min(hi, length - 1), lo - 1, -1):
        for end in range(committed - 1, n - 1, -1):
            if token_ids[end - n:end] == token_ids[length - n:]:
                return [token_ids[end + i % (length - end)] for i in range(num_tokens)]
    return []


def test_ngram_index_follows_a_growing_context_with_speculative_tokens():
    """The incremental index gives what a brute-force search gives while the committed
    context grows and tokens after it (in-flight drafts) come and go."""
    import random
    rng = random.Random(0)
    ngram, committed = NgramProposer(1, 4), []
    for step in range(600):
        committed.extend(rng.randrange(6) for _ in range(rng.randint(0, 3)))
        context = committed + [rng.randrange(6) for _ in range(rng.randint(0, 4))]  # + drafts in flight
        if len(context) < 2:
            continue
        want = _scan(context, 3, len(committed))
        assert ngram.propose("r", context, 3, num_committed=len(committed)) == want, step
    ngram.forget("r")
    assert "r" not in ngram._requests

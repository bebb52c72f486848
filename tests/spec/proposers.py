"""Proposers for the speculative-decoding tests: an oracle (knows each request's true
continuation), an adversary (always wrong), a partial one (the oracle, randomly corrupted),
and broken ones (raises, returns ids outside the vocabulary)."""
import random


class OracleProposer:
    """Proposes the true continuation: `truth[request_id]` is prompt + the output a
    non-speculative run produced. A context that leaves the truth gets no drafts."""

    def __init__(self, truth: dict[str, list[int]]):
        self.truth = truth
        self.calls = 0

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        self.calls += 1
        full = self.truth[request_id]
        if full[: len(token_ids)] != token_ids:
            return []
        return full[len(token_ids): len(token_ids) + num_tokens]


class AdversarialProposer(OracleProposer):
    """Proposes a token other than the true next one at every position."""

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        self.calls += 1
        full = self.truth[request_id]
        wrong = [(t + 1) % 256 for t in full[len(token_ids): len(token_ids) + num_tokens]]
        return wrong + [0] * (num_tokens - len(wrong))


class PartialProposer(OracleProposer):
    """The oracle's drafts with each token replaced by a random one of the vocabulary
    ([0, vocab_size)) with probability `rate`."""

    def __init__(self, truth: dict[str, list[int]], rate: float, seed: int = 0, vocab_size: int = 256):
        super().__init__(truth)
        self.rate, self.rng, self.vocab_size = rate, random.Random(seed), vocab_size

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        drafts = super().propose(request_id, token_ids, num_tokens)
        return [self.rng.randrange(self.vocab_size) if self.rng.random() < self.rate else t for t in drafts]


class RaisingProposer:
    """Raises for one request id (proposing, and forgetting it when it leaves), proposes
    nothing useful for the others."""

    def __init__(self, bad_id: str):
        self.bad_id = bad_id

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        if request_id == self.bad_id:
            raise RuntimeError("proposer bug")
        return token_ids[-num_tokens:]

    def forget(self, request_id: str) -> None:
        if request_id == self.bad_id:
            raise RuntimeError("forget bug")


class OutOfVocabProposer:
    """Returns ids outside the vocabulary (and a non-int) for every request."""

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list:
        return [10**9, -1, "x"][:num_tokens]

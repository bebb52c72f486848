"""Prompt-lookup (n-gram) drafts: continue the context as it continued before."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Odd multiplier of the n-gram hash (a polynomial in the token ids, wrapping modulo 2**64).
_HASH_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64


def _wrap64(value: int) -> int:
    """A Python int as the signed int64 NumPy would hold after wrapping."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class NgramProposer:
    """Finds the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`, longest first) and proposes the tokens that followed it.

    Each request's n-grams are indexed by a hash (n-gram -> where it last ended): the
    prompt in one vectorised pass when the request first asks, then the new tokens as its
    context grows, so a proposal costs a few dict lookups, not a scan. An indexed occurrence
    is checked against the current context before it is used (a hash collision, or a context
    that changed at its end: rejected launch-ahead drafts), and a failed check falls back to
    a scan.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # request id -> (per n: hash -> end of the latest occurrence, tokens indexed)
        self._index: dict[str, tuple[dict[int, dict[int, int]], int]] = {}

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts for the positions after `token_ids` (none if no match)."""
        length = len(token_ids)
        entry = self._index.get(request_id)
        if entry is None:
            entry = self._index[request_id] = (self._build(token_ids), length)
        index, indexed = entry
        if length > indexed:
            self._extend(index, token_ids, indexed, length)
            self._index[request_id] = (index, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index[n].get(self._hash(token_ids[length - n:]))
            if end is None:
                continue
            if end >= length or token_ids[end - n:end] != token_ids[length - n:]:
                return self._scan(token_ids, num_tokens)
            return token_ids[end:end + num_tokens]
        return []

    def _build(self, token_ids: list[int]) -> dict[int, dict[int, int]]:
        """Index every n-gram that ends before the last token (those have a continuation)."""
        context = np.asarray(token_ids[:-1], dtype=np.int64)
        index = {}
        for n in range(self.min_n, self.max_n + 1):
            if len(context) < n:
                index[n] = {}
                continue
            powers = np.array([_wrap64(pow(_HASH_MUL, n - 1 - i, 1 << 64)) for i in range(n)], dtype=np.int64)
            with np.errstate(over="ignore"):
                hashes = (sliding_window_view(context, n) * powers).sum(axis=1)
            # Later occurrences overwrite earlier ones: the latest wins.
            index[n] = dict(zip(hashes.tolist(), range(n, len(context) + 1)))
        return index

    def _extend(self, index: dict[int, dict[int, int]], token_ids: list[int], start: int, length: int) -> None:
        """Index the n-grams ending at positions start .. length-1."""
        for end in range(max(start, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[n][self._hash(token_ids[end - n:end])] = end

    @staticmethod
    def _hash(ngram: list[int]) -> int:
        value = 0
        for token in ngram:
            value = value * _HASH_MUL + token
        return _wrap64(value)

    def _scan(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """The same search by a scan of the whole context."""
        context = np.asarray(token_ids, dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = sliding_window_view(context[:-1], n)
            starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return token_ids[follow:follow + num_tokens]
        return []

    def forget(self, request_id: str) -> None:
        """Drop a finished request's index."""
        self._index.pop(request_id, None)

"""Prompt-lookup (n-gram) drafts: continue the context as it continued before."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Finds the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`, longest first) and proposes the tokens that followed it.

    Each request's n-grams are indexed as its context grows (n-gram -> where it last
    ended), so a proposal costs a few dict lookups, not a scan of the context. The context
    can shrink or change at its end (launch-ahead drafts that were rejected): an indexed
    occurrence is checked against the current context before it is used, and a stale one
    falls back to a scan.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, tuple[dict[tuple[int, ...], int], int]] = {}  # id -> (index, tokens indexed)

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts for the positions after `token_ids` (none if no match)."""
        index, indexed = self._index.get(request_id, ({}, 0))
        length = len(token_ids)
        # Index the n-grams that end before the last token (those have a continuation).
        for end in range(max(indexed, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(token_ids[end - n:end])] = end
        self._index[request_id] = (index, max(indexed, length))
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            end = index.get(tuple(suffix))
            if end is None:
                continue
            if end >= length or token_ids[end - n:end] != suffix:
                return self._scan(token_ids, num_tokens)  # the context changed under the index
            return token_ids[end:end + num_tokens]
        return []

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

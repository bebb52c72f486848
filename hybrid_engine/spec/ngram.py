"""Prompt-lookup (n-gram) drafts: continue the context as it continued before."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Finds the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`, longest first) and proposes the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts for the positions after `token_ids` (none if no match)."""
        context = np.asarray(token_ids, dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so a match always has a continuation.
            windows = sliding_window_view(context[:-1], n)
            starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return context[follow:follow + num_tokens].tolist()
        return []

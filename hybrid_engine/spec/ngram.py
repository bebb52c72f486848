"""Prompt-lookup (n-gram) drafts: continue the context as it continued before."""


class NgramProposer:
    """Finds the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`, longest first) and proposes the tokens that followed it.

    Each request's n-grams are indexed (n-gram -> where it last ended) as its committed
    context grows -- the prompt at once, its tuples built in C by `zip` -- so a proposal
    costs a few dict lookups, not a scan. Only committed tokens are indexed: the tokens
    after them (launch-ahead drafts still in flight) may be rejected and rewritten, so they
    only take part as the suffix looked up.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # request id -> (n-gram tuple -> end of its latest occurrence, tokens indexed)
        self._index: dict[str, tuple[dict[tuple[int, ...], int], int]] = {}

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int,
                num_committed: int | None = None) -> list[int]:
        """Up to `num_tokens` drafts for the positions after `token_ids` (none if no match).
        `num_committed`: how many leading tokens are final (default: all of them)."""
        length = len(token_ids)
        committed = length if num_committed is None else num_committed
        index, indexed = self._index.get(request_id, ({}, 0))
        if committed > indexed:
            self._add(index, token_ids, indexed, committed)
            self._index[request_id] = (index, committed)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end:end + num_tokens]
        return []

    def _add(self, index: dict[tuple[int, ...], int], token_ids: list[int], start: int, stop: int) -> None:
        """Index the n-grams that end at positions start .. stop-1 (each followed by a
        committed token); later occurrences overwrite earlier ones."""
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n)  # the first end position with a whole n-gram before it
            if first >= stop:
                continue
            if stop - first == 1:  # one new token (the common case): no zip machinery
                index[tuple(token_ids[first - n:first])] = first
                continue
            grams = zip(*(token_ids[first - n + k:stop - n + k] for k in range(n)))
            index.update(zip(grams, range(first, stop)))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's index."""
        self._index.pop(request_id, None)

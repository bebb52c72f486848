"""Prompt-lookup (n-gram) drafts: continue the context as it continued before."""
from dataclasses import dataclass, field


@dataclass
class _Indexed:
    """One request's committed tokens (its own copy) and their n-gram index."""

    tokens: list[int]
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # tokens whose n-grams are in the index


class NgramProposer:
    """Finds the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`, longest first) and proposes the tokens that followed it, the
    repeat continued past the context's end when it is shorter than the drafts wanted.

    Each request's committed tokens are copied and indexed (n-gram -> where it last ended)
    as they grow -- the prompt at once, its tuples built in C by `zip` -- so a proposal
    costs a few dict lookups and no pass over the context. Tokens after the committed ones
    (launch-ahead drafts still in flight) may be rejected and rewritten: they only take
    part as the suffix looked up and in the continuation proposed.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._requests: dict[str, _Indexed] = {}

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int,
                num_committed: int | None = None) -> list[int]:
        """Up to `num_tokens` drafts for the positions after `token_ids` (none if no match).
        `num_committed`: how many leading tokens are final (default: all of them)."""
        committed = len(token_ids) if num_committed is None else num_committed
        return self.propose_after([], token_ids[:committed], token_ids[committed:], request_id, num_tokens)

    def propose_after(self, prompt: list[int], output: list[int], extra: list[int], request_id: str,
                      num_tokens: int) -> list[int]:
        """`propose` for the context prompt + output + extra, where prompt + output are
        committed (only ever grow) and `extra` is not; nothing is concatenated."""
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Indexed(prompt + output)
        tokens = state.tokens
        if len(tokens) < len(prompt) + len(output):
            tokens.extend(output[len(tokens) - len(prompt):])
        if len(tokens) > state.indexed:
            self._add(state.index, tokens, state.indexed, len(tokens))
            state.indexed = len(tokens)
        tail = tokens[-self.max_n:] + extra
        longest = min(self.max_n, len(tokens) + len(extra) - 1)
        if longest < self.min_n or tuple(tail[-self.min_n:]) not in state.index:
            return []  # the shortest suffix never occurred, so no longer one did (the common miss)
        for n in range(longest, self.min_n - 1, -1):
            end = state.index.get(tuple(tail[-n:]))
            if end is not None:
                # From `end` on the context repeats itself with period `period`: what followed
                # the match, then, past the context's end, the same period again (a short
                # repeat -- one token over and over -- would otherwise leave only `period`
                # tokens to propose, and launch-ahead drops the first as its guess of the
                # token in flight).
                drafts = (tokens[end:end + num_tokens] + extra)[:num_tokens]
                period = len(tokens) + len(extra) - end
                while len(drafts) < num_tokens:
                    drafts.append(drafts[-period])
                return drafts
        return []

    def _add(self, index: dict[tuple[int, ...], int], tokens: list[int], start: int, stop: int) -> None:
        """Index the n-grams that end at positions start .. stop-1 (each followed by a
        committed token); later occurrences overwrite earlier ones."""
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n)  # the first end position with a whole n-gram before it
            if first >= stop:
                continue
            if stop - first == 1:  # one new token (the common case): no zip machinery
                index[tuple(tokens[first - n:first])] = first
                continue
            grams = zip(*(tokens[first - n + k:stop - n + k] for k in range(n)))
            index.update(zip(grams, range(first, stop)))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's tokens and index."""
        self._requests.pop(request_id, None)

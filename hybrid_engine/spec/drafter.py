"""`Drafter`: asks the configured proposer for the drafts of a step's verify rows.

A draft model (spec/draft_model.py) gets all of a step's rows as one batch; any other
proposer is called row by row. The drafter builds the context the proposer sees (prompt,
output, and under launch-ahead the drafts still in flight), bounds and checks what comes
back, isolates proposer failures to the request that hit them, and backs off a request
whose drafts keep being rejected: a verify row whose drafts are all rejected costs a wider
step for nothing, and under launch-ahead also the row launched on top of it. For the same
reason, a row launched on top of an in-flight verify row gets drafts only when the
request's drafts have been trusted lately (its last verify row accepted one): on an
untrusted verify it stays a one-token row, cheap to reject. Drafts never change a request's tokens (verification is exact), only how many
steps it takes.
"""
import logging
import operator
from dataclasses import dataclass

from hybrid_engine.request import Request
from hybrid_engine.spec.config import SpeculativeConfig
from hybrid_engine.spec.draft_model import DraftModel, DraftQuery
from hybrid_engine.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)

# A step with drafts widens every decode row to K+1 tokens. Batches up to this many rows
# are memory-bound enough that the extra positions cost little: they always keep drafts.
WIDEN_ALWAYS_UP_TO_ROWS = 8
# Larger batches keep their drafts only if at least this share of the positions the
# widening adds are drafts (the rest is padding computed for nothing).
MIN_DRAFT_SHARE_OF_WIDENING = 0.25

# After n verify rows in a row with every draft rejected, a request drafts again only after
# min(8 * 4**(n-1), MAX_BACKOFF_ROWS) plain decode rows. A miss costs a wider step and, under
# launch-ahead, the rejected row launched on top of it: about two steps, so an adversarial
# proposer costs ~3 steps per 128 tokens at first and under 1% once backed off.
MAX_BACKOFF_ROWS = 256


@dataclass
class _DraftHistory:
    misses: int = 0  # consecutive verify rows with no draft accepted
    skip: int = 0  # decode rows left before drafting again
    trusted: bool = False  # the request's last verify row accepted a draft
    warned: bool = False  # a proposer failure was logged for this request


def _as_int(value: object) -> int | None:
    """`value` as a Python int if it is an integer of any type, else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(slots=True)
class DraftRow:
    """A decode row that may carry drafts: at most `max_drafts` of them, for the positions
    after its input token; `input_in_flight`: that token is still being sampled on the
    device (launch-ahead), so the drafts also follow the request's in-flight drafts."""

    request: Request
    max_drafts: int
    input_in_flight: bool


class Drafter:
    """The scheduler's source of drafts (one per engine). `draft_model`: the method
    "draft_model"'s proposer (built by the engine, which sizes its memory)."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, draft_model: DraftModel | None = None):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.vocab_size = vocab_size
        self.draft_model = draft_model
        self._draft_model_warned = False
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = config.proposer
        self._history: dict[str, _DraftHistory] = {}  # by request id, dropped at `release`

    @property
    def batched(self) -> bool:
        """Whether drafts come from one batched call per step (a draft model): the caller
        then sets each row's room aside before knowing its drafts."""
        return self.draft_model is not None

    def selects(self, row: DraftRow) -> bool:
        """Whether the row's request drafts this step (the back-off and trust rules above)."""
        history = self._history.get(row.request.request_id)
        if history is None:
            history = self._history[row.request.request_id] = _DraftHistory()
        if history.skip:
            history.skip -= 1
            return False
        # Launched on an untrusted verify row, a row is likely rejected: kept narrow.
        return not (row.input_in_flight and row.request.inflight_drafts and not history.trusted)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """The drafts of rows that `selects` chose, one list per row (at most `max_drafts`
        each): one batched call to a draft model, else one proposer call per row."""
        queries = []
        for row in rows:
            # An input token in flight is still being sampled on the device: the proposer
            # is asked for one more token (its guess of it), dropped below.
            extra = row.request.inflight_drafts if row.input_in_flight else []
            queries.append(DraftQuery(row.request, extra, row.max_drafts + row.input_in_flight))
        proposals = self._draft_model_proposals(queries) if self.draft_model is not None else map(
            self._proposal, queries)
        return [proposal[1:] if row.input_in_flight else proposal for row, proposal in zip(rows, proposals)]

    def _proposal(self, query: DraftQuery) -> list[int]:
        """One proposer call; a failure costs this request's drafts, nothing else."""
        request = query.request
        try:
            if isinstance(self.proposer, NgramProposer):  # keeps its own copy: no context to build
                proposed = self.proposer.propose_after(request.prompt_token_ids, request.output_token_ids,
                                                       query.extra, request.request_id, query.num_tokens)
            else:
                context = request.prompt_token_ids + request.output_token_ids + query.extra
                proposed = self.proposer.propose(request.request_id, context, query.num_tokens)
            return self._check(proposed, query.num_tokens)
        except Exception as error:
            history = self._history[request.request_id]
            if not history.warned:
                history.warned = True
                logger.warning("speculative proposer failed for request %s (%s: %s); it gets no drafts this "
                               "step (logged once per request)", request.request_id, type(error).__name__, error)
            return []

    def _draft_model_proposals(self, queries: list[DraftQuery]) -> list[list[int]]:
        """All queries' drafts from the draft model in one batched run; a failure costs
        this step's drafts (logged once), never the engine."""
        try:
            return [self._check(p, q.num_tokens) for p, q in zip(self.draft_model.propose(queries), queries)]
        except Exception:
            if not self._draft_model_warned:
                self._draft_model_warned = True
                logger.exception("the draft model failed; this step has no drafts (logged once)")
            return [[] for _ in queries]

    def _check(self, proposed: object, wanted: int) -> list[int]:
        """The proposal as a list of at most `wanted` token ids, or ValueError."""
        if proposed is None:
            return []
        drafts = []
        for token in list(proposed)[:wanted]:
            # Any integer type (NumPy's too), not bool.
            value = None if isinstance(token, bool) else _as_int(token)
            if value is None or not 0 <= value < self.vocab_size:
                raise ValueError(f"proposed token {token!r} is not a token id in [0, {self.vocab_size})")
            drafts.append(value)
        return drafts

    def worth_widening(self, num_rows: int, num_drafts: int) -> bool:
        """Whether a step of `num_rows` decode rows carrying `num_drafts` drafts in all
        should verify them (widening every row to K+1 tokens) or run as a plain step."""
        if num_rows <= WIDEN_ALWAYS_UP_TO_ROWS:
            return True
        return num_drafts >= MIN_DRAFT_SHARE_OF_WIDENING * num_rows * self.num_speculative_tokens

    def release(self, request: Request) -> None:
        """The request left the running set (finished or evicted): its drafting history goes,
        and a proposer that keeps per-request state (`forget(request_id)`, as the n-gram
        index does) drops it. A failing `forget` is logged, as a failing proposal is, and
        costs nothing else: the request has already left."""
        self._history.pop(request.request_id, None)
        forget = getattr(self.proposer, "forget", None)
        if forget is None:
            return
        try:
            forget(request.request_id)
        except Exception as error:
            logger.warning("speculative proposer's forget failed for request %s (%s: %s)", request.request_id,
                           type(error).__name__, error)

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A verify row retired: back off while every draft is rejected."""
        history = self._history.get(request.request_id)
        if history is None:
            return
        if not num_proposed:
            return
        history.trusted = num_accepted > 0
        if num_accepted:
            history.misses = 0
            return
        history.misses += 1
        history.skip = min(8 * 4 ** (history.misses - 1), MAX_BACKOFF_ROWS)

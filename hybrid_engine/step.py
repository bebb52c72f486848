"""A launched step as the engine holds it: the plan the runner wrote (`StepPlan`), the
handle its samples come back through (`StepHandle`), and what came back (`StepSamples`)."""
from dataclasses import dataclass

import torch

from cache.step_buffer import StepExtent
from hybrid_engine.request import Request
from hybrid_engine.scheduler import SchedulerOutput, VerifiedRow


@dataclass
class StepPlan:
    """Host-known shape and flags of a prepared step."""

    sched: SchedulerOutput
    num_decode: int
    num_prefill: int
    num_tokens: int
    max_seqlen_q: int
    num_logprobs: int  # -1: no row wants logprobs
    all_greedy: bool
    use_penalties: bool
    num_from_prev: int  # decode rows whose input is the previous step's sample (on device)
    decode_width: int = 1  # tokens per decode row: 1 + the most drafts of a verify row
    num_new_slots: int = 0  # Mamba state slots to zero before the forward
    num_saves: int = 0  # Mamba states the prefill chunks write from inside themselves (prefix caching)
    num_masks: int = 0  # grammar masks of the step's constrained rows (structured outputs)
    host_index: int = -1  # the step buffer's host buffer this step was written into
    decode_requests: list[Request] | None = None  # a decode-only step's rows, in order

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def num_sampled(self) -> int:
        """Rows of logits the step samples: every position of a decode row, one per prefill chunk."""
        return self.num_decode * self.decode_width + self.num_prefill

    @property
    def extent(self) -> StepExtent:
        """The leading rows of each step-buffer field this step uses."""
        return StepExtent(self.num_tokens, self.num_seqs, self.decode_width, self.num_new_slots, self.num_saves,
                          self.num_masks)


@dataclass
class StepSamples:
    """What came back from the device for one step, one entry per scheduled sequence (a
    verify row's entry is its first position's sample; `verified` has all it kept)."""

    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None  # (token id, logprob): sampled first, then top-n
    verified: list[VerifiedRow] | None = None  # per decode row, when the step verifies drafts
    # Per scheduled sequence, when the runner checks the dt limit and a row was flagged:
    # whether a generated token of the row had a dt the prompt-only limit would have clamped.
    dt_limit_hits: list[bool] | None = None


class StepHandle:
    """A launched step whose samples are on their way to the host.

    `valid[i]` is cleared when reconciliation rejects row i (`chunks[i]`).
    """

    def __init__(self, plan: StepPlan, host_out: torch.Tensor, event: torch.cuda.Event | None,
                 host_hits: torch.Tensor | None = None):
        self.plan = plan
        self.sched = plan.sched
        self.chunks = plan.sched.chunks  # the step's rows, in row order
        self._host_out, self._event, self._host_hits = host_out, event, host_hits
        self.valid = [True] * len(self.chunks)  # real rows only: graph padding is not a row

    def wait(self) -> StepSamples:
        """Block until the samples are on the host (the step's only host synchronization)."""
        if self._event is not None:
            self._event.synchronize()
        plan = self.plan
        rows = self._host_out[: plan.num_sampled].tolist()
        if plan.decode_width > 1:
            samples = self._verified_samples(rows)
        else:
            tokens = [int(r[0]) for r in rows]
            logprobs = None
            if plan.num_logprobs >= 0:
                k = 1 + plan.num_logprobs
                logprobs = [list(zip(map(int, r[1 + k:1 + 2 * k]), r[1:1 + k])) for r in rows]
            samples = StepSamples(tokens, logprobs)
        if self._host_hits is not None:
            hits = self._host_hits[: len(self.chunks)].numpy()
            if hits.any():  # (else None: nothing for the bookkeeping to do)
                samples.dt_limit_hits = (hits != 0).tolist()
        return samples

    def _verified_samples(self, rows: list[list[float]]) -> StepSamples:
        """A verify step's samples: rows of [token, drafts accepted, logprobs...], every
        position of every decode row, then one per prefill chunk (`forward_sample`)."""
        plan, width = self.plan, self.plan.decode_width
        k = 1 + plan.num_logprobs

        def logprobs_of(r: list[float]) -> list[tuple[int, float]]:
            return list(zip(map(int, r[2 + k:2 + 2 * k]), r[2:2 + k]))

        firsts = [rows[i * width] for i in range(plan.num_decode)] + rows[plan.num_decode * width:]
        verified = []
        for i in range(plan.num_decode):
            kept = rows[i * width: i * width + 1 + int(rows[i * width][1])]
            verified.append(VerifiedRow(len(kept) - 1, [int(r[0]) for r in kept],
                                        [logprobs_of(r) for r in kept] if k > 0 else None))
        logprobs = [logprobs_of(r) for r in firsts] if k > 0 else None
        return StepSamples([int(r[0]) for r in firsts], logprobs, verified)

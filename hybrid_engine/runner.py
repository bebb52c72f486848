"""Turns a scheduled batch into device work: step buffer -> forward -> sampling -> samples back.

`prepare` writes every field of the step into the pinned host buffer and mirrors it with
ONE copy; `launch` runs the forward and the sampler on the device and starts an
asynchronous device-to-host copy of the samples guarded by an event; `StepHandle.wait`
blocks on that event only. Serial mode calls the three back to back.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch

from cache.context import SEQ_I64, StepBuffer
from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaSlotAllocator
from hybrid_engine.models.base import HybridForCausalLM
from hybrid_engine.request import Request
from hybrid_engine.sampling import SamplingTensors, sample
from hybrid_engine.scheduler import SchedulerOutput
from layers.forward_meta import ForwardMeta


# Debugging knob: check every fast-path step against the general path (slow; tests set it).
CHECK_FAST_PATHS_ENV = "HYBRID_ENGINE_CHECK_FAST_PATHS"


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
    num_new_slots: int = 0  # Mamba state slots to zero before the forward
    host_index: int = -1  # the step buffer's host buffer this step was written into
    decode_requests: list[Request] | None = None  # a decode-only step's rows, in order

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill


@dataclass
class StepSamples:
    """What came back from the device for one step, one entry per scheduled sequence."""

    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None  # (token id, logprob): sampled first, then top-n


class StepHandle:
    """A launched step whose samples are on their way to the host.

    `valid[i]` is cleared when reconciliation rejects row i.
    """

    def __init__(self, plan: StepPlan, host_out: torch.Tensor, event: torch.cuda.Event | None):
        self.plan = plan
        self._host_out, self._event = host_out, event
        self.valid = [True] * len(plan.sched.chunks)  # real rows only: graph padding is not a row

    def wait(self) -> StepSamples:
        """Block until the samples are on the host (the step's only host synchronization)."""
        if self._event is not None:
            self._event.synchronize()
        rows = self._host_out[: self.plan.num_seqs].tolist()
        tokens = [int(r[0]) for r in rows]
        logprobs = None
        if self.plan.num_logprobs >= 0:
            k = 1 + self.plan.num_logprobs
            logprobs = [list(zip(map(int, r[1 + k:1 + 2 * k]), r[1:1 + k])) for r in rows]
        return StepSamples(tokens, logprobs)


class ModelRunner:
    """Owns the model, the cache pools' bindings and the step buffer."""

    def __init__(self, model: HybridForCausalLM, kv: KVBlockAllocator, mamba: MambaSlotAllocator,
                 max_num_batched_tokens: int, max_model_len: int, device: torch.device):
        self.model, self.kv, self.mamba, self.device = model, kv, mamba, device
        self.max_seqs = mamba.max_num_seqs
        self.max_blocks_per_seq = kv.blocks_for(max_model_len)
        self.buffer = StepBuffer(max_num_batched_tokens, self.max_seqs, self.max_blocks_per_seq, device)
        for layer, (k, v) in zip(model.attention_layers(), kv.kv_caches):
            layer.kv_cache = (k, v)
        for i, mixer in enumerate(model.mamba_mixers()):
            mixer.conv_state, mixer.ssm_state = mamba.layer_views(i)
        # Per request slot, written when a request takes the slot (or gets a new block) and
        # gathered every step: the KV block table and the sampling row (temperature, top_p,
        # min_p, repetition / presence / frequency penalty, top_k, logprobs or -1).
        self._block_table = np.zeros((self.max_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._block_table_len = [0] * self.max_seqs
        self._block_table_owner: list[list[int] | None] = [None] * self.max_seqs
        self._slot_owner: list[Request | None] = [None] * self.max_seqs
        self._slot_sampling = np.zeros((self.max_seqs, 8), dtype=np.float32)
        # Greedy, no filters, no penalties: what graph padding rows sample with.
        self._neutral_sampling = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=np.float32)[:, None]
        # 0, 1, 2, ...: row indices and positions, sliced instead of built per step.
        self._rows = np.arange(max(self.max_seqs + 1, max_model_len), dtype=np.int64)
        # Token history per request slot, written on device from each step's inputs
        # (idempotent: position p always holds the same token), read for penalties.
        self._history = torch.zeros(self.max_seqs, max_model_len, dtype=torch.int64, device=device)
        # A step's samples (and logprobs with their token ids) come back packed in one
        # float64 matrix -- exact for token ids and float32 logprobs -- so one copy does it.
        # Alternating pinned buffers: with launch-ahead two steps are outstanding, and step
        # N's samples are read before step N+2 is launched.
        pin = device.type == "cuda"
        # Flat buffers, viewed contiguously per step: a non_blocking copy into a strided
        # pinned slice is staged through a temporary and silently synchronizes.
        self._host_out = [torch.zeros(self.max_seqs * (1 + 2 * 21), dtype=torch.float64, pin_memory=pin)
                          for _ in range(2)]
        self._launches = 0
        # The newest launched step's samples, row by row, at a fixed address: a launch-ahead
        # step gathers its decode inputs here (CUDA graphs need fixed input addresses).
        # Stream order makes step N+1 read N's samples before writing its own.
        self._sampled = torch.zeros(self.max_seqs, dtype=torch.int64, device=device)
        self.graphs = None  # DecodeGraphs, when CUDA graphs are enabled
        self.num_steady_steps = 0  # steps prepared by the steady-state decode fast path
        self.check_steady_decode = os.environ.get(CHECK_FAST_PATHS_ENV) == "1"

    # ---- host side -------------------------------------------------------------------
    def _claim_slot(self, request: Request) -> None:
        """Record the sampling row of a request that newly holds its slot."""
        slot = request.seq_slot
        self._slot_owner[slot] = request
        self._slot_sampling[slot] = request.sampling_row

    def _sync_block_table(self, request: Request) -> None:
        """Copy the request's newly allocated block ids into its slot's host table row.

        The row is keyed by the request's block *list object*: freeing blocks (finish,
        eviction) gives the request a new list, so a readmitted request rewrites its row.
        """
        slot = request.seq_slot
        if self._block_table_owner[slot] is not request.blocks:
            self._block_table_owner[slot], self._block_table_len[slot] = request.blocks, 0
        known, blocks = self._block_table_len[slot], request.blocks
        if len(blocks) > known:
            self._block_table[slot, known:len(blocks)] = blocks[known:]
            self._block_table_len[slot] = len(blocks)

    def _state_rows(self, request: Request) -> tuple[int, int]:
        """(src, dst) Mamba state rows of the request's next launched row. In place with one
        copy; under ping-pong it reads the copy its predecessor wrote (the committed one,
        flipped once per launched row still in flight) and writes the other."""
        if self.mamba.copies == 1:
            return request.seq_slot, request.seq_slot
        src = 2 * request.seq_slot + (request.state_parity ^ (request.inflight & 1))
        return src, src ^ 1

    def prepare(self, sched: SchedulerOutput, prev: StepHandle | None = None) -> StepPlan:
        """Write the step into the host buffer and mirror it to the device (one copy).

        A decode row whose input token is still in flight (sampled by `prev`, not yet on
        the host) gets `input_from_prev` = its row in `prev`; the device fills it in.
        A step with exactly `prev`'s decode rows is derived from `prev`'s fields
        (`_write_steady_decode`); any other goes through `_write_step`.
        """
        plan = None
        if prev is not None and not sched.prefills:
            plan = self._write_steady_decode(sched, prev)
            if plan is not None and self.check_steady_decode:
                self._check_steady_decode(plan, prev)
        if plan is None:
            plan = self._write_step(sched, prev)
        else:
            self.num_steady_steps += 1
        plan.host_index = self.buffer.current_index
        self.buffer.sync()
        return plan

    def _write_step(self, sched: SchedulerOutput, prev: StepHandle | None) -> StepPlan:
        """The general path: every row's fields from the requests' bookkeeping."""
        decodes, prefills = sched.decodes, sched.prefills
        n_dec, n_seq = len(decodes), len(decodes) + len(prefills)
        h = self.buffer.host_np
        owners, bt_owner, bt_len = self._slot_owner, self._block_table_owner, self._block_table_len
        bs = self.kv.block_size
        per_seq: list[int] = []  # decode rows, SEQ_I64 order (see _write_decode_rows)
        per_token: list[int] = []  # decode rows: input id, position, KV slot
        num_from_prev = 0
        for i, c in enumerate(decodes):
            # Runs for every decode row every step: kept flat on purpose (no helper calls
            # unless the slot changed hands or the request got a new block).
            r = c.request
            slot, blocks = r.seq_slot, r.blocks
            if owners[slot] is not r:
                self._claim_slot(r)
            if bt_owner[slot] is not blocks or bt_len[slot] != len(blocks):
                self._sync_block_table(r)
            start, output = c.start, r.output_token_ids
            n_out = len(output)
            n_prompt = len(r.prompt_token_ids)
            # The input token sits at `start`: on the host once its sample retired, else
            # on the device as the previous step's sample at row `launch_row`.
            if start >= n_prompt + n_out:
                from_prev, token = r.launch_row, 0
                num_from_prev += 1
            else:
                from_prev = -1
                token = output[start - n_prompt] if start >= n_prompt else r.prompt_token_ids[start]
            src, dst = self._state_rows(r)
            per_seq += (src, dst, from_prev, i, r.seed, n_out + r.pending_samples - 1, slot, n_prompt, start + 1)
            per_token += (token, start, blocks[start // bs] * bs + start % bs)
            r.launch_row = i
            r.inflight += 1
        if num_from_prev and prev is None:
            raise RuntimeError("a decode input is still on the device but no previous step was given")
        slots: list[int] = per_seq[6::9]
        if n_dec:
            self._write_decode_rows(np.array(per_seq, dtype=np.int64).reshape(n_dec, len(SEQ_I64)),
                                    np.array(per_token, dtype=np.int64).reshape(n_dec, 3))
        num_tokens, max_q = n_dec, 1
        if prefills:
            num_tokens, max_q = self._write_prefill_rows(prefills, n_dec, slots)
        h["cu_seqlens_q"][: n_dec + 1] = self._rows[: n_dec + 1]
        slots_np = np.array(slots, dtype=np.int64)
        h["block_tables"][:n_seq] = self._block_table[slots_np]
        new_slots = self.mamba.take_new_slots()
        if new_slots:
            h["new_state_slots"][: len(new_slots)] = new_slots
        plan = self._write_sampling(sched, slots_np, n_dec, num_tokens, max_q)
        plan.num_from_prev = num_from_prev
        plan.num_new_slots = len(new_slots)
        if not prefills:
            plan.decode_requests = [c.request for c in decodes]
        if self.graphs is not None:
            size = self.graphs.padded_size(n_dec, plan.num_prefill, plan.use_penalties, plan.num_logprobs)
            if size is not None:
                self._write_padding(plan, size)
        return plan

    def _check_steady_decode(self, plan: StepPlan, prev: StepHandle) -> None:
        """Debug check (HYBRID_ENGINE_CHECK_FAST_PATHS=1, set by the tests): rewrite the
        step through the general path and require the same host fields and plan."""
        fast = self.buffer.decode_rows_snapshot(plan.num_decode)
        for r in plan.decode_requests:
            r.inflight -= 1  # undo: the general path counts the launch again
        general = self._write_step(plan.sched, prev)
        same_fields = all(np.array_equal(a, b) for a, b in zip(fast, self.buffer.decode_rows_snapshot(plan.num_decode)))
        if not same_fields or general != plan:
            raise AssertionError(f"steady-state decode fast path differs from the general path: fields equal "
                                 f"{same_fields}, plans {plan} vs {general}")

    def _write_steady_decode(self, sched: SchedulerOutput, prev: StepHandle) -> StepPlan | None:
        """The steady-state decode step, derived from the previous one without a per-row loop.

        Applies when this step's rows are exactly `prev`'s rows (same requests, same order,
        decode only, under launch-ahead) and no row enters a new KV block. Each row then
        reads the state copy `prev` writes and writes the one it reads, is one position
        further (KV slot + 1 in the same block), one output further, and takes its input
        from `prev`'s sample at the same row; everything else (sampling, block tables,
        graph padding) is unchanged. So the host buffer is `prev`'s, copied, plus those
        deltas. Returns None (having changed nothing) when the step does not qualify.
        """
        pp, n = prev.plan, len(sched.decodes)
        if (pp.decode_requests is None or len(pp.decode_requests) != n or self.mamba.copies != 2
                or pp.host_index != self.buffer.current_index ^ 1 or self.mamba.has_new_slots()):
            return None
        requests = [c.request for c in sched.decodes]
        if requests != pp.decode_requests:  # identity comparison (Request has eq=False)
            return None
        positions = self.buffer.host_group("token_i64", pp.host_index)[1, :n] + 1
        if (positions % self.kv.block_size == 0).any():
            return None
        size = n
        if self.graphs is not None:
            size = self.graphs.padded_size(n, 0, pp.use_penalties, pp.num_logprobs) or n
        self.buffer.copy_rows_from(pp.host_index, size)  # graph padding rows included
        tokens, seqs = self.buffer.host_group("token_i64"), self.buffer.host_group("seq_i64")
        tokens[0, :n] = 0  # every input comes from `prev` (the device fills it in)
        tokens[1, :n] = positions
        tokens[2, :n] += 1
        seqs[[0, 1], :n] = seqs[[1, 0], :n]  # ping-pong: src <-> dst
        seqs[2, :n] = self._rows[:n]  # input_from_prev: the same row of `prev`
        seqs[5, :n] += 1  # output_pos
        seqs[8, :n] += 1  # history_lens
        self.buffer.host_np["seq_lens"][:n] += 1
        for r in requests:
            r.inflight += 1  # (launch_row is already this row)
        plan = StepPlan(sched=sched, num_decode=n, num_prefill=0, num_tokens=n, max_seqlen_q=1,
                        num_logprobs=pp.num_logprobs, all_greedy=pp.all_greedy, use_penalties=pp.use_penalties,
                        num_from_prev=n, decode_requests=requests)
        if size > n:
            self._pad_plan(plan, size)
        return plan

    def _write_decode_rows(self, per_seq: np.ndarray, per_token: np.ndarray) -> None:
        """Fields of decode rows [0, n) from their per-row values ([n, 9] and [n, 3])."""
        n = len(per_seq)
        h = self.buffer.host_np
        # SEQ_I64 order: mamba_src, mamba_dst, input_from_prev, logits_indices, seeds,
        # output_pos, history_rows, prompt_lens, history_lens.
        self.buffer.host_group("seq_i64")[:, :n] = per_seq.T
        self.buffer.host_group("token_i64")[:, :n] = per_token.T
        h["seq_lens"][:n] = per_seq[:, 8]
        h["prompt_token_mask"][:n] = False
        h["prefill_cu_seqlens"][0] = 0

    def _write_prefill_rows(self, prefills: list, n_dec: int, slots: list[int]) -> tuple[int, int]:
        """Fields of the prefill chunks (rows after the decode rows); appends their slots.
        Per-token fields are written chunk by chunk with NumPy slices. Returns
        (num_tokens, longest chunk)."""
        h = self.buffer.host_np
        tokens, seqs = self.buffer.host_group("token_i64"), self.buffer.host_group("seq_i64")
        prompt_mask = h["prompt_token_mask"]
        bs = self.kv.block_size
        per_seq: list[int] = []
        cu = [n_dec]
        for j, c in enumerate(prefills):
            r = c.request
            slot = r.seq_slot
            if self._slot_owner[slot] is not r:
                self._claim_slot(r)
            self._sync_block_table(r)
            start, end = c.start, c.start + c.num_tokens
            t0, t1 = cu[-1], cu[-1] + c.num_tokens
            prompt, output = r.prompt_token_ids, r.output_token_ids
            n_prompt = len(prompt)
            in_prompt = max(0, min(end, n_prompt) - start)
            tokens[0, t0:t0 + in_prompt] = prompt[start:start + in_prompt]
            tokens[0, t0 + in_prompt:t1] = output[max(start - n_prompt, 0): max(end - n_prompt, 0)]
            positions = self._rows[start:end]  # (end <= max_model_len <= len(_rows))
            tokens[1, t0:t1] = positions
            tokens[2, t0:t1] = self._block_table[slot, positions // bs] * bs + positions % bs
            prompt_mask[t0:t0 + in_prompt] = True
            prompt_mask[t0 + in_prompt:t1] = False
            cu.append(t1)
            src, dst = self._state_rows(r)
            # SEQ_I64 order (see _write_decode_rows).
            per_seq += (src, dst, -1, t1 - 1, r.seed,
                        len(output) + r.pending_samples - c.samples, slot, n_prompt, end)
            slots.append(slot)
            r.launch_row = n_dec + j
            r.inflight += 1
        n_seq = n_dec + len(prefills)
        seqs[:, n_dec:n_seq] = np.array(per_seq, dtype=np.int64).reshape(len(prefills), len(SEQ_I64)).T
        h["seq_lens"][n_dec:n_seq] = seqs[8, n_dec:n_seq]
        cu_np = np.array(cu, dtype=np.int32)
        h["cu_seqlens_q"][n_dec:n_seq + 1] = cu_np
        h["prefill_cu_seqlens"][: len(prefills) + 1] = cu_np - n_dec
        return cu[-1], max(c.num_tokens for c in prefills)

    def _write_padding(self, plan: StepPlan, size: int) -> None:
        """Grow a decode-only step to `size` rows with rows that touch no state (for a graph)."""
        h, lo = self.buffer.host_np, plan.num_seqs
        if size > lo:
            tokens = self.buffer.host_group("token_i64")
            tokens[:2, lo:size] = 0  # input_ids, positions
            tokens[2, lo:size] = -1  # slot_mapping: write no KV
            seq = self.buffer.host_group("seq_i64")
            seq[:3, lo:size] = -1  # mamba_src, mamba_dst, input_from_prev: no state, host ids
            seq[3, lo:size] = self._rows[lo:size]  # logits_indices
            seq[4:, lo:size] = 0  # seeds, output_pos, history rows / lens, prompt_lens
            self.buffer.host_group("sampling_f32")[:, lo:size] = self._neutral_sampling
            h["prompt_token_mask"][lo:size] = False
            h["cu_seqlens_q"][lo + 1:size + 1] = self._rows[lo + 1:size + 1]
            h["seq_lens"][lo:size] = 0
            h["block_tables"][lo:size] = 0
            h["top_k"][lo:size] = 0
        h["prefill_cu_seqlens"][0] = 0
        self._pad_plan(plan, size)

    @staticmethod
    def _pad_plan(plan: StepPlan, size: int) -> None:
        plan.num_decode = plan.num_tokens = size
        plan.max_seqlen_q = 1
        plan.num_from_prev = size  # the graph always gathers (rows of -1 keep the host ids)

    def padding_plan(self, size: int, all_greedy: bool) -> StepPlan:
        """A decode step of `size` padding rows, written and mirrored (for graph capture)."""
        plan = StepPlan(sched=SchedulerOutput(), num_decode=0, num_prefill=0, num_tokens=0, max_seqlen_q=1,
                        num_logprobs=-1, all_greedy=all_greedy, use_penalties=False, num_from_prev=0)
        self._write_padding(plan, size)
        self.buffer.sync()
        return plan

    def _write_sampling(self, sched: SchedulerOutput, slots: np.ndarray, n_dec: int, n_tokens: int,
                        max_q: int) -> StepPlan:
        """Sampling fields gathered from the slot table; the step's sampler flags from them."""
        n = len(slots)
        sampling = self._slot_sampling[slots].T  # temperature, top_p, min_p, penalties x3, top_k, logprobs
        self.buffer.host_group("sampling_f32")[:, :n] = sampling[:6]
        self.buffer.host_np["top_k"][:n] = sampling[6]  # top_k (< 2**24 after clamping) is exact in float32
        penalties = (sampling[3] != 1.0) | (sampling[4] != 0.0) | (sampling[5] != 0.0)
        return StepPlan(
            sched=sched, num_decode=n_dec, num_prefill=n - n_dec, num_tokens=n_tokens, max_seqlen_q=max_q,
            num_logprobs=int(sampling[7].max()), all_greedy=not sampling[0].any(),
            use_penalties=bool(penalties.any()), num_from_prev=0,
        )

    # ---- device side -----------------------------------------------------------------
    def forward_meta(self, plan: StepPlan) -> ForwardMeta:
        """Slices of the device views sized for this step."""
        d, t, s = self.buffer.device, plan.num_tokens, plan.num_seqs
        return ForwardMeta(
            num_decode=plan.num_decode, num_prefill=plan.num_prefill, num_tokens=t, max_seqlen_q=plan.max_seqlen_q,
            positions=d["positions"][:t], prompt_token_mask=d["prompt_token_mask"][:t],
            slot_mapping=d["slot_mapping"][:t], cu_seqlens_q=d["cu_seqlens_q"][: s + 1],
            prefill_cu_seqlens=d["prefill_cu_seqlens"][: plan.num_prefill + 1], seq_lens=d["seq_lens"][:s],
            block_tables=d["block_tables"][:s], mamba_src=d["mamba_src"][:s], mamba_dst=d["mamba_dst"][:s],
            logits_indices=d["logits_indices"][:s],
        )

    def _sampling_tensors(self, plan: StepPlan, meta: ForwardMeta, input_ids: torch.Tensor) -> SamplingTensors:
        d, s = self.buffer.device, plan.num_seqs
        history = prompt_len = history_len = None
        if plan.use_penalties:
            token_seq = torch.searchsorted(meta.cu_seqlens_q[1:], torch.arange(plan.num_tokens, device=self.device),
                                           right=True)
            rows = d["history_rows"][:s]
            self._history[rows[token_seq], meta.positions] = input_ids
            history, prompt_len, history_len = self._history[rows], d["prompt_lens"][:s], d["history_lens"][:s]
        return SamplingTensors(
            temperature=d["temperature"][:s], top_k=d["top_k"][:s], top_p=d["top_p"][:s], min_p=d["min_p"][:s],
            repetition_penalty=d["repetition_penalty"][:s], presence_penalty=d["presence_penalty"][:s],
            frequency_penalty=d["frequency_penalty"][:s], seed=d["seeds"][:s], output_pos=d["output_pos"][:s],
            token_history=history, prompt_len=prompt_len, history_len=history_len,
        )

    def forward_sample(self, plan: StepPlan) -> torch.Tensor:
        """The device work of a step: inputs -> forward -> logits -> samples, packed as
        float64 [S, 1 (+ 2 (1+K) logprob columns)]. Sync-free with the fast kernels, so a
        decode step of this shape can be captured as one CUDA graph."""
        d = self.buffer.device
        meta = self.forward_meta(plan)
        input_ids = d["input_ids"][: plan.num_tokens]
        if plan.num_from_prev:  # decode inputs still on the device: the previous step's samples
            rows = d["input_from_prev"][: plan.num_decode]
            fed = self._sampled[rows.clamp(min=0)]
            input_ids[: plan.num_decode] = torch.where(rows >= 0, fed, input_ids[: plan.num_decode])
        hidden = self.model(input_ids, meta)
        logits = self.model.compute_logits(hidden[meta.logits_indices])
        out = sample(logits, self._sampling_tensors(plan, meta, input_ids), num_logprobs=plan.num_logprobs,
                     all_greedy=plan.all_greedy, use_penalties=plan.use_penalties)
        self._sampled[: plan.num_seqs].copy_(out.sampled_token_ids)
        packed = out.sampled_token_ids.double()[:, None]
        if out.logprobs is not None:
            packed = torch.cat([packed, out.logprobs.double(), out.logprob_token_ids.double()], dim=1)
        return packed

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Run a prepared step (a graph replay when one fits); samples start copying to the host."""
        if plan.num_new_slots:
            self.mamba.zero_slots(self.buffer.device["new_state_slots"][: plan.num_new_slots])
        packed = self.graphs.replay(plan) if self.graphs is not None else None
        if packed is None:
            packed = self.forward_sample(plan)
        host_out = self._host_out[self._launches % 2][: packed.numel()].view(packed.shape)
        self._launches += 1
        host_out.copy_(packed, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self.buffer.stream)
        return StepHandle(plan, host_out, event)

"""Turns a scheduled batch into device work: step buffer -> forward -> sampling -> samples back.

`prepare` writes every field of the step into the pinned host buffer and mirrors it with
ONE copy; `launch` runs the forward and the sampler on the device and starts an
asynchronous device-to-host copy of the samples guarded by an event; `StepHandle.wait`
blocks on that event only. Serial mode calls the three back to back.

The runner reads requests and never writes them: the scheduler has already launched the
rows it is handed (cursors advanced), and retiring them is the scheduler's too.
"""
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator, RequestState
from cache.step_buffer import (NEUTRAL_SAMPLING, SAMPLING, SAMPLING_F32_ROWS, SEQ, TOKEN, SamplingRow, SeqFields,
                               StepBuffer, TokenFields)
from hybrid_engine.models.base import HybridForCausalLM
from hybrid_engine.request import Request
from hybrid_engine.sampling import GREEDY_BELOW_TEMPERATURE, SamplerOutput, SamplingTensors, apply_token_masks, sample
from hybrid_engine.sampling_params import MAX_LOGPROBS, SamplingParams
from hybrid_engine.scheduler import ScheduledChunk, SchedulerOutput
from hybrid_engine.step import StepHandle, StepPlan
from layers.forward_meta import ForwardMeta
from layers.kernels.ops import StateSaves

if TYPE_CHECKING:  # (the parallel package imports the step types this module uses)
    from hybrid_engine.parallel.channel import StepSender


# Debugging knob: check every fast-path step against the general path (slow; tests set it).
CHECK_FAST_PATHS_ENV = "HYBRID_ENGINE_CHECK_FAST_PATHS"
# An eager step with prompt tokens runs a multiple of this many tokens, per device type
# (padding tokens after the last sequence; `_write_tail_padding`). cuBLAS chooses a GEMM
# kernel for each new (M, N, K) it sees, which cost ~1 ms of host time per shape on the H100
# (torch 2.11): nearly every prompt step had a token count of its own, and a mixed step of
# the 8B preset took 43 ms to launch instead of 30 ms with a shape seen before.
TOKEN_ALIGNMENT = {"cuda": 64}


def sampling_row(params: SamplingParams) -> SamplingRow:
    """The per-step sampling fields of a request, computed once when it takes its row.
    top_k >= vocab means "off"; the clamp keeps it exact in float32 and int32."""
    temperature = params.temperature if params.temperature >= GREEDY_BELOW_TEMPERATURE else 0.0
    return SamplingRow(temperature=temperature, top_p=params.top_p, min_p=params.min_p,
                       repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                       frequency_penalty=params.frequency_penalty, top_k=float(min(params.top_k, 1 << 24)),
                       num_logprobs=float(-1 if params.logprobs is None else params.logprobs))


class ModelRunner:
    """Owns the model, the cache pools' bindings and the step buffer."""

    def __init__(self, model: HybridForCausalLM, kv: KVBlockAllocator, mamba: MambaStateAllocator,
                 max_num_batched_tokens: int, max_model_len: int, device: torch.device, max_drafts: int = 0,
                 sender: "StepSender | None" = None, follower: bool = False, check_dt_limit: bool = False):
        """Tensor parallelism (hybrid_engine/parallel/): the driver's runner has a `sender`
        that mirrors each prepared step, and the device operations of its pools, to the
        workers; a worker's runner is a `follower`: it runs the driver's steps and keeps
        their samples on the device (they come back from the driver only).
        `check_dt_limit`: the Mamba layers check generated tokens' dt against the
        prompt-only limit, and each step's row flags come back with its samples
        (`StepSamples.dt_limit_hits`)."""
        self.model, self.kv, self.mamba, self.device = model, kv, mamba, device
        self.check_dt_limit = check_dt_limit
        self.sender, self.follower = sender, follower
        self._device_ops = None if sender is None else sender.device_ops
        kv.device_ops = mamba.device_ops = self._device_ops
        self.max_seqs = mamba.max_num_seqs
        self.max_width = 1 + max_drafts  # tokens of the widest decode (verify) row
        self.token_alignment = TOKEN_ALIGNMENT.get(device.type, 1)
        # A verify row's padding positions lie up to `max_drafts` past the context, so block
        # tables and position tables have room for them (padding never writes KV).
        self.max_blocks_per_seq = kv.blocks_for(max_model_len + max_drafts)
        # Rows padded to the step's width, then the step to the token alignment.
        max_tokens = self._aligned(max_num_batched_tokens + self.max_seqs * max_drafts)
        # A step's prefix-cache saves each take a checkpoint slot (and a token position).
        self.buffer = StepBuffer(max_tokens, self.max_seqs, self.max_blocks_per_seq, mamba.num_slots, device,
                                 self.max_width, max_saves=min(mamba.checkpoint_slots, max_tokens),
                                 mask_bytes=(model.config.vocab_size + 7) // 8)
        for layer, (k, v) in zip(model.attention_layers(), kv.kv_caches):
            layer.kv_cache = (k, v)
        for i, mixer in enumerate(model.mamba_mixers()):
            mixer.conv_state, mixer.ssm_state = mamba.layer_views(i)
        # Per request row (`RequestState.row`), written when a request takes the row (or gets
        # a new block) and gathered every step: the KV block table and the `SamplingRow`.
        self._block_table = np.zeros((self.max_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._block_table_len = [0] * self.max_seqs
        self._block_table_owner: list[list[int] | None] = [None] * self.max_seqs
        # Keyed by the admission (`RequestState`, new at every admission) rather than the
        # request: a request evicted mid-prompt can get its old row back, resuming deeper in
        # a cached prefix, and must claim it again (sampling row, history prefix).
        self._row_owner: list[RequestState | None] = [None] * self.max_seqs
        self._row_sampling = np.zeros((self.max_seqs, len(SamplingRow._fields)), dtype=np.float32)
        # Graph padding rows sample greedily with no filters: the float32 group as a column.
        self._neutral_sampling = np.array(NEUTRAL_SAMPLING[SAMPLING_F32_ROWS], dtype=np.float32)[:, None]
        # 0, 1, 2, ...: row indices and positions, sliced instead of built per step.
        self._rows = np.arange(max(max_tokens + 1, max_model_len + max_drafts), dtype=np.int64)
        self._positions = torch.arange(max_tokens, dtype=torch.int64, device=device)
        # Token history per request row, written on device from each step's inputs (the
        # token at position p, or a draft that a later step overwrites if rejected), read
        # for penalties. Tokens that write no KV (padding) write the spare last column.
        self._history = torch.zeros(self.max_seqs, max_model_len + 1, dtype=torch.int64, device=device)
        # A step's samples (and logprobs with their token ids) come back packed in one
        # float64 matrix -- exact for token ids and float32 logprobs -- so one copy does it.
        # Alternating pinned buffers: with launch-ahead two steps are outstanding, and step
        # N's samples are read before step N+2 is launched.
        pin = device.type == "cuda"
        # Flat buffers, viewed contiguously per step: a non_blocking copy into a strided
        # pinned slice is staged through a temporary and silently synchronizes.
        self._host_out = [torch.zeros(self.max_seqs * self.max_width * (2 + 2 * (1 + MAX_LOGPROBS)),
                                      dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._host_hits = [torch.zeros(self.max_seqs, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._launches = 0
        # The newest launched step's samples, row by row, at a fixed address: a launch-ahead
        # step gathers its decode inputs here (CUDA graphs need fixed input addresses).
        # Stream order makes step N+1 read N's samples before writing its own.
        self._sampled = torch.zeros(self.max_seqs, dtype=torch.int64, device=device)
        self.graphs = None  # DecodeGraphs, when CUDA graphs are enabled
        self.num_steady_steps = 0  # steps prepared by the steady-state decode fast path
        self.check_steady_decode = os.environ.get(CHECK_FAST_PATHS_ENV) == "1"

    # ---- host side -------------------------------------------------------------------
    def _claim_row(self, request: Request) -> None:
        """Record the sampling row of a request that newly holds its row."""
        row = request.state.row
        self._row_owner[row] = request.state
        self._row_sampling[row] = sampling_row(request.params)

    def _write_history_prefix(self, request: Request, num_tokens: int) -> None:
        """Fill the token history (read by penalties) of a request that starts at
        `num_tokens` from a cached prefix. Only a request with penalties needs it: the
        step's single copy cannot carry a whole prefix, so it takes a copy of its own."""
        sampling = self._row_sampling[request.state.row]
        if (sampling[SAMPLING.repetition_penalty] == 1.0 and sampling[SAMPLING.presence_penalty] == 0.0
                and sampling[SAMPLING.frequency_penalty] == 0.0):
            return
        self.write_history(request.state.row, (request.prompt_token_ids + request.output_token_ids)[:num_tokens])

    def write_history(self, row: int, tokens: list[int]) -> None:
        """Write `tokens` at the start of row `row` of the token history, on the device, now."""
        self._history[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        if self._device_ops is not None:
            self._device_ops.record("runner", "write_history", row, tokens)

    def _sync_block_table(self, request: Request) -> None:
        """Copy the request's newly allocated block ids into its host table row.

        The row is keyed by the request's block *list object*: freeing blocks (finish,
        eviction) gives the request a new list, so a readmitted request rewrites its row.
        """
        row = request.state.row
        if self._block_table_owner[row] is not request.blocks:
            self._block_table_owner[row], self._block_table_len[row] = request.blocks, 0
        known, blocks = self._block_table_len[row], request.blocks
        if len(blocks) > known:
            self._block_table[row, known:len(blocks)] = blocks[known:]
            self._block_table_len[row] = len(blocks)

    def prepare(self, sched: SchedulerOutput, prev: StepHandle | None = None) -> StepPlan:
        """Write the step into the host buffer and mirror it to the device (one copy).

        A decode row whose input token is still in flight (sampled by `prev`, not yet on
        the host) gets `input_from_prev` = its row in `prev`; the device fills it in.
        A step with exactly `prev`'s decode rows is derived from `prev`'s fields
        (`_write_steady_decode`); any other goes through `_write_step`.
        """
        plan = None
        if prev is not None and not sched.prefills and not self._has_drafts(sched):
            plan = self._write_steady_decode(sched, prev)
            if plan is not None and self.check_steady_decode:
                self._check_steady_decode(plan, prev)
        if plan is None:
            plan = self._write_step(sched, prev)
        else:
            self.num_steady_steps += 1
        plan.host_index = self.buffer.current_index
        if self.sender is not None:
            self.sender.send(plan, self.buffer)
        self.buffer.sync(plan.num_masks)
        return plan

    def _has_drafts(self, sched: SchedulerOutput) -> bool:
        return self.max_width > 1 and any(c.drafts for c in sched.decodes)

    def _write_step(self, sched: SchedulerOutput, prev: StepHandle | None) -> StepPlan:
        """The general path: every row's fields from the requests' bookkeeping."""
        decodes, prefills = sched.decodes, sched.prefills
        n_dec, n_seq = len(decodes), len(decodes) + len(prefills)
        width = 1
        if self._has_drafts(sched):
            # Graphs are captured for the widest rows only: any verify step takes that width.
            width = self.max_width if self.graphs is not None else 1 + max(len(c.drafts) for c in decodes)
        h = self.buffer.host_np
        owners, bt_owner, bt_len = self._row_owner, self._block_table_owner, self._block_table_len
        bs = self.kv.block_size
        seq_rows: list[SeqFields] = []
        token_rows: list[TokenFields] = []
        rows: list[int] = []  # each sequence's request row (block table, sampling, history)
        num_from_prev = 0
        for i, c in enumerate(decodes):
            # Runs for every decode row every step: kept flat on purpose (no helper calls
            # unless the row changed hands or the request got a new block).
            r = c.request
            state, blocks = r.state, r.blocks
            row = state.row
            if owners[row] is not state:
                self._claim_row(r)
            if bt_owner[row] is not blocks or bt_len[row] != len(blocks):
                self._sync_block_table(r)
            start, output = c.start, r.output_token_ids
            n_out = len(output)
            n_prompt = len(r.prompt_token_ids)
            # The input token sits at `start`: on the host once its sample retired, else
            # on the device as the previous step's sample at the request's row in `prev`.
            if start >= n_prompt + n_out:
                from_prev, token = c.prev_row, 0
                num_from_prev += 1
            else:
                from_prev = -1
                token = output[start - n_prompt] if start >= n_prompt else r.prompt_token_ids[start]
            # Scheduling launched this row (all its samples are pending) and chose its slots.
            seq_rows.append(SeqFields(mamba_src=c.state_src, mamba_dst=c.state_dsts[0], input_from_prev=from_prev,
                                      logits_indices=i * width, seeds=r.seed,
                                      output_pos=n_out + r.pending_samples - c.num_tokens, history_rows=row,
                                      prompt_lens=n_prompt, history_lens=start + 1, num_drafts=len(c.drafts)))
            token_rows.append(TokenFields(input_ids=token, positions=start,
                                          slot_mapping=blocks[start // bs] * bs + start % bs))
            rows.append(row)
        if num_from_prev and prev is None:
            raise RuntimeError("a decode input is still on the device but no previous step was given")
        if n_dec:
            token_np = np.array(token_rows, dtype=np.int64)
            self._write_decode_rows(np.array(seq_rows, dtype=np.int64), token_np)
            if width > 1:
                self._write_verify_rows(decodes, width, token_np)
        num_tokens, max_q = n_dec * width, width
        num_saves = 0
        if prefills:
            num_tokens, longest = self._write_prefill_rows(prefills, n_dec, num_tokens, rows)
            num_tokens = self._write_tail_padding(num_tokens)
            max_q = max(max_q, longest)
            num_saves = self._write_saves(prefills)
        h["cu_seqlens_q"][: n_dec + 1] = self._rows[: n_dec + 1] * width
        rows_np = np.array(rows, dtype=np.int64)
        h["block_tables"][:n_seq] = self._block_table[rows_np]
        new_slots = self.mamba.take_new_slots()
        if new_slots:
            h["new_state_slots"][: len(new_slots)] = new_slots
        plan = self._write_sampling(sched, rows_np, n_dec, num_tokens, max_q)
        plan.num_from_prev = num_from_prev
        plan.num_new_slots = len(new_slots)
        plan.num_saves = num_saves
        plan.decode_width = width
        if not prefills and width == 1:
            plan.decode_requests = [c.request for c in decodes]
        if self.graphs is not None:
            size = self.graphs.padded_size(n_dec, plan.num_prefill)
            if size is not None:
                self._write_padding(plan, size)
        plan.num_masks = self._write_grammar_masks(sched, plan.num_seqs)
        return plan

    def _write_grammar_masks(self, sched: SchedulerOutput, num_rows: int) -> int:
        """Structured outputs: the token mask of every sampling row whose request has a
        grammar, and each row's mask index (-1: unconstrained; graph padding included).
        Returns how many masks the step uses (0: the fields are neither written nor read)."""
        chunks = [c for c in sched.decodes + sched.prefills if c.samples and c.request.grammar is not None]
        if not chunks:
            return 0
        h = self.buffer.host_np
        grammar_rows, masks = h["grammar_rows"], h["grammar_masks"]
        grammar_rows[:num_rows] = -1
        row_of = {id(c): i for i, c in enumerate(sched.decodes + sched.prefills)}
        for k, chunk in enumerate(chunks):
            chunk.request.grammar.write_mask(masks[k])
            grammar_rows[row_of[id(chunk)]] = k
        return len(chunks)

    def _check_steady_decode(self, plan: StepPlan, prev: StepHandle) -> None:
        """Debug check (HYBRID_ENGINE_CHECK_FAST_PATHS=1, set by the tests): rewrite the
        step through the general path and require the same host fields and plan."""
        fast = self.buffer.decode_rows_snapshot(plan.num_decode)
        general = self._write_step(plan.sched, prev)
        same_fields = all(np.array_equal(a, b) for a, b in zip(fast, self.buffer.decode_rows_snapshot(plan.num_decode)))
        if not same_fields or general != plan:
            raise AssertionError(f"steady-state decode fast path differs from the general path: fields equal "
                                 f"{same_fields}, plans {plan} vs {general}")

    def _write_steady_decode(self, sched: SchedulerOutput, prev: StepHandle) -> StepPlan | None:
        """The steady-state decode step, derived from the previous one without a per-row loop.

        Applies when this step's rows are exactly `prev`'s rows (same requests, same order,
        decode only, under launch-ahead, none rejected) and no row enters a new KV block. Each row then
        reads the state `prev` writes and writes the one the state allocator hands on
        (`following_slots`), is one position further (KV slot + 1 in the same block), one
        output further, and takes its input from `prev`'s sample at the same row; everything
        else (sampling, block tables, graph padding) is unchanged. So the host buffer is
        `prev`'s, copied, plus those deltas. Returns None (having changed nothing) when the
        step does not qualify.
        """
        pp, n = prev.plan, len(sched.decodes)
        if (pp.decode_requests is None or len(pp.decode_requests) != n
                or pp.host_index != self.buffer.current_index ^ 1 or self.mamba.has_new_slots()
                or not all(prev.valid)):  # a rejected row's successor reads the committed state
            return None
        requests = [c.request for c in sched.decodes]
        if requests != pp.decode_requests:  # identity comparison (Request has eq=False)
            return None
        positions = self.buffer.host_group("token_i64", pp.host_index)[TOKEN.positions, :n] + 1
        if (positions % self.kv.block_size == 0).any():
            return None
        size = n
        if self.graphs is not None:
            size = self.graphs.padded_size(n, 0) or n
        self.buffer.copy_rows_from(pp.host_index, size)  # graph padding rows included
        tokens, seqs = self.buffer.host_group("token_i64"), self.buffer.host_group("seq_i64")
        tokens[TOKEN.input_ids, :n] = 0  # every input comes from `prev` (the device fills it in)
        tokens[TOKEN.positions, :n] = positions
        tokens[TOKEN.slot_mapping, :n] += 1
        seqs[SEQ.mamba_src, :n], seqs[SEQ.mamba_dst, :n] = self.mamba.following_slots(seqs[SEQ.mamba_dst, :n].copy())
        seqs[SEQ.input_from_prev, :n] = self._rows[:n]  # the same row of `prev`
        seqs[SEQ.output_pos, :n] += 1
        seqs[SEQ.history_lens, :n] += 1
        self.buffer.host_np["seq_lens"][:n] += 1
        plan = StepPlan(sched=sched, num_decode=n, num_prefill=0, num_tokens=n, max_seqlen_q=1,
                        num_logprobs=pp.num_logprobs, all_greedy=pp.all_greedy, use_penalties=pp.use_penalties,
                        num_from_prev=n, decode_requests=requests)
        if size > n:
            self._pad_plan(plan, size)
        return plan

    def _write_decode_rows(self, seq_rows: np.ndarray, token_rows: np.ndarray) -> None:
        """Fields of decode rows [0, n) from their per-row values ([n, SeqFields] and
        [n, TokenFields] arrays)."""
        n = len(seq_rows)
        h = self.buffer.host_np
        self.buffer.host_group("seq_i64")[:, :n] = seq_rows.T
        self.buffer.host_group("token_i64")[:, :n] = token_rows.T
        h["seq_lens"][:n] = seq_rows[:, SEQ.history_lens]
        h["prompt_token_mask"][:n] = False
        h["prefill_cu_seqlens"][0] = 0

    def _write_verify_rows(self, decodes: list[ScheduledChunk], width: int, token_rows: np.ndarray) -> None:
        """Token fields of decode rows `width` tokens wide: row i's input token, its drafts,
        then padding (position repeated, no KV write, no state), at tokens [i*width,
        (i+1)*width); and the slot the state after each position is written to (the row
        starts from its `mamba_src`)."""
        n, bs = len(decodes), self.kv.block_size
        pad = [0] * width
        inputs = token_rows[:, TOKEN.input_ids].tolist()
        ids = np.array([[token, *c.drafts, *pad[c.num_tokens:]] for token, c in zip(inputs, decodes)], dtype=np.int64)
        verify_dst = np.array([[*c.state_dsts, *pad[c.num_tokens:]] for c in decodes], dtype=np.int64)
        real = np.array([c.num_tokens for c in decodes], dtype=np.int64)[:, None]
        offsets = self._rows[:width][None, :]
        verify_dst[offsets >= real] = -1
        positions = token_rows[:, TOKEN.positions][:, None] + np.minimum(offsets, real - 1)
        table = self._block_table[[c.request.state.row for c in decodes]]
        slots = np.take_along_axis(table, positions // bs, axis=1) * bs + positions % bs
        slots[offsets >= real] = -1
        tokens, h, total = self.buffer.host_group("token_i64"), self.buffer.host_np, n * width
        tokens[TOKEN.input_ids, :total] = ids.ravel()
        tokens[TOKEN.positions, :total] = positions.ravel()
        tokens[TOKEN.slot_mapping, :total] = slots.ravel()
        h["verify_dst"][:width, :n] = verify_dst.T
        h["seq_lens"][:n] += width - 1  # keys through the last (padding) position
        h["prompt_token_mask"][:total] = False

    def _write_prefill_rows(self, prefills: list, n_dec: int, token_start: int, rows: list[int]) -> tuple[int, int]:
        """Fields of the prefill chunks (rows after the decode rows, tokens from
        `token_start`); appends their request rows to `rows`. Per-token fields are written
        chunk by chunk with NumPy slices. Returns (num_tokens, longest chunk)."""
        h = self.buffer.host_np
        tokens, seqs = self.buffer.host_group("token_i64"), self.buffer.host_group("seq_i64")
        prompt_mask = h["prompt_token_mask"]
        bs = self.kv.block_size
        seq_rows: list[SeqFields] = []
        cu = [token_start]
        for c in prefills:
            r = c.request
            row = r.state.row
            start, end = c.start, c.start + c.num_tokens
            if self._row_owner[row] is not r.state:
                self._claim_row(r)
                if start > 0:  # resumed from the prefix cache: tokens [0, start) were never fed
                    self._write_history_prefix(r, start)
            self._sync_block_table(r)
            t0, t1 = cu[-1], cu[-1] + c.num_tokens
            prompt, output = r.prompt_token_ids, r.output_token_ids
            n_prompt = len(prompt)
            in_prompt = max(0, min(end, n_prompt) - start)
            tokens[TOKEN.input_ids, t0:t0 + in_prompt] = prompt[start:start + in_prompt]
            tokens[TOKEN.input_ids, t0 + in_prompt:t1] = output[max(start - n_prompt, 0): max(end - n_prompt, 0)]
            positions = self._rows[start:end]  # (end <= max_model_len <= len(_rows))
            tokens[TOKEN.positions, t0:t1] = positions
            tokens[TOKEN.slot_mapping, t0:t1] = self._block_table[row, positions // bs] * bs + positions % bs
            prompt_mask[t0:t0 + in_prompt] = True
            prompt_mask[t0 + in_prompt:t1] = False
            cu.append(t1)
            seq_rows.append(SeqFields(mamba_src=c.state_src, mamba_dst=c.state_dsts[0], input_from_prev=-1,
                                      logits_indices=t1 - 1, seeds=r.seed,
                                      output_pos=len(output) + r.pending_samples - c.samples, history_rows=row,
                                      prompt_lens=n_prompt, history_lens=end, num_drafts=0))
            rows.append(row)
        n_seq = n_dec + len(prefills)
        seqs[:, n_dec:n_seq] = np.array(seq_rows, dtype=np.int64).T
        h["seq_lens"][n_dec:n_seq] = seqs[SEQ.history_lens, n_dec:n_seq]
        cu_np = np.array(cu, dtype=np.int32)
        h["cu_seqlens_q"][n_dec:n_seq + 1] = cu_np
        h["prefill_cu_seqlens"][: len(prefills) + 1] = cu_np - token_start
        return cu[-1], max(c.num_tokens for c in prefills)

    def _write_saves(self, prefills: list) -> int:
        """The states the prefill chunks write from inside themselves (prefix-cache
        checkpoints, `layers.kernels.ops.StateSaves`); returns how many."""
        if not any(c.saves for c in prefills):
            return 0
        h = self.buffer.host_np
        cu, offsets, slots = [0], [], []
        for c in prefills:
            offsets += [save.position - c.start for save in c.saves]
            slots += [save.slot for save in c.saves]
            cu.append(len(offsets))
        h["save_cu"][: len(cu)] = cu
        h["save_offsets"][: len(offsets)] = offsets
        h["save_slots"][: len(slots)] = slots
        return len(offsets)

    def _write_tail_padding(self, num_tokens: int) -> int:
        """Round a prompt step's `num_tokens` up to the token alignment with padding tokens
        after the last sequence: they belong to no sequence, write no KV (slot -1), and
        every op outputs zeros or unused rows for them. Returns the padded count."""
        padded = self._aligned(num_tokens)
        self._write_padding_tokens(num_tokens, padded)
        return padded

    def _aligned(self, num_tokens: int) -> int:
        """`num_tokens` rounded up to the token alignment."""
        return -(-num_tokens // self.token_alignment) * self.token_alignment

    def _write_padding_tokens(self, t0: int, t1: int) -> None:
        """Tokens [t0, t1) as padding: id 0, position 0, no KV written, not prompt tokens."""
        tokens = self.buffer.host_group("token_i64")
        tokens[TOKEN.input_ids, t0:t1] = 0
        tokens[TOKEN.positions, t0:t1] = 0
        tokens[TOKEN.slot_mapping, t0:t1] = -1  # write no KV
        self.buffer.host_np["prompt_token_mask"][t0:t1] = False

    def _write_padding(self, plan: StepPlan, size: int) -> None:
        """Grow a decode-only step to `size` rows with rows that touch no state (for a graph)."""
        h, lo, width = self.buffer.host_np, plan.num_seqs, plan.decode_width
        if size > lo:
            self._write_padding_tokens(lo * width, size * width)
            h["verify_dst"][:width, lo:size] = -1
            seq = self.buffer.host_group("seq_i64")
            seq[:, lo:size] = 0  # seeds, output_pos, history rows / lens, prompt_lens
            seq[SEQ.mamba_src, lo:size] = -1  # no state
            seq[SEQ.mamba_dst, lo:size] = -1
            seq[SEQ.input_from_prev, lo:size] = -1  # keep the host ids
            seq[SEQ.logits_indices, lo:size] = self._rows[lo:size] * width
            self.buffer.host_group("sampling_f32")[:, lo:size] = self._neutral_sampling
            h["cu_seqlens_q"][lo + 1:size + 1] = self._rows[lo + 1:size + 1] * width
            # A padding verify row has `width` queries: it attends to `width` keys of block 0
            # (read only; its outputs are never used).
            h["seq_lens"][lo:size] = 0 if width == 1 else width
            h["block_tables"][lo:size] = 0
            h["top_k"][lo:size] = NEUTRAL_SAMPLING.top_k
        h["prefill_cu_seqlens"][0] = 0
        self._pad_plan(plan, size)

    @staticmethod
    def _pad_plan(plan: StepPlan, size: int) -> None:
        plan.num_decode = size
        plan.num_tokens = size * plan.decode_width
        plan.max_seqlen_q = plan.decode_width
        plan.num_from_prev = size  # the graph always gathers (rows of -1 keep the host ids)

    def padding_plan(self, size: int, all_greedy: bool, width: int = 1) -> StepPlan:
        """A decode step of `size` padding rows `width` tokens wide, written and mirrored
        (for graph capture)."""
        plan = StepPlan(sched=SchedulerOutput(), num_decode=0, num_prefill=0, num_tokens=0, max_seqlen_q=1,
                        num_logprobs=-1, all_greedy=all_greedy, use_penalties=False, num_from_prev=0,
                        decode_width=width)
        self._write_padding(plan, size)
        self.buffer.sync()
        return plan

    def _write_sampling(self, sched: SchedulerOutput, rows: np.ndarray, n_dec: int, n_tokens: int,
                        max_q: int) -> StepPlan:
        """Sampling fields gathered from the row table; the step's sampler flags from them."""
        n = len(rows)
        sampling = self._row_sampling[rows].T  # [SamplingRow fields, n]
        self.buffer.host_group("sampling_f32")[:, :n] = sampling[SAMPLING_F32_ROWS]
        self.buffer.host_np["top_k"][:n] = sampling[SAMPLING.top_k]  # (< 2**24 after clamping: exact in float32)
        penalties = ((sampling[SAMPLING.repetition_penalty] != 1.0) | (sampling[SAMPLING.presence_penalty] != 0.0)
                     | (sampling[SAMPLING.frequency_penalty] != 0.0))
        return StepPlan(
            sched=sched, num_decode=n_dec, num_prefill=n - n_dec, num_tokens=n_tokens, max_seqlen_q=max_q,
            num_logprobs=int(sampling[SAMPLING.num_logprobs].max()),
            all_greedy=not sampling[SAMPLING.temperature].any(), use_penalties=bool(penalties.any()), num_from_prev=0,
        )

    # ---- device side -----------------------------------------------------------------
    def forward_meta(self, plan: StepPlan) -> ForwardMeta:
        """Slices of the device views sized for this step."""
        d, t, s = self.buffer.device, plan.num_tokens, plan.num_seqs
        verify_dst = None
        if plan.decode_width > 1:
            verify_dst = d["verify_dst"][: plan.decode_width, : plan.num_decode]
        return ForwardMeta(
            num_decode=plan.num_decode, num_prefill=plan.num_prefill, num_tokens=t, max_seqlen_q=plan.max_seqlen_q,
            decode_width=plan.decode_width, verify_dst=verify_dst,
            positions=d["positions"][:t], prompt_token_mask=d["prompt_token_mask"][:t],
            slot_mapping=d["slot_mapping"][:t], cu_seqlens_q=d["cu_seqlens_q"][: s + 1],
            prefill_cu_seqlens=d["prefill_cu_seqlens"][: plan.num_prefill + 1], seq_lens=d["seq_lens"][:s],
            block_tables=d["block_tables"][:s], mamba_src=d["mamba_src"][:s], mamba_dst=d["mamba_dst"][:s],
            logits_indices=d["logits_indices"][:s],
            state_saves=StateSaves(d["save_cu"][: plan.num_prefill + 1], d["save_offsets"][: plan.num_saves],
                                   d["save_slots"][: plan.num_saves]) if plan.num_saves else None,
            dt_limit_hits=d["dt_limit_hits"][:s] if self.check_dt_limit else None,
        )

    def _sampling_tensors(self, plan: StepPlan, meta: ForwardMeta, input_ids: torch.Tensor) -> SamplingTensors:
        """Per sampled row: a decode row's fields repeated for each of its positions (position
        j draws output `output_pos + j` and sees `j` more history tokens), then the prefill
        chunks' fields."""
        d, s, nd, width = self.buffer.device, plan.num_seqs, plan.num_decode, plan.decode_width

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t if width == 1 else torch.cat((t[:nd].repeat_interleave(width), t[nd:]))

        step = None if width == 1 else torch.cat((self._positions[:width].repeat(nd),
                                                  torch.zeros(plan.num_prefill, dtype=torch.int64, device=self.device)))
        history = prompt_len = history_len = None
        if plan.use_penalties:
            token_seq = torch.searchsorted(meta.cu_seqlens_q[1:], self._positions[: plan.num_tokens], right=True)
            token_seq = token_seq.clamp_(max=s - 1)  # tail padding tokens: past the last sequence
            rows = d["history_rows"][:s]
            # Padding tokens (no KV slot) write the spare column, never a real position.
            column = torch.where(meta.slot_mapping >= 0, meta.positions, self._history.shape[1] - 1)
            self._history[rows[token_seq], column] = input_ids
            history, prompt_len, history_len = self._history[per_row(rows)], per_row(d["prompt_lens"][:s]), \
                per_row(d["history_lens"][:s])
            if step is not None:
                history_len = history_len + step
        output_pos = per_row(d["output_pos"][:s])
        return SamplingTensors(
            temperature=per_row(d["temperature"][:s]), top_k=per_row(d["top_k"][:s]), top_p=per_row(d["top_p"][:s]),
            min_p=per_row(d["min_p"][:s]), repetition_penalty=per_row(d["repetition_penalty"][:s]),
            presence_penalty=per_row(d["presence_penalty"][:s]), frequency_penalty=per_row(d["frequency_penalty"][:s]),
            seed=per_row(d["seeds"][:s]), output_pos=output_pos if step is None else output_pos + step,
            token_history=history, prompt_len=prompt_len, history_len=history_len,
        )

    def forward_sample(self, plan: StepPlan) -> torch.Tensor:
        """The device work of a step: inputs -> forward -> logits -> samples, packed as
        float64 [S, 1 (+ 2 (1+K) logprob columns)]. Sync-free with the fast kernels, so a
        decode step of this shape can be captured as one CUDA graph."""
        meta = self.forward_meta(plan)
        return self.sample_rows(plan, meta, self.forward_rows(plan, meta))

    def forward_rows(self, plan: StepPlan, meta: ForwardMeta) -> torch.Tensor:
        """Inputs -> forward -> the final hidden states of the rows the step samples
        ([num_sampled, hidden]): the part of a step that does not depend on its sampler, which
        a decode step's forward graph captures (`DecodeGraphs.replay`)."""
        d, nd, width = self.buffer.device, plan.num_decode, plan.decode_width
        input_ids = d["input_ids"][: plan.num_tokens]
        if plan.num_from_prev:  # decode inputs still on the device: the previous step's samples
            rows = d["input_from_prev"][:nd]
            fed = self._sampled[rows.clamp(min=0)]
            first = input_ids[: nd * width: width]  # each decode row's input token
            first.copy_(torch.where(rows >= 0, fed, first))
        hidden = self.model(input_ids, meta)
        logits_indices = meta.logits_indices
        if width > 1:  # every position of a verify row is sampled
            logits_indices = torch.cat((self._positions[: nd * width], logits_indices[nd:]))
        return hidden[logits_indices]

    def sample_rows(self, plan: StepPlan, meta: ForwardMeta, hidden: torch.Tensor) -> torch.Tensor:
        """The sampled rows' hidden states -> logits -> samples (verified, for verify rows),
        packed as `forward_sample` returns them; the step's inputs (penalties read them) are
        the ones `forward_rows` fed."""
        d, nd, width = self.buffer.device, plan.num_decode, plan.decode_width
        input_ids = d["input_ids"][: plan.num_tokens]
        if plan.all_greedy and plan.num_logprobs < 0 and not plan.use_penalties and not plan.num_masks:
            # `sample` would take the logits' argmax: one op from the LM head's output instead
            out = SamplerOutput(sampled_token_ids=self.model.greedy_tokens(hidden))
        else:
            logits = self.model.compute_logits(hidden)
            if plan.num_masks:
                rows = d["grammar_rows"][: plan.num_seqs]
                if width > 1:
                    rows = torch.cat((rows[:nd].repeat_interleave(width), rows[nd:]))
                logits = apply_token_masks(logits, rows, d["grammar_masks"][: plan.num_masks])
            out = sample(logits, self._sampling_tensors(plan, meta, input_ids), num_logprobs=plan.num_logprobs,
                         all_greedy=plan.all_greedy, use_penalties=plan.use_penalties)
        tokens = out.sampled_token_ids
        if width == 1:
            self._sampled[: plan.num_seqs].copy_(tokens)
            packed = tokens.double()[:, None]
        else:
            accepted = self._verify(tokens[: nd * width].view(nd, width), input_ids[: nd * width].view(nd, width),
                                    d["num_drafts"][:nd])
            self._sampled[nd: plan.num_seqs].copy_(tokens[nd * width:])
            per_token = torch.cat((accepted.repeat_interleave(width),
                                   torch.zeros(plan.num_prefill, dtype=torch.int64, device=self.device)))
            packed = torch.stack((tokens.double(), per_token.double()), dim=1)
        if out.logprobs is not None:
            packed = torch.cat([packed, out.logprobs.double(), out.logprob_token_ids.double()], dim=1)
        return packed

    def _verify(self, samples: torch.Tensor, inputs: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
        """Exact verification of verify rows ([rows, width] samples and input tokens): the
        sample at position j (drawn with the noise of its own output position) accepts the
        draft at j+1 when they are equal; the first mismatch ends the run. Returns the
        drafts accepted per row, and leaves each row's last kept sample (the input of a
        launch-ahead row, which assumes all drafts accepted) in `_sampled`."""
        nd, width = samples.shape
        matches = (samples[:, :-1] == inputs[:, 1:]) & (self._positions[: width - 1] < num_drafts[:, None])
        accepted = matches.long().cumprod(dim=1).sum(dim=1)
        self._sampled[:nd].copy_(samples.gather(1, accepted[:, None]).squeeze(1))
        return accepted

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Run a prepared step (a graph replay when one fits); samples start copying to the host."""
        if plan.num_new_slots:
            self.mamba.zero_slots(self.buffer.device["new_state_slots"][: plan.num_new_slots])
        packed = None
        if self.graphs is not None:
            packed = self.graphs.replay(plan, lambda hidden: self.sample_rows(plan, self.forward_meta(plan), hidden))
        if packed is None:
            packed = self.forward_sample(plan)
        if self.follower:
            return StepHandle(plan, packed, None)
        host_out = self._host_out[self._launches % 2][: packed.numel()].view(packed.shape)
        host_out.copy_(packed, non_blocking=True)
        host_hits = None
        if self.check_dt_limit:  # (before the next step's buffer copy clears them)
            host_hits = self._host_hits[self._launches % 2][: plan.num_seqs]
            host_hits.copy_(self.buffer.device["dt_limit_hits"][: plan.num_seqs], non_blocking=True)
        self._launches += 1
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self.buffer.stream)
        return StepHandle(plan, host_out, event, host_hits)

"""The per-step bookkeeping buffer: CPU source of truth, mirrored to the device in one copy.

Every per-token and per-sequence field a step needs lives at a fixed offset of ONE pinned
CPU byte buffer; `sync()` copies it into ONE device buffer of the same layout, and the
forward pass reads only the device views. Fields are laid out widest dtype first, so every
offset is aligned without padding.

Row layout (the scheduler's order): sequences [0, num_decode) are decode rows of W tokens
each (W = 1 + the step's most drafts; tokens [0, num_decode * W): the input token, the
drafts, then padding); prefill chunks follow, packed, in tokens [num_decode * W,
num_tokens). Rows past the step's count are stale and never read: a step's bytes are the
leading rows of each field (`StepExtent`), which is all tensor parallelism sends to the
other ranks (`pack` / `unpack`).

| field               | dtype   | shape      | meaning                                         |
|---------------------|---------|------------|-------------------------------------------------|
| input_ids           | int64   | [T]        | token fed at each position                      |
| positions           | int64   | [T]        | absolute position of each token                 |
| slot_mapping        | int64   | [T]        | KV cache slot (block * block_size + offset)     |
| mamba_src/mamba_dst | int64   | [S]        | state slot a sequence reads / writes            |
| verify_dst          | int64   | [W, S]     | verify rows: slot the state after position j of |
|                     |         |            | row i is written to, at [j, i] (-1 = padding);  |
|                     |         |            | position-major: each position's list contiguous |
| input_from_prev     | int64   | [S]        | decode row's input = previous step's sample at  |
|                     |         |            | this row (launch-ahead), -1 = input_ids holds it |
| logits_indices      | int64   | [S]        | token whose hidden state is sampled             |
| new_state_slots     | int64   | [N]        | Mamba state slots to zero before the forward    |
|                     |         |            | (N: every slot of the state pool)               |
| save_slots          | int64   | [M]        | prefix caching: checkpoint slot of each state a |
|                     |         |            | prefill chunk writes from inside itself         |
| seeds, output_pos   | int64   | [S]        | sampling noise key (seed, output index)         |
| history_rows        | int64   | [S]        | row of the token-history table (penalties)      |
| num_drafts          | int64   | [S]        | verify row's draft tokens (0: plain row)        |
| prompt_lens, history_lens | int64 | [S]    | prompt length / tokens known (penalties)        |
| cu_seqlens_q        | int32   | [S+1]      | query starts of every sequence                  |
| prefill_cu_seqlens  | int32   | [S+1]      | query starts of the prefill chunks, from 0      |
| save_cu             | int32   | [S+1]      | each prefill chunk's first entry in save_*      |
| save_offsets        | int32   | [M]        | tokens of its chunk before each saved state     |
| seq_lens            | int32   | [S]        | keys per sequence after this step               |
| block_tables        | int32   | [S, MB]    | KV block ids of each sequence                   |
| top_k               | int32   | [S]        | sampling                                        |
| dt_limit_hits       | int32   | [S]        | written by the device only: 1 where the Mamba   |
|                     |         |            | kernels found a generated token whose dt the    |
|                     |         |            | prompt-only limit would have clamped (prefix    |
|                     |         |            | caching); zero on the host, so every step's     |
|                     |         |            | copy clears it                                  |
| grammar_rows        | int32   | [S]        | structured outputs: the row of grammar_masks    |
|                     |         |            | that constrains a sequence's sample (-1: none); |
|                     |         |            | written and read only in steps with masks       |
| temperature, top_p, min_p, repetition/presence/frequency_penalty | float32 | [S] | sampling |
| prompt_token_mask   | bool    | [T]        | token belongs to the prompt (Mamba dt limit)    |
| grammar_masks       | uint8   | [S, V/8]   | the tokens a constrained sample may take, one   |
|                     |         |            | bit per token id (bit t % 8 of byte t // 8)     |

`grammar_masks` comes last, so a step copies only the mask rows it uses: the copy ends
there (`sync(mask_rows)`), and a step without structured outputs copies none of them.
"""
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class _Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


# Field groups: consecutive same-dtype, same-length fields that the bookkeeping writes with
# one strided copy through a 2-D view (`StepBuffer.host_group`), not field by field. Each
# group is a NamedTuple type: its field order IS the layout, a row of values is built by
# name (`SeqFields(mamba_src=..., ...)`), and `SEQ.output_pos` etc. name a group's rows.
class TokenFields(NamedTuple):
    """Per-token int64 fields."""

    input_ids: int
    positions: int
    slot_mapping: int


class SeqFields(NamedTuple):
    """Per-sequence int64 fields."""

    mamba_src: int
    mamba_dst: int
    input_from_prev: int
    logits_indices: int
    seeds: int
    output_pos: int
    history_rows: int
    prompt_lens: int
    history_lens: int
    num_drafts: int


class SamplingRow(NamedTuple):
    """A request's sampling parameters as the device reads them: the float32 group
    (`SAMPLING_F32`), then top_k (int32 field) and how many logprobs it wants (-1: none;
    it sets the step's sampler variant, it is not a buffer field)."""

    temperature: float
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    top_k: float
    num_logprobs: float


# Row indices of each group's 2-D view (and columns of a SamplingRow array), by name.
TOKEN = TokenFields._make(range(len(TokenFields._fields)))
SEQ = SeqFields._make(range(len(SeqFields._fields)))
SAMPLING = SamplingRow._make(range(len(SamplingRow._fields)))
# The float32 group is SamplingRow's leading fields: rows [SAMPLING_F32_ROWS] of a
# [SamplingRow, n] array are the group as the buffer lays it out.
SAMPLING_F32_ROWS = slice(0, SAMPLING.top_k)
TOKEN_I64 = TokenFields._fields
SEQ_I64 = SeqFields._fields
SAMPLING_F32 = SamplingRow._fields[SAMPLING_F32_ROWS]
GROUPS = {"token_i64": TOKEN_I64, "seq_i64": SEQ_I64, "sampling_f32": SAMPLING_F32}
# What rows that sample nothing (CUDA-graph padding) sample with: greedy, no filters.
NEUTRAL_SAMPLING = SamplingRow(temperature=0.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                               frequency_penalty=0.0, top_k=0.0, num_logprobs=-1.0)


class StepExtent(NamedTuple):
    """How many leading rows of each field a step uses (graph padding rows included)."""

    tokens: int
    seqs: int
    width: int  # verify_dst rows (positions of the widest decode row)
    new_slots: int
    saves: int
    masks: int = 0  # grammar_masks rows (structured outputs)


def _fields(max_tokens: int, max_seqs: int, max_blocks: int, max_new_slots: int, max_width: int,
            max_saves: int, mask_bytes: int) -> list[_Field]:
    t, s = (max_tokens,), (max_seqs,)
    max_saves = max(max_saves, 1)  # (a zero-size view would have no address inside the buffer)
    return (
        [_Field(n, torch.int64, t) for n in TOKEN_I64]
        + [_Field(n, torch.int64, s) for n in SEQ_I64]
        + [_Field("verify_dst", torch.int64, (max_width, max_seqs))]
        + [_Field("new_state_slots", torch.int64, (max_new_slots,)), _Field("save_slots", torch.int64, (max_saves,))]
        + [_Field("cu_seqlens_q", torch.int32, (max_seqs + 1,)), _Field("prefill_cu_seqlens", torch.int32, (max_seqs + 1,)),
           _Field("save_cu", torch.int32, (max_seqs + 1,)), _Field("save_offsets", torch.int32, (max_saves,)),
           _Field("seq_lens", torch.int32, s), _Field("block_tables", torch.int32, (max_seqs, max_blocks)),
           _Field("top_k", torch.int32, s), _Field("dt_limit_hits", torch.int32, s),
           _Field("grammar_rows", torch.int32, s)]
        + [_Field(n, torch.float32, s) for n in SAMPLING_F32]
        + [_Field("prompt_token_mask", torch.bool, t), _Field("grammar_masks", torch.uint8, (max_seqs, mask_bytes))]
    )


_RANGES_CACHE_SIZE = 256  # step extents whose byte ranges a StepBuffer keeps
# What `unpack(scramble_stale=True)` writes outside a step's rows: as int64 an index far out
# of every table, as float32 a huge value.
STALE_JUNK = 0x5A
# Which count of a StepExtent gives each field's leading rows (block_tables: rows of MB).
_EXTENT_OF = {**dict.fromkeys(TOKEN_I64 + ("prompt_token_mask",), "token"),
              **dict.fromkeys(SEQ_I64 + SAMPLING_F32 + ("seq_lens", "block_tables", "top_k", "dt_limit_hits",
                                                        "grammar_rows"), "seq"),
              "grammar_masks": "masks",
              **dict.fromkeys(("cu_seqlens_q", "prefill_cu_seqlens", "save_cu"), "cu"),
              "new_state_slots": "new", "save_slots": "save", "save_offsets": "save"}


def _views(buffer: torch.Tensor, fields: list[_Field]) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for f in fields:
        itemsize = torch.empty((), dtype=f.dtype).element_size()
        numel = 1
        for d in f.shape:
            numel *= d
        views[f.name] = buffer[offset: offset + numel * itemsize].view(f.dtype).view(f.shape)
        offset += numel * itemsize
    return views


def _group(views: dict[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """One 2-D view over fields that lie back to back in the buffer."""
    first = views[names[0]]
    step = first.numel()
    for i, name in enumerate(names):
        if views[name].data_ptr() != first.data_ptr() + i * step * first.element_size():
            raise RuntimeError(f"step buffer layout: field {name!r} does not follow {names[i - 1]!r}")
    return first.as_strided((len(names), step), (step, 1))


def _layout_bytes(fields: list[_Field]) -> int:
    total = 0
    for f in fields:
        numel = 1
        for d in f.shape:
            numel *= d
        total += numel * torch.empty((), dtype=f.dtype).element_size()
    return total


class StepBuffer:
    """Pinned host buffers + one device buffer, all with identical typed views.

    `host[name]` is written by the CPU bookkeeping; `device[name]` is what kernels read.
    The host side is double-buffered: with launch-ahead, step N+2 is written while step
    N+1's asynchronous copy may not have run yet, so consecutive steps use alternate host
    buffers (and a buffer is reused only after its previous copy finished). The device
    buffer is single: copies and kernels run in stream order. `num_syncs` counts
    host-to-device copies (the one-copy-per-step invariant is tested).
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, max_new_slots: int,
                 device: torch.device, max_width: int = 1, max_saves: int = 0, mask_bytes: int = 1):
        self.max_tokens, self.max_seqs, self.max_blocks_per_seq = max_tokens, max_seqs, max_blocks_per_seq
        fields = _fields(max_tokens, max_seqs, max_blocks_per_seq, max_new_slots, max_width, max_saves, mask_bytes)
        nbytes = _layout_bytes(fields)
        self._mask_row_bytes = mask_bytes
        self._masks_offset = nbytes - max_seqs * mask_bytes
        pin = device.type == "cuda"
        self._host_bytes = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_views = [_views(b, fields) for b in self._host_bytes]
        # Per field, in layout order: name, byte offset, bytes per leading row (a block-table
        # row: all its blocks), bytes between verify_dst's rows (`pack`).
        base = self._host_bytes[0].data_ptr()
        self._field_rows = [(name, v.data_ptr() - base,
                             v.element_size() * (v.shape[1] if v.dim() == 2 and name != "verify_dst" else 1),
                             v.element_size() * v.shape[-1]) for name, v in self._host_views[0].items()]
        self._ranges_cache: dict[StepExtent, list[tuple[int, int]]] = {}
        # NumPy views of the same host bytes: the bookkeeping writes through these, because
        # a small-array write costs ~0.5 us in NumPy against ~3 us through torch indexing.
        self._host_np = [{name: v.numpy() for name, v in views.items()} for views in self._host_views]
        self._host_groups = [{g: _group(views, names).numpy() for g, names in GROUPS.items()}
                             for views in self._host_views]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._current = 0
        self._device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # The stream the engine's steps run on, looked up once: `Event.record()` without a
        # stream looks it up on every call, a measurable share of a step's host time.
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.device = _views(self._device_bytes, fields)
        self.num_syncs = 0

    @property
    def host(self) -> dict[str, torch.Tensor]:
        """Views of the host buffer the next step is written into."""
        return self._host_views[self._current]

    @property
    def host_np(self) -> dict[str, np.ndarray]:
        """The same views as `host`, as NumPy arrays (what the bookkeeping writes through)."""
        return self._host_np[self._current]

    def host_group(self, name: str, index: int | None = None) -> np.ndarray:
        """2-D NumPy view `[fields, rows]` of a field group (`GROUPS`) in the current host
        buffer (or in host buffer `index`)."""
        return self._host_groups[self._current if index is None else index][name]

    @property
    def current_index(self) -> int:
        """Which of the two host buffers the next step is written into."""
        return self._current

    def _decode_rows(self, index: int, rows: int) -> list[np.ndarray]:
        """Views of every field a decode-only step of `rows` rows uses, in host buffer `index`."""
        groups, views = self._host_groups[index], self._host_np[index]
        return ([groups[name][:, :rows] for name in GROUPS]
                + [views[name][:rows] for name in ("seq_lens", "block_tables", "top_k", "prompt_token_mask")]
                + [views[name][:rows + 1] for name in ("cu_seqlens_q", "prefill_cu_seqlens")])

    def copy_rows_from(self, index: int, rows: int) -> None:
        """Copy a decode-only step's fields (sequences and tokens [0, rows)) from host
        buffer `index` into the current host buffer."""
        for dst, src in zip(self._decode_rows(self._current, rows), self._decode_rows(index, rows)):
            dst[...] = src

    def decode_rows_snapshot(self, rows: int) -> list[np.ndarray]:
        """A copy of what `copy_rows_from` covers, in the current host buffer (for checks)."""
        return [v.copy() for v in self._decode_rows(self._current, rows)]

    @property
    def nbytes(self) -> int:
        return self._device_bytes.numel()

    def _step_ranges(self, extent: StepExtent) -> list[tuple[int, int]]:
        """Byte ranges [start, stop) of the layout that a step of `extent` uses, in buffer
        order, adjacent ones merged (cached: consecutive steps mostly share an extent)."""
        ranges = self._ranges_cache.get(extent)
        if ranges is not None:
            return ranges
        leading = {"token": extent.tokens, "seq": extent.seqs, "cu": extent.seqs + 1, "new": extent.new_slots,
                   "save": extent.saves, "masks": extent.masks}
        ranges = []
        for name, offset, row_bytes, rows_apart in self._field_rows:
            if name == "verify_dst":  # [width, seqs], position-major: each position's rows
                parts = [(offset + j * rows_apart, extent.seqs * row_bytes) for j in range(extent.width)]
            else:
                parts = [(offset, leading[_EXTENT_OF[name]] * row_bytes)]
            for start, size in parts:
                if size and ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], start + size)
                elif size:
                    ranges.append((start, start + size))
        if len(self._ranges_cache) >= _RANGES_CACHE_SIZE:
            self._ranges_cache.clear()
        self._ranges_cache[extent] = ranges
        return ranges

    def pack(self, extent: StepExtent) -> np.ndarray:
        """The bytes of the current host buffer a step of `extent` uses, back to back."""
        data = self._host_bytes[self._current].numpy()
        return np.concatenate([data[start:stop] for start, stop in self._step_ranges(extent)])

    def unpack(self, extent: StepExtent, packed: np.ndarray, scramble_stale: bool = False) -> None:
        """Write what `pack` gave (another rank's same-layout buffer) into the current host
        buffer; the rows past the extent keep their stale bytes, which the step never reads.
        `scramble_stale` (a check for tests) overwrites those with junk first, so that a step
        that did read them would go wrong."""
        ranges = self._step_ranges(extent)
        needed = sum(stop - start for start, stop in ranges)
        if needed != len(packed):
            raise ValueError(f"step message of {len(packed)} bytes, the extent needs {needed}")
        data, at = self._host_bytes[self._current].numpy(), 0
        if scramble_stale:
            data[:] = STALE_JUNK
        for start, stop in ranges:
            data[start:stop] = packed[at:at + stop - start]
            at += stop - start

    def sync(self, mask_rows: int = 0) -> None:
        """Mirror the host buffer into the device buffer: the step's single H2D copy, which
        takes the first `mask_rows` rows of `grammar_masks` and none after them."""
        end = self._masks_offset + mask_rows * self._mask_row_bytes
        self._device_bytes[:end].copy_(self._host_bytes[self._current][:end], non_blocking=True)
        self.num_syncs += 1
        if self._device_bytes.is_cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            self._copied[self._current] = event
        self._current ^= 1
        pending = self._copied[self._current]
        if pending is not None:
            pending.synchronize()  # two steps old: long done in practice

"""Greedy sampling in one kernel: the LM head's output scaled, cast to float32 and reduced to
each row's argmax in one pass (torch runs the division, the cast and its argmax as three
kernels, the argmax alone 22 us for 32 rows of a 100k vocabulary on the H100).

Each program reduces one chunk of one row's vocabulary and stores the chunk's maximum and
its index; for each tile of ROW_TILE rows, the last program to arrive (an arrival counter
per tile, reset by that program) picks each of its rows' first chunk holding the maximum.
Maxima are compared as values, so the result is exact and deterministic: the first index
among equal maxima, a NaN the maximum, as torch.argmax decides.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from layers.kernels.reference.sampling import logits_argmax as reference_logits_argmax
from layers.kernels.triton.device import MAX_ARRIVAL_COUNTERS, arrival_counters, pdl, wait_for_previous_kernel

MAX_CHUNKS = 64  # per row: a tile's last program reduces [ROW_TILE, MAX_CHUNKS] maxima
MIN_BLOCK = 1024  # vocabulary entries per chunk, at least
ROW_TILE = 32
MAX_ROWS = ROW_TILE * MAX_ARRIVAL_COUNTERS  # one counter per row tile; more rows run the reference
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["rows"])  # the row count changes every step: no recompiles
def _logits_argmax_kernel(
    logits_ptr, partial_ptr, tokens_ptr, arrivals_ptr, rows, vocab, num_chunks, stride_row, inv_divisor,
    HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ROW_TILE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab, other=0.0)
    if HAS_DIVISOR:  # torch's division by a host scalar on the GPU: times its float32 reciprocal, rounded
        x = (x.to(tl.float32) * inv_divisor).to(logits_ptr.dtype.element_ty)
    x = tl.where(cols < vocab, x.to(tl.float32), float("-inf"))  # (after the scaling, whatever its sign)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, cols, vocab), axis=0)
    clean = tl.where(is_nan, float("-inf"), x)
    value = tl.where(first_nan < vocab, float("nan"), tl.max(clean, axis=0))
    index = tl.where(first_nan < vocab, first_nan, chunk * BLOCK + tl.argmax(clean, axis=0, tie_break_left=True))
    # One int32 buffer: the chunk maxima's float32 bits [rows, chunks], then their indices.
    slot = row * num_chunks + chunk
    tl.store(partial_ptr + slot, value.to(tl.int32, bitcast=True))
    tl.store(partial_ptr + rows * num_chunks + slot, index)
    tl.debug_barrier()  # every thread's stores are done before the arrival releases them
    tile = row // ROW_TILE
    tile_rows = tile * ROW_TILE + tl.arange(0, ROW_TILE)
    arrivals = tl.minimum(rows - tile * ROW_TILE, ROW_TILE) * num_chunks
    if tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") == arrivals - 1:
        chunks = tl.arange(0, CHUNKS)
        offsets = tile_rows[:, None] * num_chunks + chunks[None, :]
        mask = (tile_rows[:, None] < rows) & (chunks[None, :] < num_chunks)
        maxima = tl.load(partial_ptr + offsets, mask=mask, other=0, cache_modifier=".cg").to(tl.float32, bitcast=True)
        maxima = tl.where(mask, maxima, float("-inf"))
        nan = maxima != maxima
        nan_chunk = tl.min(tl.where(nan, chunks[None, :], CHUNKS), axis=1)  # holds the row's first NaN
        best = tl.argmax(tl.where(nan, float("-inf"), maxima), axis=1, tie_break_left=True)
        pick = tl.where(nan_chunk < CHUNKS, nan_chunk, best)
        indices = tl.load(partial_ptr + rows * num_chunks + offsets, mask=mask, other=0, cache_modifier=".cg")
        token = tl.sum(tl.where(chunks[None, :] == pick[:, None], indices, 0), axis=1)
        tl.store(tokens_ptr + tile_rows, token.to(tl.int64), mask=tile_rows < rows)
        tl.atomic_xchg(arrivals_ptr + tile, 0)  # ready for the next call


def logits_argmax(logits: torch.Tensor, divisor: float | None = None) -> torch.Tensor:
    """Per row, the argmax of `(logits / divisor).float()` (see `KernelOps.logits_argmax`) in
    one kernel for [rows, V] logits of a float dtype with unit column stride and up to
    MAX_ROWS rows; anything else runs the reference."""
    if (logits.dim() != 2 or logits.dtype not in _DTYPES or logits.stride(-1) != 1 or 0 in logits.shape
            or logits.shape[0] > MAX_ROWS):
        return reference_logits_argmax(logits, divisor)
    rows, vocab = logits.shape
    block = max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS)))
    num_chunks = triton.cdiv(vocab, block)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    partials = torch.empty(2 * rows * num_chunks, dtype=torch.int32, device=logits.device)
    # The reciprocal torch multiplies by: 1 / divisor, both in float32.
    inv_divisor = 1.0 if divisor is None else float(np.float32(1.0) / np.float32(divisor))
    _logits_argmax_kernel[(rows, num_chunks)](
        logits, partials, tokens, arrival_counters(logits.device), rows, vocab, num_chunks, logits.stride(0),
        inv_divisor, HAS_DIVISOR=divisor is not None, BLOCK=block, CHUNKS=triton.next_power_of_2(num_chunks),
        ROW_TILE=ROW_TILE, num_warps=4, **pdl(logits),
    )
    return tokens

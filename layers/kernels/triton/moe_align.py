"""Token-to-expert alignment for the fused MoE GEMMs: one Triton kernel that counting-sorts
a call's (token, slot) pairs into per-expert row segments, each padded to a multiple of the
GEMM's row tile (the idea of vLLM's `moe_align_block_size`).

Pair p = token * slots + slot. Slots [0, k) are the routed choices (`topk_ids`); slots
[k, k + shared_chunks) are the shared expert's chunks, pseudo-experts E, E+1, ... that
every token visits. Within an expert, rows follow the pair index, i.e. token order, so the
layout (and every result computed from it) is deterministic.

Everything stays on the device and every size is a static bound of (T, k, E, block_m):
at most min(P, P // block_m + experts) row blocks hold real rows (each block has at least
one; the padding adds under one block per expert). Blocks past the last real one get
expert -1 and the GEMMs skip them at once; padding rows are never written nor read.

The kernel runs cdiv(P, chunk) programs. Each counts every pair (the expert row starts
need all of them) and, in the same pass, the pairs before its own chunk; it then places
its chunk's pairs, `sub` at a time: row = start + pairs of the expert before this chunk +
earlier pairs of the expert in this chunk. Placing is a chain of dependent steps, so the
chunk is sized for about TARGET_PROGRAMS programs (at least MIN_CHUNK pairs each): many
short chains at decode, where one 1,024-pair chain took 30 us at 128 tokens (granite,
H100; 3.7 us in 32-pair chunks), and at most CHUNK pairs per program for a prefill, where
each extra program recounts every pair.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from layers.kernels.triton.device import pdl, wait_for_previous_kernel

CHUNK = 1024  # most pairs placed per program
MIN_CHUNK = 32  # fewest pairs placed per program
TARGET_PROGRAMS = 64  # the chunk is sized for about this many programs
COUNT_BLOCK = 2048  # pairs counted per histogram step (fewer when the call has fewer)


def chunk_sizes(num_pairs: int) -> tuple[int, int]:
    """(pairs placed per program, pairs placed per step: a sub x sub comparison finds each
    one's rank) for a call of `num_pairs` pairs. Steps of 16 suit the short chunks of a
    decode step, 32 the long ones of a prefill (measured on the H100)."""
    chunk = min(CHUNK, max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(num_pairs, TARGET_PROGRAMS))))
    return chunk, 16 if chunk <= 64 else 32


@dataclass(frozen=True)
class ExpertRows:
    """Sorted rows of one MoE call, all on the device."""

    pairs: torch.Tensor  # [max_blocks * block_m] int32: the pair at each row (padding rows: unwritten)
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each block of block_m rows, -1 if unused
    expert_end: torch.Tensor  # [experts] int32: one past each expert's last real row

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the row blocks that hold real rows (the GEMM grid's first axis)."""
    return min(num_pairs, num_pairs // block_m + num_experts)


@triton.jit
def pair_experts(ids_ptr, p, mask, num_routed, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """Expert of each pair p: the routed id for slots < TOP_K, else the shared chunk."""
    t = p // SLOTS
    s = p % SLOTS
    routed = s < TOP_K
    e = tl.load(ids_ptr + t * TOP_K + s, mask=mask & routed, other=0).to(tl.int32)
    return tl.where(routed, e, num_routed + s - TOP_K)


@triton.jit(do_not_specialize=["num_tokens", "max_blocks"])  # per-step sizes: no recompiles
def _align_kernel(
    ids_ptr, pairs_ptr, block_expert_ptr, expert_end_ptr, num_tokens, num_routed, max_blocks,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, COUNT_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    SLOTS: tl.constexpr = TOP_K + SHARED
    num_pairs = num_tokens * SLOTS
    num_experts = num_routed + SHARED
    bins = tl.arange(0, NB)
    chunk_start = pid * CHUNK

    counts = tl.zeros([NB], dtype=tl.int32)
    before = tl.zeros([NB], dtype=tl.int32)  # pairs of each expert ahead of this program's chunk
    for p0 in range(0, num_pairs, COUNT_BLOCK):
        p = p0 + tl.arange(0, COUNT_BLOCK)
        valid = p < num_pairs
        e = pair_experts(ids_ptr, p, valid, num_routed, TOP_K, SLOTS)
        counts += tl.histogram(e, NB, mask=valid)
        if p0 < chunk_start:
            before += tl.histogram(e, NB, mask=valid & (p < chunk_start))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    if pid == 0:
        tl.store(expert_end_ptr + bins, starts + counts, mask=bins < num_experts)

    # Expert of each row block: the number of experts whose blocks end at or before it.
    block_end = ends // BLOCK_M
    for b0 in range(pid * BLOCK_B, max_blocks, tl.num_programs(0) * BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(expert < num_experts, expert, -1), mask=b < max_blocks)

    running = starts + before
    lanes = tl.arange(0, SUB)
    for p0 in range(chunk_start, tl.minimum(chunk_start + CHUNK, num_pairs), SUB):
        p = p0 + lanes
        valid = p < num_pairs
        e = pair_experts(ids_ptr, p, valid, num_routed, TOP_K, SLOTS)
        earlier = (e[None, :] == e[:, None]) & (lanes[None, :] < lanes[:, None]) & valid[None, :]
        row = tl.gather(running, e, 0) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(pairs_ptr + row, p, mask=valid)
        running += tl.histogram(e, NB, mask=valid)


def align_pairs(topk_ids: torch.Tensor, num_routed: int, shared_chunks: int, block_m: int) -> ExpertRows:
    """Sort the (token, slot) pairs of `topk_ids` [T, k] (plus `shared_chunks` always-on
    pseudo-experts per token) into expert segments padded to `block_m` rows."""
    num_tokens, top_k = topk_ids.shape
    num_experts = num_routed + shared_chunks
    num_pairs = num_tokens * (top_k + shared_chunks)
    blocks = max_row_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    rows = ExpertRows(pairs=torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                      block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
                      expert_end=torch.empty(num_experts, dtype=torch.int32, device=device))
    if num_pairs == 0:
        return rows
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    nb = triton.next_power_of_2(num_experts)
    chunk, sub = chunk_sizes(num_pairs)
    count_block = min(COUNT_BLOCK, triton.next_power_of_2(max(num_pairs, sub)))
    _align_kernel[(triton.cdiv(num_pairs, chunk),)](
        ids, rows.pairs, rows.block_expert, rows.expert_end, num_tokens, num_routed, blocks,
        TOP_K=top_k, SHARED=shared_chunks, BLOCK_M=block_m, NB=nb, CHUNK=chunk, SUB=sub, COUNT_BLOCK=count_block,
        BLOCK_B=max(16, min(64, 4096 // nb)), num_warps=4, **pdl(ids),
    )
    return rows

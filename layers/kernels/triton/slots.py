"""Helpers shared by the Mamba state kernels: token -> sequence lookup and the final
state scatter into the slot pool."""
import torch
import triton
import triton.language as tl


def token_to_seq(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence index of every packed token ([num_tokens] int64, on the device, no host sync).

    Tokens past `cu_seqlens[-1]` (padding) get index S, one past the last sequence.
    """
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True)


@triton.jit
def _scatter_slots_kernel(rows_ptr, pool_ptr, src_slots_ptr, dst_slots_ptr, row_numel, BLOCK: tl.constexpr):
    seq = tl.program_id(0)
    src = tl.load(src_slots_ptr + seq)
    dst = tl.load(dst_slots_ptr + seq)
    if (src < 0) | (dst < 0):
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    values = tl.load(rows_ptr + seq.to(tl.int64) * row_numel + offs, mask=mask)
    tl.store(pool_ptr + dst.to(tl.int64) * row_numel + offs, values.to(pool_ptr.dtype.element_ty), mask=mask)


def scatter_slots(pool: torch.Tensor, rows: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """pool[dst_slots[s]] = rows[s] for every sequence whose src and dst slots are >= 0.

    A separate launch after the kernels that read `pool[src_slots]`: one kernel that both
    read and wrote slots would race when a sequence's dst is another sequence's src.
    """
    if rows.shape[0] == 0:
        return
    if not pool[0].is_contiguous() or pool.stride(0) != pool[0].numel():
        raise ValueError("state pool slots must be contiguous rows")
    rows = rows.contiguous()
    row_numel = rows[0].numel()
    block = 1024
    grid = (rows.shape[0], triton.cdiv(row_numel, block))
    _scatter_slots_kernel[grid](rows, pool, src_slots, dst_slots, row_numel, BLOCK=block)

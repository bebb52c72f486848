"""MoE expert compute by sorted token dispatch + grouped GEMM (no host sync, static shapes).

The T*k (token, expert) pairs are sorted by expert; each expert's rows then form one
contiguous group, and two grouped GEMMs (up + activation, down) run over all groups at
once. bf16 on Hopper uses `torch._grouped_mm` (CUTLASS, int32 group end offsets);
everything else (float32, other GPUs, unaligned sizes) uses the Triton grouped GEMM below,
whose grid is sized by the static bound cdiv(T*k, BM) + E tiles. Results are un-sorted
with one index_copy and summed over k in float32, so the output is deterministic.
Routing stays with the reference ops: they are plain sync-free torch already.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_ACTIVATIONS = {"relu2": 1, "swiglu": 2}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr,
    n_out, k_dim, stride_am, stride_we, stride_wn, stride_wk, stride_om,
    GATHER: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # One (row tile of one expert, column tile): out[rows] = act(A[rows] @ W[e]^T).
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return  # tiles past the real tile count (the grid is a static upper bound)
    row0 = tl.load(tile_row_ptr + tile)
    rows = row0 + tl.arange(0, BM)
    r_in = rows < tl.load(expert_end_ptr + expert)
    a_rows = tl.load(a_rows_ptr + rows, mask=r_in, other=0) if GATHER else rows
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_in = cols < n_out
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if ACT == 2:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_dim, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < k_dim
        a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + kk[None, :],
                    mask=r_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=c_in[None, :] & k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if ACT == 2:  # SwiGLU: gate rows [0, I), up rows [I, 2I) of the same weight
            w_up = tl.load(w_base + (cols + n_out)[None, :] * stride_wn + kk[:, None] * stride_wk,
                           mask=c_in[None, :] & k_in[:, None], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    # The reference rounds the projection to the activation dtype before the activation.
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    elif ACT == 2:
        acc_up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_in[:, None] & c_in[None, :])


def gemm_tiles(dtype: torch.dtype, act: int, num_rows: int) -> tuple[int, int, int]:
    """(BM, BN, BK) of the Triton grouped GEMM.

    Decode-sized batches stream expert weights, where 64x64 tiles measured best on an H100;
    prefill-sized ones take 128-row tiles, 128 columns wide (SwiGLU keeps two accumulators,
    so half as wide). float32 tiles are twice the bytes, so smaller.
    """
    if dtype == torch.float32:
        return 32, 32, 32
    if num_rows <= 2048:
        return 64, 64, 64
    return 128, (64 if act == 2 else 128), 64


def _grouped_gemm_triton(
    a: torch.Tensor, a_rows: torch.Tensor | None, w: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor,
    num_rows: int, act: int, out_cols: int,
) -> torch.Tensor:
    """out[r] = act(a[a_rows[r]] @ w[e(r)]^T) for sorted rows r grouped by expert (ends: group ends)."""
    num_experts = w.shape[0]
    bm, bn, bk = gemm_tiles(a.dtype, act, num_rows)
    # Tile map on the device: tile i belongs to the expert whose cumulative tile count
    # first exceeds i; tiles past the total get expert -1.
    tiles = (counts + bm - 1) // bm
    tile_ends = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(num_rows, bm) + num_experts
    tile_ids = torch.arange(max_tiles, device=a.device, dtype=tile_ends.dtype)
    expert = torch.searchsorted(tile_ends, tile_ids, right=True)
    e = expert.clamp(max=num_experts - 1)
    tile_row = (ends - counts)[e] + (tile_ids - (tile_ends - tiles)[e]) * bm
    tile_expert = torch.where(expert < num_experts, expert, -1)
    out = torch.empty((num_rows, out_cols), dtype=a.dtype, device=a.device)
    _grouped_gemm_kernel[(max_tiles, triton.cdiv(out_cols, bn))](
        a, a_rows if a_rows is not None else tile_row, w, out, tile_expert, tile_row, ends,
        out_cols, a.shape[1], a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        GATHER=a_rows is not None, ACT=act, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=3,
    )
    return out


def _use_torch_grouped_mm(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """torch._grouped_mm's fast kernel: bf16, Hopper (sm90), 16-byte aligned rows."""
    if not (x.is_cuda and x.dtype == w_up.dtype == w_down.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return all(size % 8 == 0 for size in (*w_up.shape[1:], *w_down.shape[1:]))


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu2":
        return torch.square(F.relu(h))
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_experts(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Weighted sum of each token's chosen experts: sum_k w_k * down_e(act(up_e(x))).

    x: [T, H]; w_up: [E, I or 2I (swiglu: gate then up), H]; w_down: [E, H, I];
    topk_weights / topk_ids: [T, k]. No host sync, shapes depend only on T, k, E (CUDA-graph
    capturable); experts with no tokens cost nothing. Picks torch._grouped_mm where it is fast.
    """
    return moe_experts_grouped(x, w_up, w_down, topk_weights, topk_ids, activation,
                               _use_torch_grouped_mm(x, w_up, w_down))


def moe_experts_grouped(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    torch_grouped_mm: bool,
) -> torch.Tensor:
    """`moe_experts` with the grouped GEMM backend named (tests and benchmarks run both):
    torch._grouped_mm when `torch_grouped_mm`, else the Triton grouped GEMM."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported expert activation: {activation!r}")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    if num_rows == 0:
        return torch.zeros_like(x)
    num_experts = w_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # sorted row -> flat (token, k) index
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    row_token = order // top_k
    if torch_grouped_mm:
        h = torch._grouped_mm(x.index_select(0, row_token), w_up.transpose(1, 2), offs=ends)
        h = _activation(h, activation)
        y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    else:
        x = x if x.stride(1) == 1 else x.contiguous()
        inter = w_down.shape[2]
        h = _grouped_gemm_triton(x, row_token, w_up, counts, ends, num_rows, _ACTIVATIONS[activation], inter)
        y = _grouped_gemm_triton(h, None, w_down, counts, ends, num_rows, 0, hidden)
    weighted = y.float() * topk_weights.reshape(-1)[order, None].float()
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)

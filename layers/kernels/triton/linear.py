"""Linear projections of a few rows (decode) over wide weights, in one Triton pass.

A decode step multiplies 1 to 16 activation rows by each weight matrix, so it is bound by
reading the weights. Here a program owns BLOCK_N = 64 output columns for all rows and
streams its [64, K] slab of the weight once, 256 columns of K at a time; the rows are
padded to the 16-row tensor-core tile, which costs nothing when the weights are the
traffic. Only wide matrices take this kernel -- at least two 64-column programs per SM
(on the H100, N > 16,832: the LM heads, nemotron-h-8b's Mamba in_proj and MLP up) -- where
`scripts/bench_kernels.py --linear` measured it 3-9% faster than cuBLAS (1-2% slower on
the peer's 32k-row LM head, the narrowest of them; docs/kernels.md). Narrower matrices,
larger row counts, float32 and anything unusual go to `F.linear`.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from layers.kernels.triton.device import pdl, sm_count, wait_for_previous_kernel

MAX_ROWS = 16  # one 16-row tensor-core tile; at 32 rows cuBLAS was as fast or faster on most shapes
BLOCK_N, BLOCK_K = 64, 256
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: no recompiles
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # (a vocabulary x hidden weight can pass 2^31 elements)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` runs the skinny kernel: 1 to MAX_ROWS rows of bf16/fp16 activations
    whose width is the weight's K, a row-major weight of their dtype with at least two
    BLOCK_N-column programs per SM, and no bias or a contiguous [N] one of their dtype
    (anything else, errors included, is `F.linear`'s)."""
    if weight.dim() != 2 or x.dim() == 0 or not 0 < x.numel() <= MAX_ROWS * x.shape[-1]:
        return False  # (first: a prompt step's many rows are turned away at once)
    n, k = weight.shape
    bias_ok = bias is None or (bias.dtype == x.dtype and bias.shape == (n,) and bias.stride(0) == 1)
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and x.shape[-1] == k and weight.stride(-1) == 1
            and bias_ok and triton.cdiv(n, BLOCK_N) >= 2 * sm_count(weight.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (see `KernelOps.linear`): the skinny kernel where
    `takes_kernel`, else `F.linear`."""
    if not takes_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n, k = weight.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        flat, weight, bias if bias is not None else weight, out, rows, n, k,
        flat.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, max(64, triton.next_power_of_2(k))),
        num_warps=4, num_stages=4, **pdl(flat),
    )
    return out.view(*x.shape[:-1], n)

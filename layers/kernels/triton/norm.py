"""RMSNorm and the Mamba-2 gated group RMSNorm (own Triton kernels, one row-group per program).

Rounding follows `layers.kernels.reference.norm` step for step (float32 statistics, the
normalized value cast to the input dtype before the weight multiply where the reference
does so), so results match the reference to the last bit in most elements.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, group_size, eps, stride_xt, stride_zt, stride_yt, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    z = tl.load(z_ptr + t * stride_zt + cols, mask=mask, other=0.0).to(tl.float32)
    h = x.to(tl.float32) * z * tl.sigmoid(z)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)  # the reference casts before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """Mamba-2 output norm: y = rmsnorm_per_group(x * silu(z)) * weight (norm after gating).

    x, z: [T, D] (any row stride); weight: [D]. Output dtype follows torch promotion of
    weight and x, as in the reference.
    """
    num_tokens, dim = x.shape
    out = torch.empty((num_tokens, dim), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    z = z if z.stride(1) == 1 else z.contiguous()
    block = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(num_tokens, dim // group_size)](
        x, z, weight, out, group_size, eps, x.stride(0), z.stride(0), out.stride(0),
        BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, dim, eps, stride_xt, stride_yt, WEIGHT_IN_FP32: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not WEIGHT_IN_FP32:
        h = h.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim with float32 statistics.

    `weight_in_fp32`: multiply by the weight in float32 and cast to x's dtype (NemotronH),
    or cast first and multiply in torch's promoted dtype (Granite), as in the reference.
    """
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, dim, eps, rows.stride(0), out.stride(0),
            WEIGHT_IN_FP32=weight_in_fp32, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out.view(*x.shape[:-1], dim)

"""RMSNorm, RMSNorm fused with the residual add before it, and the Mamba-2 gated group
RMSNorm (own Triton kernels, one row or group per program).

Rounding follows `layers.kernels.reference.norm` step for step (float32 statistics, the
normalized value cast to the input dtype before the weight multiply where the reference
does so), so results match the reference to the last bit in most elements.
"""
import torch
import triton
import triton.language as tl

from layers.kernels.reference.norm import check_add_inputs
from layers.kernels.triton.device import pdl, wait_for_previous_kernel


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, group_size, eps, stride_xt, stride_zt, stride_yt, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
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
        BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl(x),
    )
    return out


@triton.jit
def _normalize_store(h, x_dtype: tl.constexpr, w_ptr, y_ptr, cols, mask, dim, eps, WEIGHT_IN_FP32: tl.constexpr):
    """Normalize the float32 row h (masked lanes 0) and store weight * h in y's dtype."""
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not WEIGHT_IN_FP32:
        h = h.to(x_dtype).to(tl.float32)
    tl.store(y_ptr + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, dim, eps, stride_xt, stride_yt, WEIGHT_IN_FP32: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    _normalize_store(x.to(tl.float32), x.dtype, w_ptr, y_ptr + t * stride_yt, cols, mask, dim, eps, WEIGHT_IN_FP32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, new_r_ptr, dim, eps, scale, stride_xt, stride_rt, stride_yt, stride_nt,
    HAS_SCALE: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + t * stride_rt + cols, mask=mask, other=0.0)
    if HAS_SCALE:  # torch rounds x * scale to x's dtype before the add
        x = (x.to(tl.float32) * scale).to(x.dtype)
    s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(new_r_ptr + t * stride_nt + cols, s, mask=mask)
    _normalize_store(s.to(tl.float32), x.dtype, w_ptr, y_ptr + t * stride_yt, cols, mask, dim, eps, WEIGHT_IN_FP32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, dim] with unit column stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(kernel, rows: torch.Tensor, *args, **constexprs) -> None:
    """One program per row; no FMA contraction, so the residual add rounds as torch's
    separate mul and add do, and both kernels compute the norm with the same arithmetic."""
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        kernel[(rows.shape[0],)](*args, BLOCK=block, num_warps=min(16, max(1, block // 256)),
                                 enable_fp_fusion=False, **constexprs, **pdl(rows))


def _norm_output(rows: torch.Tensor, weight: torch.Tensor, weight_in_fp32: bool) -> torch.Tensor:
    """The normed rows' buffer, in the reference's output dtype."""
    out_dtype = rows.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, rows.dtype)
    return torch.empty(rows.shape, dtype=out_dtype, device=rows.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim with float32 statistics.

    `weight_in_fp32`: multiply by the weight in float32 and cast to x's dtype (NemotronH),
    or cast first and multiply in torch's promoted dtype (Granite), as in the reference.
    """
    rows = _rows(x)
    out = _norm_output(rows, weight, weight_in_fp32)
    _launch(_rms_norm_kernel, rows, rows, weight, out, rows.shape[1], eps, rows.stride(0), out.stride(0),
            WEIGHT_IN_FP32=weight_in_fp32)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_in_fp32: bool = True,
                 residual_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(new_residual), new_residual), new_residual = residual + x * residual_scale, in
    one kernel: x and residual read once, the new residual and the normed rows written.

    Rounding as the reference: x * residual_scale rounded to x's dtype, then the sum.
    residual None: x starts the residual stream (new_residual is x itself, only the norm runs).
    """
    check_add_inputs(x, residual, residual_scale)
    if residual is None:
        return rms_norm(x, weight, eps, weight_in_fp32), x
    rows, res_rows = _rows(x), _rows(residual)
    out = _norm_output(rows, weight, weight_in_fp32)
    new_residual = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(_add_rms_norm_kernel, rows, rows, res_rows, weight, out, new_residual, rows.shape[1], eps,
            1.0 if residual_scale is None else residual_scale, rows.stride(0), res_rows.stride(0), out.stride(0),
            new_residual.stride(0), HAS_SCALE=residual_scale is not None, WEIGHT_IN_FP32=weight_in_fp32)
    return out.view(x.shape), new_residual.view(x.shape)

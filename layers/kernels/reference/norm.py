"""RMSNorm and the gated group RMSNorm of the Mamba-2 mixer (reference)."""
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32.

    `weight_in_fp32` selects where the weight multiply happens: NemotronH multiplies in
    float32 and casts the result, Granite casts first and multiplies in the input dtype.
    The two differ only below float32, but parity with each model's reference needs both.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * h).to(dtype)
    return weight * h.to(dtype)


def check_add_inputs(x: torch.Tensor, residual: torch.Tensor | None, residual_scale: float | None) -> None:
    """Raise ValueError unless `add_rms_norm` can add x to residual (shared by both op sets)."""
    if residual is None:
        if residual_scale is not None:
            raise ValueError("add_rms_norm: residual_scale scales x before its add, but residual is None")
    elif residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_in_fp32: bool = True,
                 residual_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(new_residual), new_residual), new_residual = residual + x * residual_scale.

    Exactly the unfused ops `h = residual + x * residual_scale; rms_norm(h)` in their order,
    so results are bitwise theirs. residual None: x starts the residual stream.
    """
    check_add_inputs(x, residual, residual_scale)
    if residual is None:
        new_residual = x
    else:
        new_residual = residual + (x if residual_scale is None else x * residual_scale)
    return rms_norm(new_residual, weight, eps, weight_in_fp32), new_residual


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """Mamba-2 output norm: y = rmsnorm_per_group(x * silu(z)) * weight (norm after gating).

    x, z: [T, D]; weight: [D]; the RMS statistic is taken over groups of `group_size`
    channels (D / n_groups), as in mamba-ssm's RMSNormGated(norm_before_gate=False).
    """
    dtype = x.dtype
    h = x.float() * F.silu(z.float())
    shape = h.shape
    h = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(shape).to(dtype)

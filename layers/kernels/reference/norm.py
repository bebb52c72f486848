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

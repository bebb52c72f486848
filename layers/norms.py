"""RMSNorm module, and the Mamba gated norm of a group split over tensor-parallel ranks (the
whole-group case is the op `KernelOps.gated_rms_norm`, which the mixer calls)."""
import torch
import torch.nn.functional as F
from torch import nn

from layers.kernels.ops import KernelOps
from layers.parallel import ParallelContext


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale, fused with the residual add before it (one kernel per
    norm on the GPU); see `KernelOps.rms_norm` for the `weight_in_fp32` choice."""

    def __init__(self, hidden_size: int, eps: float, *, ops: KernelOps, weight_in_fp32: bool = True):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                residual_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x * residual_scale), residual + x * residual_scale); residual None:
        x starts the residual stream. See `KernelOps.add_rms_norm`."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.weight_in_fp32, residual_scale)


def gated_rms_norm_across_ranks(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                                group: int, n_groups: int, tp: ParallelContext) -> torch.Tensor:
    """The Mamba-2 gated norm (`KernelOps.gated_rms_norm`) of this rank's channels x, z
    ([T, D_local], weight [D_local]) when they are part of group `group` of `group_size`
    channels spread over several ranks: the statistic's sum of squares is summed over the
    ranks (a [T, n_groups] float32 tensor in which each rank fills its group's column).
    Float32 math, the result rounded to x's dtype before the weight multiply, as the op."""
    h = x.float() * F.silu(z.float())
    sums = h.new_zeros(h.shape[0], n_groups)
    sums[:, group] = h.pow(2).sum(-1)
    tp.all_reduce(sums)
    h = h * torch.rsqrt(sums[:, group, None] / group_size + eps)
    return weight * h.to(x.dtype)

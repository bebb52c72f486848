"""RMSNorm module (the Mamba gated norm lives inside the mixer)."""
import torch
from torch import nn

from layers.kernels.ops import KernelOps


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

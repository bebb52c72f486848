"""Dense projections (torch reference)."""
import torch
import torch.nn.functional as F

from layers.kernels.reference.activation import relu_square
from layers.kernels.reference.norm import gated_rms_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (see `KernelOps.linear`)."""
    return F.linear(x, weight, bias)


def linear_relu_square(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(x @ weight^T (+ bias))^2 (see `KernelOps.linear_relu_square`)."""
    return relu_square(linear(x, weight, bias))


def gated_norm_linear(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, group_size: int,
                      weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(gated_rms_norm(...) in x's dtype, weight, bias) (see `KernelOps.gated_norm_linear`)."""
    return linear(gated_rms_norm(x, z, norm_weight, eps, group_size).to(x.dtype), weight, bias)

"""Dense projections (torch reference)."""
import torch
import torch.nn.functional as F

from layers.kernels.reference.activation import relu_square


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (see `KernelOps.linear`)."""
    return F.linear(x, weight, bias)


def linear_relu_square(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(x @ weight^T (+ bias))^2 (see `KernelOps.linear_relu_square`)."""
    return relu_square(linear(x, weight, bias))

"""Dense projections (torch reference)."""
import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (see `KernelOps.linear`)."""
    return F.linear(x, weight, bias)

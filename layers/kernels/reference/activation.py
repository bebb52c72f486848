"""Elementwise activations applied to a projection's output (torch reference)."""
import torch
import torch.nn.functional as F


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 written over x (see `KernelOps.relu_square`)."""
    return F.relu_(x).square_()

"""Elementwise activations applied to a projection's output (torch reference)."""
import torch
import torch.nn.functional as F


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 written over x (squared in float32, rounded once): NemotronH's MLP
    activation, as `linear_relu_square` and the relu2 experts apply it."""
    return F.relu_(x).square_()

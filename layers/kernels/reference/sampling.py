"""Greedy sampling from the LM head's output (torch reference)."""
import torch


def logits_argmax(logits: torch.Tensor, divisor: float | None = None) -> torch.Tensor:
    """argmax of `(logits / divisor).float()` per row (see `KernelOps.logits_argmax`)."""
    scaled = logits if divisor is None else logits / divisor
    return scaled.float().argmax(dim=-1)

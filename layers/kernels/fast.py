"""Fast GPU ops (Triton). Each family is offered only when its implementation imports;
anything not offered here runs the reference op."""
from typing import Callable


def available_ops() -> dict[str, Callable]:
    """Op family name -> fast implementation, for the families available on this machine."""
    return {}

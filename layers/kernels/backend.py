"""Op sets: `OpSet` (one named implementation of every `KernelOps` op) and `select_ops`.

There is no process-wide backend: the engine chooses an op set for its device and passes it
to the model it builds, and every layer that calls kernels keeps the one it was built with,
so two engines in one process never change each other's ops.

On CPU the torch reference ops run; on CUDA the fast Triton ops run where available (each
op family falls back to the reference on its own if its module does not import). Set
`HYBRID_ENGINE_KERNELS=reference` to force the reference on GPU (debugging, A/B tests);
the variable is read each time an op set is chosen.
"""
import logging
import os
from collections.abc import Callable, Mapping

import torch

from layers.kernels import reference
from layers.kernels.ops import OP_NAMES, KernelOps

logger = logging.getLogger(__name__)

KERNELS_ENV = "HYBRID_ENGINE_KERNELS"
KERNELS_CHOICES = ("auto", "fast", "reference")


class OpSet(KernelOps):
    """A named, complete and immutable set of op implementations.

    Each op is an instance attribute holding its implementation, so a layer's call
    `self.ops.rms_norm(...)` is one attribute lookup; the protocol's methods only define
    the signatures.
    """

    def __init__(self, name: str, implementations: Mapping[str, Callable]):
        missing = [op for op in OP_NAMES if op not in implementations]
        unknown = sorted(set(implementations) - set(OP_NAMES))
        if missing or unknown:
            raise ValueError(f"op set {name!r}: missing ops {missing}, unknown ops {unknown}")
        object.__setattr__(self, "name", name)
        for op in OP_NAMES:
            object.__setattr__(self, op, implementations[op])

    def __setattr__(self, attr: str, value: object) -> None:
        raise AttributeError("an OpSet is immutable: build a new one with `with_ops`")

    def implementations(self) -> dict[str, Callable]:
        """Op name -> implementation."""
        return {op: getattr(self, op) for op in OP_NAMES}

    def with_ops(self, name: str, overrides: Mapping[str, Callable]) -> "OpSet":
        """A new op set named `name`: these ops replaced, the others kept."""
        return OpSet(name, {**self.implementations(), **overrides})

    def describe(self) -> dict[str, str]:
        """Op name -> module that implements it (for the start-up log line)."""
        return {op: impl.__module__ for op, impl in self.implementations().items()}

    def __repr__(self) -> str:
        return f"OpSet({self.name!r})"


REFERENCE_OPS = OpSet("reference", {op: getattr(reference, op) for op in OP_NAMES})


def select_ops(device: torch.device | str) -> OpSet:
    """The op set for `device` (reads `HYBRID_ENGINE_KERNELS` now); changes no state."""
    device = torch.device(device)
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in KERNELS_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {KERNELS_CHOICES}, got {choice!r}")
    selected = REFERENCE_OPS
    if device.type == "cuda" and choice != "reference":
        from layers.kernels import fast

        selected = REFERENCE_OPS.with_ops("fast", fast.available_ops())
    logger.info("kernel ops for %s: %s", device, selected.describe())
    return selected

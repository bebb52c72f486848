"""Kernels behind the layers: the op contract (`KernelOps`), the torch reference ops (the
oracle), the fast GPU ops, and `select_ops`, which picks an op set for a device."""
from layers.kernels.backend import KERNELS_ENV, REFERENCE_OPS, OpSet, select_ops
from layers.kernels.ops import OP_NAMES, KernelOps

__all__ = ["KERNELS_ENV", "OP_NAMES", "REFERENCE_OPS", "KernelOps", "OpSet", "select_ops"]

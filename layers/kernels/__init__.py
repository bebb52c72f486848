"""Kernels behind the layers: torch reference ops (the oracle) and fast GPU paths."""
from layers.kernels.backend import KERNELS_ENV, REFERENCE_OPS, OpSet, ops, select_backend

__all__ = ["KERNELS_ENV", "REFERENCE_OPS", "OpSet", "ops", "select_backend"]

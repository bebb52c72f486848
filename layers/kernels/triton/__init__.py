"""Triton implementations of the op families in `layers.kernels.reference` (one file per family).

Each module exposes functions with exactly the signatures of `layers.kernels.ops.KernelOps`;
`layers.kernels.fast` imports them family by family so a missing optional library only
disables its own family.
"""

"""Triton implementations of the op families in `layers.kernels.reference` (one file per family).

Each module exposes functions with exactly the reference op's signature; `layers.kernels.fast`
imports them family by family so a missing optional library only disables its own family.
"""

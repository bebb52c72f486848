"""Kernel backend selection: one `OpSet` of callables shared by every layer.

On CPU the torch reference ops run; on CUDA the fast Triton ops run where available (each
op family falls back to the reference on its own if its library is missing). Set
`HYBRID_ENGINE_KERNELS=reference` to force the reference on GPU (debugging, A/B tests).
"""
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from layers.kernels import reference

logger = logging.getLogger(__name__)

KERNELS_ENV = "HYBRID_ENGINE_KERNELS"


@dataclass(frozen=True)
class OpSet:
    """The op families the layers call; each entry has its reference op's signature."""

    rms_norm: Callable
    gated_rms_norm: Callable
    causal_conv1d_varlen: Callable
    causal_conv1d_update: Callable
    ssd_chunk_scan_varlen: Callable
    ssm_state_update: Callable
    write_kv_cache: Callable
    paged_attention: Callable
    route_sigmoid_grouped: Callable
    route_softmax_topk: Callable
    moe_experts: Callable
    name: str = "reference"

    def describe(self) -> dict[str, str]:
        """Op family -> module that implements it (for the start-up log line)."""
        return {f.name: getattr(self, f.name).__module__ for f in fields(self) if f.name != "name"}


REFERENCE_OPS = OpSet(**{name: getattr(reference, name) for name in reference.__all__})

_active: OpSet = REFERENCE_OPS


def ops() -> OpSet:
    """The op set selected for this process (reference until `select_backend` chooses)."""
    return _active


def select_backend(device: torch.device | str) -> OpSet:
    """Choose and activate the op set for `device`; logs once which backend each op uses."""
    global _active
    device = torch.device(device)
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "reference", "fast"):
        raise ValueError(f"{KERNELS_ENV} must be 'auto', 'fast' or 'reference', got {choice!r}")
    selected = REFERENCE_OPS
    if device.type == "cuda" and choice != "reference":
        from layers.kernels import fast

        selected = replace(REFERENCE_OPS, **fast.available_ops(), name="fast")
    if selected is not _active:
        logger.info("kernel backend for %s: %s", device, selected.describe())
    _active = selected
    return selected

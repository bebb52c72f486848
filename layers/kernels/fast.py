"""Fast GPU ops (Triton). Each family is offered only when its implementation imports;
anything not offered here runs the reference op."""
import importlib
from typing import Callable

# Module under layers.kernels.triton -> the ops it implements. A family whose module fails
# to import (Triton missing) keeps the reference ops, the others stay fast.
FAMILIES: dict[str, tuple[str, ...]] = {
    "norm": ("rms_norm", "add_rms_norm", "gated_rms_norm"),
    "linear": ("linear", "linear_conv_update", "linear_relu_square", "linear_write_kv"),
    "conv1d": ("causal_conv1d_varlen", "causal_conv1d_update", "causal_conv1d_verify"),
    "ssd": ("ssd_chunk_scan_varlen",),
    "ssm_update": ("ssm_state_update", "ssm_state_verify"),
    "attention": ("write_kv_cache", "paged_attention"),
    "moe_routing": ("route_sigmoid_grouped", "route_softmax_topk"),
    "moe": ("moe_experts",),
    "sampling": ("logits_argmax",),
}


def available_ops() -> dict[str, Callable]:
    """Op name -> fast implementation, for the families available on this machine."""
    found: dict[str, Callable] = {}
    for module_name, op_names in FAMILIES.items():
        try:
            module = importlib.import_module(f"layers.kernels.triton.{module_name}")
        except ImportError:
            continue
        found.update({name: getattr(module, name) for name in op_names})
    return found

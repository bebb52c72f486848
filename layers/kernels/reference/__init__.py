"""Plain-torch reference ops (CPU and GPU): the oracle every fast kernel is tested against.

This module implements every op of `layers.kernels.ops.KernelOps` with its exact signature."""
from layers.kernels.reference.attention import linear_write_kv, paged_attention, write_kv_cache
from layers.kernels.reference.conv1d import (causal_conv1d_update, causal_conv1d_varlen, causal_conv1d_verify,
                                             linear_conv_update)
from layers.kernels.reference.linear import linear, linear_relu_square
from layers.kernels.reference.moe import moe_experts, route_sigmoid_grouped, route_softmax_topk
from layers.kernels.reference.norm import add_rms_norm, gated_rms_norm, rms_norm
from layers.kernels.reference.sampling import logits_argmax
from layers.kernels.reference.ssd import ssd_chunk_scan_varlen, ssm_state_update, ssm_state_verify

__all__ = [
    "add_rms_norm",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "causal_conv1d_verify",
    "gated_rms_norm",
    "linear",
    "linear_conv_update",
    "linear_relu_square",
    "linear_write_kv",
    "logits_argmax",
    "moe_experts",
    "paged_attention",
    "rms_norm",
    "route_sigmoid_grouped",
    "route_softmax_topk",
    "ssd_chunk_scan_varlen",
    "ssm_state_update",
    "ssm_state_verify",
    "write_kv_cache",
]

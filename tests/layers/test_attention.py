"""The attention layer's stacked q/k/v projection: the checkpoint's q_proj / k_proj / v_proj
parameters stay views into the stack through loading and module conversions, so what is
written into them is what the layer's one projection reads."""
import pytest
import torch

from layers.attention import PagedAttention
from layers.kernels import REFERENCE_OPS

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8


def make_attention(bias: bool) -> PagedAttention:
    return PagedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, bias=bias, ops=REFERENCE_OPS)


def assert_stacked(layer: PagedAttention) -> None:
    """Each parameter is a view into its stack, and a write into it (as loading does) is
    read by the stacked projection."""
    for name in ("weight", "bias"):
        params = [getattr(p, name) for p in (layer.q_proj, layer.k_proj, layer.v_proj)]
        stack = getattr(layer, f"qkv_{name}")
        if params[0] is None:
            assert stack is None
            continue
        assert all(p.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr() for p in params)
        with torch.no_grad():
            params[1].copy_(torch.arange(params[1].numel(), dtype=params[1].dtype).view_as(params[1]))
        assert torch.equal(stack, torch.cat([p.detach() for p in params]))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("convert", ["none", "float64", "half", "to_same"])
def test_qkv_parameters_stay_views_of_the_stack(bias: bool, convert: str) -> None:
    layer = make_attention(bias)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    before = [p.detach().clone() for p in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)]
    if convert == "float64":
        layer.to(torch.float64)
    elif convert == "half":
        layer.half()
    elif convert == "to_same":
        layer.to(torch.float32)
    dtype = layer.q_proj.weight.dtype
    assert layer.qkv_weight.dtype == dtype
    assert torch.equal(layer.qkv_weight, torch.cat(before).to(dtype))  # the converted values, stacked
    assert_stacked(layer)

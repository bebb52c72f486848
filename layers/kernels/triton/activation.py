"""relu^2 in one pass: NemotronH's MLP activation, in place over the up projection's output
(torch's relu then square read and write the activations twice)."""
import torch
import triton
import triton.language as tl

from layers.kernels.triton.device import pdl, wait_for_previous_kernel

_BLOCK = 4096


@triton.jit
def _relu_square_kernel(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    x = tl.where(x < 0, 0.0, x)  # (not maximum: a NaN stays NaN, as in torch.relu)
    tl.store(x_ptr + offsets, (x * x).to(x_ptr.dtype.element_ty), mask=mask)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 written over x (as `reference.activation.relu_square`), for a prompt step's
    up projection in `linear_relu_square`. x must be contiguous."""
    if not x.is_contiguous():
        raise ValueError(f"relu_square needs a contiguous tensor, got strides {x.stride()} for shape "
                         f"{tuple(x.shape)}")
    n = x.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, _BLOCK),)](x, n, BLOCK=_BLOCK, num_warps=8, **pdl(x))
    return x

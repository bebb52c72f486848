"""The SSM state kernels with a low-precision state pool (`mamba_ssm_cache_dtype`): they
compute in float32 and store in the pool's dtype; a verify row continues from the stored
(rounded) state, as chained single-token steps do.

Run on a GPU: `python -m pytest tests/kernels/test_ssm_cache_dtype.py -m gpu -q` (or on the
CPU with TRITON_INTERPRET=1, float16 standing in for bfloat16)."""
import math
import os

import pytest
import torch

from layers.kernels import reference as ref
from layers.kernels.reference.conv1d import run_verify_positions

RUNS_IN_TRITON_INTERPRETER = True  # conftest: TRITON_INTERPRET=1 runs these on the CPU


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts float32 to bfloat16 by truncation (the GPU rounds to nearest):
# float16 stands in for the low-precision pool there.
LOW = torch.float16 if INTERPRET and not torch.cuda.is_available() else torch.bfloat16
HEADS, HEAD_DIM, GROUPS, STATE = 4, 16, 2, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(*lead: int):
    gen = torch.Generator().manual_seed(math.prod(lead))

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(KERNEL_DEVICE)

    return (randn(*lead, HEADS, HEAD_DIM), randn(*lead, HEADS, scale=2.0), -randn(HEADS).abs(),
            randn(*lead, GROUPS, STATE), randn(*lead, GROUPS, STATE), randn(HEADS), randn(HEADS),
            randn(24, HEADS, HEAD_DIM, STATE, scale=0.5).to(LOW))


@pytest.mark.gpu
def test_single_token_update_low_precision_pool():
    triton_ssm = pytest.importorskip("layers.kernels.triton.ssm_update")
    x, dt, a, b, c, d, dt_bias, pool = _inputs(6)
    src = torch.arange(6, device=KERNEL_DEVICE)
    src[2] = -1
    dst = torch.where(src >= 0, src + 8, -1)
    fast, expected = pool.clone(), pool.clone()
    y = triton_ssm.ssm_state_update(fast, x, dt, a, b, c, d, src, dst, dt_bias)
    y_ref = ref.ssm_state_update(expected, x, dt, a, b, c, d, src, dst, dt_bias)
    assert fast.dtype == LOW
    assert _rel(y, y_ref) < 1e-5  # from the float32 state, before it is stored
    written = dst[dst >= 0]
    assert _rel(fast[written], expected[written]) < 1e-2  # both round float32 math to the pool dtype
    untouched = torch.ones(len(pool), dtype=torch.bool, device=KERNEL_DEVICE)
    untouched[written] = False
    assert torch.equal(fast[untouched], pool[untouched])


@pytest.mark.gpu
def test_verify_rows_round_the_carried_state_like_single_token_steps():
    """A verify row carries its state across positions in registers; with a low-precision
    pool it continues from the stored (rounded) state, so it equals single-token steps
    chained position by position bit for bit, and the reference ops to rounding."""
    triton_ssm = pytest.importorskip("layers.kernels.triton.ssm_update")
    rows, width = 3, 4
    x, dt, a, b, c, d, dt_bias, pool = _inputs(rows, width)
    src = torch.arange(rows, device=KERNEL_DEVICE)
    dst = torch.stack([8 + width * i + torch.arange(width, device=KERNEL_DEVICE) for i in range(rows)]).T.contiguous()
    fused, chained, expected = pool.clone(), pool.clone(), pool.clone()
    y = triton_ssm.ssm_state_verify(fused, x, dt, a, b, c, d, src, dst, dt_bias)
    y_chained = torch.stack(run_verify_positions(src, dst, lambda j, s, t: triton_ssm.ssm_state_update(
        chained, x[:, j], dt[:, j], a, b[:, j], c[:, j], d, s, t, dt_bias)), dim=1)
    y_ref = ref.ssm_state_verify(expected, x, dt, a, b, c, d, src, dst, dt_bias)
    assert torch.equal(fused, chained) and torch.equal(y, y_chained)
    assert _rel(fused, expected) < 1e-2 and _rel(y, y_ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET and not torch.cuda.is_available(), reason="the SSD kernel fails in the interpreter")
def test_ssd_scan_low_precision_pool():
    """Prefill: the scan reads the initial state from the pool as float32 and stores the
    final one in the pool's dtype."""
    triton_ssd = pytest.importorskip("layers.kernels.triton.ssd")
    lens = [5, 40, 70]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=KERNEL_DEVICE)
    x, dt, a, b, c, d, _, pool = _inputs(sum(lens))
    dt = dt.abs() * 0.1
    src, dst = torch.tensor([0, 1, 2], device=KERNEL_DEVICE), torch.tensor([3, 4, 5], device=KERNEL_DEVICE)
    fast, expected = pool.clone(), pool.clone()
    y = triton_ssd.ssd_chunk_scan_varlen(x, dt, a, b, c, d, cu, fast, src, dst)
    y_ref = ref.ssd_chunk_scan_varlen(x, dt, a, b, c, d, cu, expected, src, dst)
    assert _rel(y, y_ref) < 1e-4
    assert _rel(fast[3:6], expected[3:6]) < 1e-2
    assert torch.equal(fast[:3], pool[:3]) and torch.equal(fast[6:], pool[6:])

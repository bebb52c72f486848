"""The fused verify-row ops (speculative decoding) on the GPU: every position's state equals
(torch.equal) what the single-token Triton updates write when chained position by position
(outputs too), and matches the reference ops; padding rows and positions touch
nothing; a dst slot may be the row's own src slot (serial rings).

Run on a GPU: `python -m pytest tests/kernels/test_verify_ops.py -m gpu -q`."""
import pytest
import torch

from layers.kernels import reference
from layers.kernels.reference.conv1d import run_verify_positions

triton_conv = pytest.importorskip("layers.kernels.triton.conv1d", reason="needs Triton")
triton_ssm = pytest.importorskip("layers.kernels.triton.ssm_update", reason="needs Triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, WIDTH, HEADS, HEAD_DIM, GROUPS, STATE, CONV_K = 5, 5, 8, 16, 2, 16, 4
SLOTS = 40


def _slots(in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i starts from slot i; its positions write slots 10+5i.. (when `in_place`, row 0
    writes its own src at position 0 and row 2 at position 3); row 1 has 2 real positions,
    row 3 is padding."""
    src = torch.arange(ROWS)
    dst = torch.stack([10 + 5 * i + torch.arange(WIDTH) for i in range(ROWS)])  # [rows, width]
    if in_place:
        dst[0, 0] = 0
        dst[2, 3] = 2  # a later position writes the row's src slot
    dst[1, 2:] = -1
    src[3] = -1
    dst[3] = -1
    return src.cuda(), dst.T.contiguous().cuda()


def _check_against_reference(fused, ref, pool, dst, y, y_ref, dtype) -> None:
    """States and outputs match the reference ops; slots not written are untouched; the
    padding row and padding positions output zeros."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    written = set(dst[dst >= 0].tolist())
    untouched = [s for s in range(SLOTS) if s not in written]
    assert torch.equal(fused[untouched], pool[untouched])
    assert not y[3].any() and not y[1, 2:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_ssm_state_verify(dtype, in_place):
    torch.manual_seed(0)
    src, dst = _slots(in_place)
    x = torch.randn(ROWS, WIDTH, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    dt = torch.randn(ROWS, WIDTH, HEADS, device="cuda", dtype=dtype)
    b = torch.randn(ROWS, WIDTH, GROUPS, STATE, device="cuda", dtype=dtype)
    c = torch.randn(ROWS, WIDTH, GROUPS, STATE, device="cuda", dtype=dtype)
    a, d, dt_bias = -torch.rand(HEADS, device="cuda"), torch.randn(HEADS, device="cuda"), torch.randn(HEADS, device="cuda")
    pool = torch.randn(SLOTS, HEADS, HEAD_DIM, STATE, device="cuda")
    fused, chained, ref = pool.clone(), pool.clone(), pool.clone()
    y = triton_ssm.ssm_state_verify(fused, x, dt, a, b, c, d, src, dst, dt_bias)
    y_chained = torch.stack(run_verify_positions(src, dst, lambda j, s, t: triton_ssm.ssm_state_update(
        chained, x[:, j], dt[:, j], a, b[:, j], c[:, j], d, s, t, dt_bias)), dim=1)
    y_ref = reference.ssm_state_verify(ref, x, dt, a, b, c, d, src, dst, dt_bias)
    assert torch.equal(fused, chained) and torch.equal(y, y_chained)
    _check_against_reference(fused, ref, pool, dst, y, y_ref, dtype)


def test_ssm_state_verify_checks_the_dt_limit():
    """With `dt_limit_hits`, a row is flagged when a live position's dt lies outside the
    limit, as the chained single-token updates and the reference flag it; padding rows and
    positions are not looked at; the outputs are those without the check."""
    torch.manual_seed(1)
    src, dst = _slots(False)
    x = torch.randn(ROWS, WIDTH, HEADS, HEAD_DIM, device="cuda")
    dt = torch.randn(ROWS, WIDTH, HEADS, device="cuda") * 3
    b = torch.randn(ROWS, WIDTH, GROUPS, STATE, device="cuda")
    c = torch.randn(ROWS, WIDTH, GROUPS, STATE, device="cuda")
    a, d, dt_bias = -torch.rand(HEADS, device="cuda"), torch.randn(HEADS, device="cuda"), torch.randn(HEADS, device="cuda")
    pool = torch.randn(SLOTS, HEADS, HEAD_DIM, STATE, device="cuda")
    limit = (float(torch.nn.functional.softplus(dt[0, 2] + dt_bias).min()) + 1e-3, 100.0)  # row 0 leaves it
    dt[1, :2] = 20.0 - dt_bias  # row 1's live positions inside the limit (softplus ~ 20) ...
    dt[1, 2:] = 1000.0  # ... its padding positions and the padding row 3 far outside: never looked at
    dt[3] = 1000.0
    softplus = torch.nn.functional.softplus(dt + dt_bias)
    live = torch.stack([(dst[j] >= 0) & (src >= 0) for j in range(WIDTH)], dim=1)  # [rows, width]
    expected = (((softplus < limit[0]) | (softplus > limit[1])).any(-1) & live).any(-1).int()
    assert expected[0] == 1 and expected[1] == 0 and expected[3] == 0
    hits = [torch.zeros(ROWS, dtype=torch.int32, device="cuda") for _ in range(3)]
    y = triton_ssm.ssm_state_verify(pool.clone(), x, dt, a, b, c, d, src, dst, dt_bias, limit, hits[0])
    chained = pool.clone()
    run_verify_positions(src, dst, lambda j, s, t: triton_ssm.ssm_state_update(
        chained, x[:, j], dt[:, j], a, b[:, j], c[:, j], d, s, t, dt_bias, limit, hits[1]))
    reference.ssm_state_verify(pool.clone(), x, dt, a, b, c, d, src, dst, dt_bias, limit, hits[2])
    assert all(torch.equal(h, expected) for h in hits), (hits, expected)
    assert torch.equal(y, triton_ssm.ssm_state_verify(pool.clone(), x, dt, a, b, c, d, src, dst, dt_bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_causal_conv1d_verify(dtype, in_place):
    torch.manual_seed(1)
    src, dst = _slots(in_place)
    dim = 300  # two channel blocks, the second ragged
    x = torch.randn(ROWS, WIDTH, dim + 7, device="cuda", dtype=dtype)[..., :dim]  # strided rows
    weight = torch.randn(dim, CONV_K, device="cuda", dtype=dtype)
    bias = torch.randn(dim, device="cuda", dtype=dtype)
    pool = torch.randn(SLOTS, dim, CONV_K - 1, device="cuda", dtype=dtype)
    fused, chained, ref = pool.clone(), pool.clone(), pool.clone()
    y = triton_conv.causal_conv1d_verify(x, weight, bias, fused, src, dst)
    y_chained = torch.stack(run_verify_positions(src, dst, lambda j, s, t: triton_conv.causal_conv1d_update(
        x[:, j], weight, bias, chained, s, t)), dim=1)
    y_ref = reference.causal_conv1d_verify(x, weight, bias, ref, src, dst)
    # Bit for bit: the kernels share one tap sum (`conv1d.conv_update_channels`).
    assert torch.equal(fused, chained) and torch.equal(y, y_chained)
    _check_against_reference(fused, ref, pool, dst, y, y_ref, dtype)

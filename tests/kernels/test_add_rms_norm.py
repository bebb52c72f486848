"""`add_rms_norm`, the residual add fused into the RMSNorm after it.

The Triton op (marked gpu; TRITON_INTERPRET=1 runs it on the CPU, float16 standing in for
bfloat16 as in test_fast_ops.py) against the reference composition: the new residual bit
for bit `residual + x * scale` in the same dtype, the normed rows within 1e-5 (float32) or
1e-2 (bf16) relative of the reference and bit for bit the fast `rms_norm` of the new
residual; also inside a CUDA graph. The input checks of the op run on the CPU (CI).

    python -m pytest tests/kernels/test_add_rms_norm.py -m gpu -q     # on the GPU machine
"""
import os
import zlib

import pytest
import torch

from layers.kernels import reference as ref

RUNS_IN_TRITON_INTERPRETER = True  # conftest: TRITON_INTERPRET=1 runs the gpu tests on the CPU

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.float16 if INTERPRET else torch.bfloat16
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
EPS = 1e-6


@pytest.fixture
def fast():
    """The Triton norm module (gpu-marked tests run only with CUDA or the interpreter)."""
    pytest.importorskip("triton", reason="the fast ops need Triton")
    from layers.kernels.triton import norm

    return norm


def draw(shape: tuple[int, ...], dtype: torch.dtype, seed: str, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (the same on every device), on DEVICE."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return ((out - expected).norm() / expected.norm()).item()


def check_against_reference(fast, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            weight_in_fp32: bool, scale: float | None) -> None:
    """The fast op's two outputs against the reference and the unfused ops."""
    normed, new_residual = fast.add_rms_norm(x, residual, weight, EPS, weight_in_fp32, scale)
    expected_normed, _ = ref.add_rms_norm(x, residual, weight, EPS, weight_in_fp32, scale)
    assert torch.equal(new_residual, residual + (x if scale is None else x * scale))
    assert normed.dtype == expected_normed.dtype and normed.shape == expected_normed.shape
    err = rel_err(normed, expected_normed)
    assert err < TOL[x.dtype], f"relative error {err:.3g} >= {TOL[x.dtype]}"
    # The fused path computes the norm exactly as the fast rms_norm does.
    assert torch.equal(normed, fast.rms_norm(new_residual, weight, EPS, weight_in_fp32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("scale", [None, 0.22])
@pytest.mark.parametrize("shape", [(1, 4096), (7, 100), (3, 5, 96)])
def test_add_rms_norm_matches_reference(fast, dtype: torch.dtype, weight_in_fp32: bool, scale: float | None,
                                        shape: tuple[int, ...]) -> None:
    seed = f"{dtype}{weight_in_fp32}{scale}{shape}"
    x = draw(shape, dtype, "x" + seed)
    residual = draw(shape, dtype, "r" + seed, scale=4.0)  # a stream larger than the branch, as in a model
    for weight in (draw(shape[-1:], dtype, "w" + seed), draw(shape[-1:], torch.float32, "w32" + seed)):
        check_against_reference(fast, x, residual, weight, weight_in_fp32, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
def test_add_rms_norm_strided_rows(fast, dtype: torch.dtype) -> None:
    """Inputs whose rows are not contiguous with each other (views of wider buffers)."""
    x = draw((5, 300), dtype, f"x{dtype}")[:, 44:244]
    residual = draw((5, 200), dtype, f"r{dtype}")
    check_against_reference(fast, x, residual, draw((200,), torch.float32, f"w{dtype}"), True, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_add_rms_norm_without_residual(fast, dtype: torch.dtype, weight_in_fp32: bool) -> None:
    """The first layer: x starts the residual stream; only the norm runs."""
    x = draw((6, 128), dtype, f"x{dtype}{weight_in_fp32}")
    weight = draw((128,), dtype, f"w{dtype}{weight_in_fp32}")
    normed, new_residual = fast.add_rms_norm(x, None, weight, EPS, weight_in_fp32)
    assert new_residual is x
    assert torch.equal(normed, fast.rms_norm(x, weight, EPS, weight_in_fp32))
    err = rel_err(normed, ref.rms_norm(x, weight, EPS, weight_in_fp32))
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_add_rms_norm_captures_in_cuda_graph(fast) -> None:
    """Captured once (scaled add, bf16, Granite's weight order), replayed on new inputs."""
    x, residual = draw((4, 1536), torch.bfloat16, "gx"), draw((4, 1536), torch.bfloat16, "gr")
    weight = draw((1536,), torch.bfloat16, "gw")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fast.add_rms_norm(x, residual, weight, EPS, False, 0.22)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_residual = fast.add_rms_norm(x, residual, weight, EPS, False, 0.22)
    x.copy_(draw((4, 1536), torch.bfloat16, "gx2"))
    residual.copy_(draw((4, 1536), torch.bfloat16, "gr2"))
    graph.replay()
    torch.cuda.synchronize()
    expected_normed, expected_residual = ref.add_rms_norm(x, residual, weight, EPS, False, 0.22)
    assert torch.equal(new_residual, expected_residual)
    assert rel_err(normed, expected_normed) < TOL[torch.bfloat16]


def test_add_rms_norm_rejects_bad_inputs() -> None:
    """A scale with nothing to add to, or a residual of another shape or dtype: ValueError
    (both op sets run the same check before any kernel)."""
    x, weight = torch.ones(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="residual_scale"):
        ref.add_rms_norm(x, None, weight, EPS, residual_scale=0.5)
    with pytest.raises(ValueError, match=r"residual \(2, 4\)"):
        ref.add_rms_norm(x, torch.ones(2, 4), weight, EPS)
    with pytest.raises(ValueError, match="torch.float16 does not match"):
        ref.add_rms_norm(x, torch.ones(2, 8, dtype=torch.float16), weight, EPS)

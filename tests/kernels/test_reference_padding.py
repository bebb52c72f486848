"""The reference ops keep the packed-token contract (layers/kernels/ops.py): rows of padding
sequences (slot -1) and tokens past cu_seqlens[-1] come out as zeros. The runner's prompt
steps end in such padding tokens (`hybrid_engine.runner.TOKEN_ALIGNMENT`)."""
import torch

from layers.kernels import reference as ref


def _after_garbage(shape: tuple[int, ...]) -> None:
    """Free a NaN-filled buffer of `shape`, so that an uninitialized output would likely reuse it."""
    garbage = torch.full(shape, float("nan"))
    del garbage


def test_conv_and_ssd_zero_the_padding():
    torch.manual_seed(0)
    tokens, dim, heads, head_dim, state = 9, 16, 2, 4, 8
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)  # tokens 6..8 past the last sequence
    src = torch.tensor([0, -1, 1], dtype=torch.int32)  # the second sequence is padding
    dst = torch.tensor([2, -1, 3], dtype=torch.int32)
    zero_rows = [3, 4, 6, 7, 8]

    x = torch.randn(tokens, dim)
    _after_garbage((tokens, dim))
    y = ref.causal_conv1d_varlen(x, torch.randn(dim, 4), torch.randn(dim), torch.randn(4, dim, 3), cu, src, dst)
    assert torch.equal(y[zero_rows], torch.zeros(len(zero_rows), dim)) and y[[0, 1, 2, 5]].abs().sum() > 0

    xs = torch.randn(tokens, heads, head_dim)
    _after_garbage((tokens, heads, head_dim))
    y = ref.ssd_chunk_scan_varlen(xs, torch.rand(tokens, heads), -torch.rand(heads), torch.randn(tokens, 1, state),
                                  torch.randn(tokens, 1, state), torch.ones(heads), cu,
                                  torch.randn(4, heads, head_dim, state), src, dst)
    assert torch.equal(y[zero_rows], torch.zeros(len(zero_rows), heads, head_dim)) and y[[0, 1, 2, 5]].abs().sum() > 0

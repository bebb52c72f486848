"""`StateSaves` in the reference ops: a state saved from inside a prefill chunk is exactly
the state the same tokens leave when cut into two chunks there, and the outputs are those
of the cut chunks (the fast ops are checked against these in test_fast_ops.py)."""
import torch

from layers.kernels import reference as ref
from layers.kernels.ops import StateSaves

LENS = [70, 3, 45]  # tokens of three prefill chunks
OFFSETS = [[1, 33, 64], [], [44]]  # where each saves its state (1: the conv window reaches the old state)
SRC, DST = [0, 1, 2], [3, 4, 5]


def _saves() -> tuple[StateSaves, list[int]]:
    cu = torch.tensor([0, *torch.tensor([len(o) for o in OFFSETS]).cumsum(0).tolist()], dtype=torch.int32)
    slots = list(range(6, 6 + int(cu[-1])))
    return StateSaves(cu, torch.tensor(sum(OFFSETS, []), dtype=torch.int32), torch.tensor(slots)), slots


def _cut_plan() -> list[list[tuple[int, int]]]:
    """Each chunk's token ranges when cut at its saves."""
    segments = []  # per chunk: [(lo, hi)]
    start = 0
    for length, offsets in zip(LENS, OFFSETS):
        ends = [*offsets, length]
        segments.append([(start + a, start + b) for a, b in zip([0, *offsets], ends)])
        start += length
    return segments


def _run_cut(op, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Run `op` on the cut chunks, round j taking segment j of every chunk that has one:
    segment j of chunk s reads the state its segment j-1 left in slot 100 + 10 s + j - 1,
    and the last segment writes the chunk's dst."""
    segments = _cut_plan()
    out = torch.zeros_like(inputs[0])
    for j in range(max(map(len, segments))):
        rows = [(s, seg[j]) for s, seg in enumerate(segments) if j < len(seg)]
        index = torch.cat([torch.arange(lo, hi) for _, (lo, hi) in rows])
        cu = torch.tensor([0, *torch.tensor([hi - lo for _, (lo, hi) in rows]).cumsum(0).tolist()], dtype=torch.int32)
        src = torch.tensor([SRC[s] if j == 0 else 100 + 10 * s + j - 1 for s, _ in rows])
        dst = torch.tensor([DST[s] if j == len(segments[s]) - 1 else 100 + 10 * s + j for s, _ in rows])
        out[index] = op(*[t[index] for t in inputs], cu, src, dst)
    return out


def _saved_by_cut() -> list[int]:
    """The slots the cut run leaves each save's state in, in save order."""
    return [100 + 10 * s + j for s, offsets in enumerate(OFFSETS) for j in range(len(offsets))]


def test_conv_saves_equal_cut_chunks():
    torch.manual_seed(0)
    dim, width = 12, 4
    x = torch.randn(sum(LENS), dim)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    states = torch.randn(130, dim, width - 1)
    saves, slots = _saves()
    whole_states, cut_states = states.clone(), states.clone()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    whole = ref.causal_conv1d_varlen(x, weight, bias, whole_states, cu, torch.tensor(SRC), torch.tensor(DST),
                                     saves=saves)
    cut = _run_cut(lambda xs, c, s, d: ref.causal_conv1d_varlen(xs, weight, bias, cut_states, c, s, d), [x])
    torch.testing.assert_close(whole, cut, rtol=1e-6, atol=1e-6)
    assert torch.equal(whole_states[slots], cut_states[_saved_by_cut()])
    assert torch.equal(whole_states[DST], cut_states[DST])


def test_ssd_saves_equal_cut_chunks():
    torch.manual_seed(1)
    tokens, heads, head_dim, groups, n = sum(LENS), 4, 8, 2, 16
    x = torch.randn(tokens, heads, head_dim)
    dt = torch.randn(tokens, heads)
    a = -torch.exp(torch.randn(heads) * 0.5)
    b, c = torch.randn(tokens, groups, n), torch.randn(tokens, groups, n)
    d_skip, dt_bias = torch.randn(heads), torch.randn(heads)
    mask = torch.rand(tokens) < 0.5
    states = torch.randn(130, heads, head_dim, n)
    saves, slots = _saves()
    whole_states, cut_states = states.clone(), states.clone()
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    limit = (0.3, 2.0)
    whole = ref.ssd_chunk_scan_varlen(x, dt, a, b, c, d_skip, cu, whole_states, torch.tensor(SRC), torch.tensor(DST),
                                      dt_bias, limit, mask, saves=saves)
    cut = _run_cut(lambda xs, dts, bs, cs, ms, cu_, s, d: ref.ssd_chunk_scan_varlen(
        xs, dts, a, bs, cs, d_skip, cu_, cut_states, s, d, dt_bias, limit, ms), [x, dt, b, c, mask])
    # (Equal up to the rounding of batched einsums over different chunk counts.)
    torch.testing.assert_close(whole, cut, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole_states[slots], cut_states[_saved_by_cut()], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole_states[DST], cut_states[DST], rtol=1e-5, atol=1e-5)
    # A save changes nothing but where the blocks restart: without saves, only rounding differs.
    plain_states = states.clone()
    plain = ref.ssd_chunk_scan_varlen(x, dt, a, b, c, d_skip, cu, plain_states, torch.tensor(SRC), torch.tensor(DST),
                                      dt_bias, limit, mask)
    torch.testing.assert_close(plain, whole, rtol=1e-4, atol=1e-4)

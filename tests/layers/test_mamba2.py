"""The Mamba-2 mixer on the reference ops: its chunked prefill scan equals the token-by-token
decode recurrence across the scan's block boundaries, packed sequences stay independent,
and a step leaves every state slot it does not write bit-exact (ping-pong rollback)."""
import itertools
import math

import pytest
import torch

from layers.forward_meta import ForwardMeta
from layers.kernels import REFERENCE_OPS
from layers.kernels.reference.ssd import CHUNK
from layers.mamba2 import Mamba2Mixer

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, CONV = 32, 4, 8, 2, 8, 4
SLOTS = 6


def make_mixer() -> Mamba2Mixer:
    """A mixer with seeded random weights and random (non-zero) states in every slot."""
    torch.manual_seed(0)
    mixer = Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, CONV, dt_limit=(0.0, math.inf), norm_eps=1e-5,
                        ops=REFERENCE_OPS)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.log(torch.linspace(0.5, 2.0, HEADS)))
    mixer.conv_state = torch.randn(SLOTS, mixer.conv_dim, CONV - 1)
    mixer.ssm_state = torch.randn(SLOTS, HEADS, HEAD_DIM, STATE) * 0.5
    return mixer


def step_meta(num_decode: int, prefill_lens: list[int], src: list[int], dst: list[int]) -> ForwardMeta:
    """Metadata of one step for the mixer alone (the fields attention reads stay empty)."""
    tokens = num_decode + sum(prefill_lens)
    none = torch.zeros(0, dtype=torch.long)
    return ForwardMeta(
        num_decode=num_decode, num_prefill=len(prefill_lens), num_tokens=tokens,
        max_seqlen_q=max(prefill_lens, default=1), positions=none,
        prompt_token_mask=torch.zeros(tokens, dtype=torch.bool), slot_mapping=none, cu_seqlens_q=none,
        prefill_cu_seqlens=torch.tensor([0, *itertools.accumulate(prefill_lens)], dtype=torch.int32),
        seq_lens=none, block_tables=none, mamba_src=torch.tensor(src), mamba_dst=torch.tensor(dst),
        logits_indices=none,
    )


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
@torch.no_grad()
def test_chunked_scan_equals_decode_recurrence(length: int) -> None:
    scanned, decoded = make_mixer(), make_mixer()
    x = torch.randn(length, HIDDEN)
    y_scan = scanned(x, step_meta(0, [length], src=[0], dst=[1]))
    y_steps = torch.cat([decoded(x[t:t + 1], step_meta(1, [], src=[t % 2], dst=[(t + 1) % 2]))
                         for t in range(length)])
    torch.testing.assert_close(y_scan, y_steps, atol=1e-5, rtol=1e-5)
    final = length % 2  # the slot the last decode step wrote
    # (the in_proj matmul of one row and of many rows round differently: not bitwise)
    for pool in ("ssm_state", "conv_state"):
        torch.testing.assert_close(getattr(scanned, pool)[1], getattr(decoded, pool)[final], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_packed_sequences_are_independent_and_unnamed_slots_untouched() -> None:
    """Two packed prefill sequences (src != dst) equal each one run alone; the source slots
    and every slot not named keep their bits."""
    lens, src, dst = [CHUNK + 3, 5], [2, 0], [3, 1]
    packed = make_mixer()
    before = packed.conv_state.clone(), packed.ssm_state.clone()
    x = torch.randn(sum(lens), HIDDEN)
    y = packed(x, step_meta(0, lens, src, dst))
    starts = [0, lens[0]]
    for s in range(2):
        alone = make_mixer()
        y_alone = alone(x[starts[s]:starts[s] + lens[s]], step_meta(0, [lens[s]], [src[s]], [dst[s]]))
        torch.testing.assert_close(y[starts[s]:starts[s] + lens[s]], y_alone, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(packed.ssm_state[dst[s]], alone.ssm_state[dst[s]], atol=1e-6, rtol=1e-6)
    kept = [slot for slot in range(SLOTS) if slot not in dst]
    assert torch.equal(packed.conv_state[kept], before[0][kept])
    assert torch.equal(packed.ssm_state[kept], before[1][kept])


@torch.no_grad()
def test_verify_rows_write_each_position_state_like_single_token_updates() -> None:
    """Verify rows (speculative decoding): row 0 an input token and 2 drafts, row 1 an input
    token and no draft (2 padding positions). The state written for each position equals
    (torch.equal) what single-token updates from the same inputs write; padding positions
    write nothing, and every slot not written is untouched."""
    width = 3
    verified, stepped = make_mixer(), make_mixer()
    x = torch.randn(2 * width, HIDDEN)
    src = torch.tensor([[0, 2, 3], [1, -1, -1]])
    dst = torch.tensor([[2, 3, 4], [5, -1, -1]])
    meta = step_meta(2, [], src=[0, 1], dst=[2, 5])
    meta.decode_width, meta.verify_dst = width, dst.T.contiguous()
    before = (verified.conv_state.clone(), verified.ssm_state.clone())
    y = verified(x, meta).view(2, width, HIDDEN)

    # The same inputs, one token per call through the single-token update ops.
    zxbcdt = stepped.in_proj(x).view(2, width, -1)
    _, xbc, dt = zxbcdt.split([stepped.d_ssm, stepped.conv_dim, HEADS], dim=-1)
    weight = stepped.conv1d.weight.squeeze(1)
    for row, positions in ((0, 3), (1, 1)):
        for j in range(positions):
            s, d = src[row, j:j + 1], dst[row, j:j + 1]
            out = REFERENCE_OPS.causal_conv1d_update(xbc[row, j:j + 1], weight, stepped.conv1d.bias,
                                                     stepped.conv_state, s, d)
            xs, b, c = stepped._split_xbc(out)
            REFERENCE_OPS.ssm_state_update(stepped.ssm_state, xs, dt[row, j:j + 1], stepped._a(), b, c, stepped.D,
                                           s, d, stepped.dt_bias)
    for slot in (2, 3, 4, 5):
        assert torch.equal(verified.conv_state[slot], stepped.conv_state[slot]), slot
        assert torch.equal(verified.ssm_state[slot], stepped.ssm_state[slot]), slot
    for slot in (0, 1):  # read only
        assert torch.equal(verified.conv_state[slot], before[0][slot])
        assert torch.equal(verified.ssm_state[slot], before[1][slot])
    assert not y[1, 1:].any()  # padding positions: no state, zero output before out_proj's bias

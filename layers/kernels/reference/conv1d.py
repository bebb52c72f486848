"""Depthwise causal conv1d over packed sequences with per-sequence state slots (reference).

Conv state layout: `conv_states[slot] = [D, K-1]`, the last K-1 inputs of the sequence
(oldest first), exactly what mamba-ssm / causal-conv1d keep. Each sequence reads its
initial state from `src_slots[s]` and writes its final state to `dst_slots[s]`; the two
may differ (ping-pong rollback) or be equal (in-place). Slot -1 marks a padding row that
must not touch any state.
"""
import torch
import torch.nn.functional as F

from layers.kernels.ops import StateSaves
from layers.kernels.reference.linear import linear


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation: {activation!r}")


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
    saves: StateSaves | None = None,
) -> torch.Tensor:
    """Causal conv over packed sequences (prefill chunks) continuing from saved state.

    x: [T, D] packed tokens; weight: [D, K]; bias: [D] or None; conv_states: [slots, D, K-1];
    cu_seqlens: [S+1]; src_slots / dst_slots: [S]. Returns y: [T, D] in x's dtype.
    `saves`: the state after a sequence's first `offsets[k]` tokens also goes to `slots[k]`.
    """
    k = weight.shape[1]
    out = torch.zeros_like(x)  # padding sequences and tokens past cu_seqlens[-1] stay zero
    bounds = cu_seqlens.tolist()
    src, dst = src_slots.tolist(), dst_slots.tolist()
    seq_saves = saves.by_sequence() if saves is not None else [[]] * (len(bounds) - 1)
    new_states = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        if src[s] < 0:
            continue
        history = conv_states[src[s]].to(x.dtype)  # [D, K-1]
        seq = torch.cat([history, x[lo:hi].t()], dim=1)  # [D, K-1+L]: the state after t tokens is seq[:, t:t+K-1]
        y = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
        out[lo:hi] = _activate(y, activation).t().to(x.dtype)
        for offset, slot in seq_saves[s]:
            new_states.append((slot, seq[:, offset:offset + k - 1]))
        new_states.append((dst[s], seq[:, -(k - 1):]))
    # States are written after all reads so src == dst of another row can never be clobbered.
    for slot, state in new_states:
        conv_states[slot] = state.to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per row: y = conv(state ++ x), state <- last K-1 inputs.

    x: [B, D]; rows whose src slot is -1 are padding (output zeros, no state touched).
    """
    valid = src_slots >= 0
    src = src_slots.clamp(min=0)
    history = conv_states[src].to(x.dtype)  # [B, D, K-1]
    seq = torch.cat([history, x.unsqueeze(-1)], dim=-1)  # [B, D, K]
    y = (seq.to(weight.dtype) * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    y = _activate(y, activation).to(x.dtype)
    rows = valid.nonzero().flatten()
    conv_states[dst_slots[rows]] = seq[rows, :, 1:].to(conv_states.dtype)
    return torch.where(valid.unsqueeze(-1), y, torch.zeros_like(y))


def linear_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_start: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The projection, then `causal_conv1d_update` of its columns [conv_start, conv_start + D)."""
    y = linear(x, weight, bias)
    columns = y[:, conv_start:conv_start + conv_weight.shape[0]]
    columns.copy_(causal_conv1d_update(columns, conv_weight, conv_bias, conv_states, src_slots, dst_slots, activation))
    return y


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """W tokens per row, position by position through `causal_conv1d_update`: position j
    reads the state position j-1 wrote (the row's src for j = 0) and writes dst_slots[j]."""
    return torch.stack(run_verify_positions(src_slots, dst_slots, lambda j, src, dst: causal_conv1d_update(
        x[:, j], weight, bias, conv_states, src, dst, activation)), dim=1)


def run_verify_positions(src_slots: torch.Tensor, dst_slots: torch.Tensor, update) -> list[torch.Tensor]:
    """Run `update(j, src, dst)` for every position of verify rows: position j reads what
    position j-1 wrote; a padding position (dst -1) reads nothing (src -1)."""
    outputs, src = [], src_slots
    for j in range(dst_slots.shape[0]):
        dst = dst_slots[j]
        src = torch.where(dst >= 0, src, -1)
        outputs.append(update(j, src, dst))
        src = dst
    return outputs

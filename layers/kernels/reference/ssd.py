"""Mamba-2 SSD (state space duality) scan and single-token state update (reference).

Shapes: H heads of P channels, G groups of B/C of state size N (heads share B/C within a
group), SSM state [H, P, N] kept in float32. `dt` arrives either processed, or raw with
`dt_bias` (the ops apply softplus(dt + dt_bias), and the scan clamps the tokens the model
marks in `dt_limit_mask` to `dt_limit`: which tokens get the limit stays the model's choice).

Recurrence per head h (what both forms compute):
    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t
    y_t     = state_t . C_t + D_h * x_t
"""
import math

import torch
import torch.nn.functional as F

from layers.kernels.ops import StateSaves
from layers.kernels.reference.conv1d import run_verify_positions

# Tokens per block of the chunked scan. The result does not depend on it (the blocking is
# exact up to rounding); the Triton scan imports it, so both block and round alike.
CHUNK = 32


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, -inf above the diagonal."""
    t = a.shape[-1]
    expanded = a.unsqueeze(-1).expand(*a.shape, t)  # [..., i(k), j]
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1)
    summed = torch.cumsum(expanded.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=0)
    return summed.masked_fill(~keep, float("-inf"))


def _ssd_one_sequence(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD for one sequence. x [L,H,P], dt [L,H], a [H], b/c [L,H,N], state [H,P,N]."""
    length = x.shape[0]
    pad = (-length) % CHUNK
    xdt = F.pad(x * dt.unsqueeze(-1), (0, 0, 0, 0, 0, pad))
    adt = F.pad(dt * a, (0, 0, 0, pad))  # padded steps have dt = 0: no decay, no input
    b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (b, c))
    n_chunks = (length + pad) // CHUNK
    xdt, b, c = (t.reshape(n_chunks, CHUNK, *t.shape[1:]) for t in (xdt, b, c))
    adt = adt.reshape(n_chunks, CHUNK, -1).permute(2, 0, 1)  # [H, c, l]
    a_cum = torch.cumsum(adt, dim=-1)

    # Intra-chunk (diagonal blocks): attention-like with a decaying causal mask.
    decay = torch.exp(_segsum(adt))  # [H, c, l, s]
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", c, b, decay, xdt)

    # State each chunk contributes at its own end, then the inter-chunk recurrence.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [H, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", b, decay_to_end, xdt)
    states = torch.cat([initial_state.unsqueeze(0), chunk_states], dim=0)  # [c+1, H, P, N]
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [H, c+1, c+1]
    states = torch.einsum("hzc,chpn->zhpn", chunk_decay, states)
    start_states, final_state = states[:-1], states[-1]

    # Contribution of the state entering each chunk (off-diagonal blocks).
    y_off = torch.einsum("clhn,chpn,hcl->clhp", c, start_states, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(n_chunks * CHUNK, *x.shape[1:])[:length]
    return y, final_state


def clamps_dt(dt_limit: tuple[float, float]) -> bool:
    """Whether `dt_limit` clamps anything (the default (0, inf) does not)."""
    lo, hi = dt_limit
    return lo > 0.0 or hi != math.inf


def outside_dt_limit(dt: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """Per token of dt [T, H] (processed, not clamped): whether a head's dt lies outside
    `dt_limit`, i.e. a prefill would clamp it. [T] bool."""
    lo, hi = dt_limit
    return ((dt < lo) | (dt > hi)).any(dim=-1)


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float] = (0.0, math.inf),
               dt_limit_mask: torch.Tensor | None = None) -> torch.Tensor:
    """dt as the scan uses it, in float32: softplus(dt + dt_bias) when `dt_bias` is given
    (else dt as it is), then clamped to `dt_limit` at the tokens where `dt_limit_mask` [T]
    is True (every token when it is None; no clamp for the default (0, inf))."""
    dt = dt.float()
    if dt_bias is not None:
        dt = F.softplus(dt + dt_bias.float())
    if clamps_dt(dt_limit):
        clamped = dt.clamp(*dt_limit)
        dt = clamped if dt_limit_mask is None else torch.where(dt_limit_mask[:, None], clamped, dt)
    return dt


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_mask: torch.Tensor | None = None,
    saves: StateSaves | None = None,
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked SSD over packed variable-length sequences (prefill chunks), in blocks of `CHUNK`.

    x: [T, H, P]; dt: [T, H], used as `process_dt(dt, dt_bias, dt_limit, dt_limit_mask)`;
    A, D: [H]; B, C: [T, G, N]; cu_seqlens: [S+1]; ssm_states: [slots, H, P, N] float32;
    each sequence starts from `ssm_states[src_slots[s]]` and its final state goes to
    `ssm_states[dst_slots[s]]`. `saves`: the state after a sequence's first `offsets[k]`
    tokens also goes to `slots[k]`; the blocks restart there. `dt_limit_hits` [S]: set to 1
    for a sequence with an unmasked token whose dt lies outside `dt_limit`.
    Returns y: [T, H, P] in x's dtype (D skip included, gate not applied).
    """
    heads = x.shape[1]
    rep = heads // B.shape[1]
    if dt_limit_hits is not None and dt_limit_mask is not None:
        outside = outside_dt_limit(process_dt(dt, dt_bias), dt_limit) & ~dt_limit_mask
        bounds, src = cu_seqlens.tolist(), src_slots.tolist()
        for s in range(len(bounds) - 1):
            if src[s] >= 0 and outside[bounds[s]:bounds[s + 1]].any():
                dt_limit_hits[s] = 1
    dt = process_dt(dt, dt_bias, dt_limit, dt_limit_mask)
    out = torch.zeros_like(x)  # padding sequences and tokens past cu_seqlens[-1] stay zero
    bounds = cu_seqlens.tolist()
    src, dst = src_slots.tolist(), dst_slots.tolist()
    seq_saves = saves.by_sequence() if saves is not None else [[]] * (len(bounds) - 1)
    finals = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        if src[s] < 0:
            continue
        xs = x[lo:hi].float()
        bs = B[lo:hi].float().repeat_interleave(rep, dim=1)
        cs = C[lo:hi].float().repeat_interleave(rep, dim=1)
        state = ssm_states[src[s]].float()
        ends = [offset for offset, _ in seq_saves[s]] + [hi - lo]
        slots = [slot for _, slot in seq_saves[s]] + [dst[s]]
        begin = 0
        for j, end in enumerate(ends):  # segment by segment: the blocks restart at each save
            y, state = _ssd_one_sequence(xs[begin:end], dt[lo + begin:lo + end], A.float(), bs[begin:end],
                                         cs[begin:end], state)
            out[lo + begin:lo + end] = (y + D.float()[:, None] * xs[begin:end]).to(x.dtype)
            finals.append((slots[j], state))
            begin = end
    for slot, state in finals:  # after all reads: a dst may be another row's src
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def ssm_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: read state at src slot, write the new state at dst slot.

    x: [B, H, P]; dt: [B, H], processed, or raw when `dt_bias` [H] is given (then
    softplus(dt + dt_bias) is applied here, like mamba-ssm's `dt_softplus`); B, C:
    [B, G, N]; rows with src slot -1 are padding (output zeros, no state read or written).
    `dt_limit` is not applied, only checked: a live row with a dt outside it sets its
    `dt_limit_hits` [B] entry to 1. Returns y: [B, H, P] in x's dtype.
    """
    valid = src_slots >= 0
    heads = x.shape[1]
    rep = heads // B.shape[1]
    state = ssm_states[src_slots.clamp(min=0)].float()  # [B, H, P, N]
    xf, dtf = x.float(), process_dt(dt, dt_bias)
    if dt_limit_hits is not None:
        dt_limit_hits.masked_fill_(outside_dt_limit(dtf, dt_limit) & valid, 1)
    bh = B.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    ch = C.float().repeat_interleave(rep, dim=1)
    decay = torch.exp(dtf * A.float())[..., None, None]
    state = state * decay + (dtf[..., None] * xf)[..., None] * bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, ch) + D.float()[:, None] * xf
    rows = valid.nonzero().flatten()
    ssm_states[dst_slots[rows]] = state[rows].to(ssm_states.dtype)
    return torch.where(valid[:, None, None], y, torch.zeros_like(y)).to(x.dtype)


def ssm_state_verify(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """W tokens per row, position by position through `ssm_state_update`, the state after
    position j written to dst_slots[j] (see `causal_conv1d_verify`)."""
    return torch.stack(run_verify_positions(src_slots, dst_slots, lambda j, src, dst: ssm_state_update(
        ssm_states, x[:, j], dt[:, j], A, B[:, j], C[:, j], D, src, dst, dt_bias, dt_limit, dt_limit_hits)), dim=1)

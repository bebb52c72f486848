"""Mamba-2 mixer over per-request conv/SSM state slots.

Semantics follow mamba-ssm and transformers: in_proj -> (z, xBC, dt); depthwise causal
conv + SiLU over xBC; dt = softplus(dt + dt_bias); A = -exp(A_log); SSD scan with groups
and D skip; gated group RMSNorm (norm after gating); out_proj. Decode rows (one token,
state carried) take the recurrent update, prefill chunks the chunked scan; both read the
state at `mamba_src` and write it at `mamba_dst` (prefill chunks also at `state_saves`).

Tensor parallel (`tp`, world size N): each rank holds an even share of the heads and the
groups of B/C they read: a share of the groups when N divides their number, else the one
group its heads belong to. in_proj's z | x | B | C | dt rows, the conv channels x | B | C,
A_log / D / dt_bias and the norm scale are cut alike; out_proj sums the ranks' outputs.
When a group spans several ranks (N > n_groups) the gated norm's statistic is summed over
them (`gated_rms_norm_across_ranks`). `num_heads`, `n_groups`, `d_ssm`, `conv_dim` (and the
state slots) are this rank's.
"""
import torch
from torch import nn

from layers.forward_meta import ForwardMeta
from layers.kernels.ops import KernelOps
from layers.kernels.reference.ssd import clamps_dt
from layers.norms import gated_rms_norm_across_ranks
from layers.parallel import (SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear, Shard, block_shard,
                             set_shard)


def _fused_shards(heads: tuple[int, int], groups: tuple[int, int], num_heads: int, head_dim: int, n_groups: int,
                  state_size: int) -> tuple[Shard, Shard]:
    """The cuts of in_proj's rows (z | x | B | C | dt) and of the conv channels (x | B | C)
    that keep the heads [heads) and the groups [groups) of the full layer."""
    d_ssm, gs = num_heads * head_dim, n_groups * state_size
    xbc = [(0, head_dim, *heads), (d_ssm, state_size, *groups), (d_ssm + gs, state_size, *groups)]
    zxbcdt = [(0, head_dim, *heads), *((d_ssm + offset, unit, a, b) for offset, unit, a, b in xbc),
              (2 * d_ssm + 2 * gs, 1, *heads)]
    return block_shard(0, 2 * d_ssm + 2 * gs + num_heads, zxbcdt), block_shard(0, d_ssm + 2 * gs, xbc)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer run with the op set `ops`; the runner binds `conv_state` and
    `ssm_state` (slot pools)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        dt_limit: tuple[float, float],
        norm_eps: float,
        use_conv_bias: bool = True,
        proj_bias: bool = False,
        *,
        ops: KernelOps,
        tp: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.ops, self.tp = ops, tp
        if num_heads % n_groups:
            raise ValueError(f"mamba heads ({num_heads}) must be a multiple of n_groups ({n_groups})")
        h0, h1 = tp.split(num_heads)
        g0, g1 = tp.split_or_replicate(n_groups)
        self.num_heads, self.head_dim, self.n_groups, self.state_size = h1 - h0, head_dim, g1 - g0, state_size
        self.d_ssm = self.num_heads * head_dim
        self.conv_dim = self.d_ssm + 2 * self.n_groups * state_size
        # The gated norm's statistic is taken per group of the full model's channels; a
        # group split over ranks (more ranks than groups) sums it over them.
        self.norm_group_size = num_heads * head_dim // n_groups
        self.norm_group, self.norm_groups_full = g0, n_groups
        self.norm_spans_ranks = tp.world_size > n_groups
        in_shard, conv_shard = _fused_shards((h0, h1), (g0, g1), num_heads, head_dim, n_groups, state_size)
        head_shard = tp.shard(0, num_heads)
        # Applied to prompt tokens only: transformers clamps dt in its chunked (prefill)
        # scan and not in its recurrent (decode) update; mamba-ssm does the same.
        self.dt_limit = dt_limit
        self.norm_eps = norm_eps
        self.in_proj = ColumnParallelLinear(hidden_size, in_shard, bias=proj_bias, ops=ops)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias)
        for param in self.conv1d.parameters():
            set_shard(param, conv_shard)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for param in (self.dt_bias, self.A_log, self.D):
            set_shard(param, head_shard)
        self._a_cache: torch.Tensor | None = None
        self._a_key: tuple[int, int] | None = None
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.d_ssm))
        set_shard(self.norm.weight, tp.shard(0, num_heads, unit=head_dim))
        self.out_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=proj_bias, ops=ops, tp=tp)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K-1]
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, head_dim, state] (mamba_ssm_cache_dtype)

    def _a(self) -> torch.Tensor:
        """A = -exp(A_log) in float32, recomputed only when A_log changes (it is fixed after
        loading), so a decode step (or its CUDA graph) carries no kernels for it."""
        key = (self.A_log.data_ptr(), self.A_log._version)
        if self._a_key != key:
            self._a_cache, self._a_key = -torch.exp(self.A_log.detach().float()), key
        return self._a_cache

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        kernels = self.ops
        weight = self.conv1d.weight.squeeze(1)
        nd = meta.num_decode_tokens
        src, dst = meta.mamba_src[:nd], meta.mamba_dst[:nd]
        # A decode step (one token per row, no prompt) runs in_proj and the conv update as one
        # op: the kernel that writes a conv channel's projection convolves it.
        decode_step = meta.decode_width == 1 and not meta.num_prefill
        if decode_step:
            zxbcdt = kernels.linear_conv_update(x, self.in_proj.weight, self.in_proj.bias, self.d_ssm, weight,
                                                self.conv1d.bias, self.conv_state, src, dst)
        else:
            zxbcdt = self.in_proj(x)
        z, xbc, dt = zxbcdt.split([self.d_ssm, self.conv_dim, self.num_heads], dim=-1)
        a = self._a()
        # Generated tokens' dt is checked against the prompt-only limit (prefix caching:
        # `ForwardMeta.dt_limit_hits`): one entry per row, decode rows first.
        hits = meta.dt_limit_hits if clamps_dt(self.dt_limit) else None
        ys = []
        if meta.decode_width > 1:
            ys.append(self._verify(xbc[:nd], dt[:nd], a, weight, meta, hits))
        elif nd:
            xbc_d = xbc if decode_step else kernels.causal_conv1d_update(xbc[:nd], weight, self.conv1d.bias,
                                                                         self.conv_state, src, dst)
            ys.append(self._decode(xbc_d, dt[:nd], a, src, dst, None if hits is None else hits[:nd]))
        if meta.num_prefill:
            src, dst = meta.mamba_src[meta.num_decode:meta.num_seqs], meta.mamba_dst[meta.num_decode:meta.num_seqs]
            cu = meta.prefill_cu_seqlens
            saves = meta.state_saves
            xbc_p = kernels.causal_conv1d_varlen(xbc[nd:], weight, self.conv1d.bias, self.conv_state, cu, src, dst,
                                                 saves=saves)
            xs, b, c = self._split_xbc(xbc_p)
            ys.append(kernels.ssd_chunk_scan_varlen(
                xs, dt[nd:], a, b, c, self.D, cu, self.ssm_state, src, dst, self.dt_bias, self.dt_limit,
                meta.prompt_token_mask[nd:], saves, None if hits is None else hits[meta.num_decode:meta.num_seqs]))
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        y = y.reshape(x.shape[0], self.d_ssm)
        if self.norm_spans_ranks:
            y = gated_rms_norm_across_ranks(y, z, self.norm.weight, self.norm_eps, self.norm_group_size,
                                            self.norm_group, self.norm_groups_full, self.tp)
        else:
            y = kernels.gated_rms_norm(y, z, self.norm.weight, self.norm_eps, self.norm_group_size)
        return self.out_proj(y.to(x.dtype))

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, src: torch.Tensor,
                dst: torch.Tensor, hits: torch.Tensor | None) -> torch.Tensor:
        """One token per row (xbc already through the conv update), SSM state from `src` to
        `dst`. Decode tokens are generated tokens (no dt limit, only its check into `hits`):
        the update applies softplus(dt + dt_bias) itself."""
        xs, b, c = self._split_xbc(xbc)
        return self.ops.ssm_state_update(self.ssm_state, xs, dt, a, b, c, self.D, src, dst, self.dt_bias,
                                         self.dt_limit, hits)

    def _verify(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                meta: ForwardMeta, hits: torch.Tensor | None) -> torch.Tensor:
        """Verify rows: position by position, the same single-token update as a decode row,
        each position's state written to its own slot (`meta.verify_dst[j]`), so the state
        after any accepted draft can be committed without recomputation."""
        width, rows = meta.verify_dst.shape
        src, dst = meta.mamba_src[:rows], meta.verify_dst
        xbc = self.ops.causal_conv1d_verify(xbc.view(rows, width, -1), weight, self.conv1d.bias, self.conv_state,
                                            src, dst)
        gs = self.n_groups * self.state_size
        xs, b, c = xbc.split([self.d_ssm, gs, gs], dim=-1)
        y = self.ops.ssm_state_verify(self.ssm_state, xs.unflatten(-1, (self.num_heads, self.head_dim)),
                                      dt.view(rows, width, -1), a, b.unflatten(-1, (self.n_groups, self.state_size)),
                                      c.unflatten(-1, (self.n_groups, self.state_size)), self.D, src, dst,
                                      self.dt_bias, self.dt_limit, None if hits is None else hits[:rows])
        return y.flatten(0, 1)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = xbc.shape[0]
        gs = self.n_groups * self.state_size
        xs, b, c = xbc.split([self.d_ssm, gs, gs], dim=-1)
        return (xs.reshape(n, self.num_heads, self.head_dim), b.reshape(n, self.n_groups, self.state_size),
                c.reshape(n, self.n_groups, self.state_size))

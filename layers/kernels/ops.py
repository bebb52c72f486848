"""`KernelOps`: the one definition of every op the layers call, with its signature and contract.

Both op sets implement exactly these signatures: the torch reference ops
(`layers.kernels.reference`, the module itself satisfies the protocol) and the Triton fast
ops (`layers.kernels.triton.*`, offered family by family by `layers.kernels.fast`).
`tests/kernels/test_backend.py` checks every implementation's signature against this file.

Conventions shared by the ops:
- Packed tokens: T tokens of S sequences, `cu_seqlens` [S+1] int32 holds each sequence's
  start; tokens past `cu_seqlens[-1]` and rows of padding sequences come out as zeros.
- State slots: sequence s reads its state at `src_slots[s]` and writes the new state at
  `dst_slots[s]` (equal: in place; different: ping-pong, the old state stays intact). A
  row's dst must not be another row's src. Slot -1 marks padding: no state read or written.
- Mamba-2 shapes: H heads of P channels, G groups of B/C with state size N, SSM state
  [slots, H, P, N] float32 or `mamba_ssm_cache_dtype` (loaded as float32, computed in
  float32, rounded once when stored), conv state [slots, D, K-1] (the last K-1 inputs,
  oldest first).
"""
import math
from typing import NamedTuple, Protocol, runtime_checkable

import torch


class StateSaves(NamedTuple):
    """Mamba states a prefill step also writes from inside its chunks (prefix-cache
    checkpoints at interval positions, so a long prompt is not cut into chunks for them):
    prefill sequence s writes its conv and SSM state after its first `offsets[k]` tokens
    to slot `slots[k]`, for k in [cu[s], cu[s+1]). Within a sequence the offsets increase
    and lie strictly inside it (0 < offset < its length); a save slot is no sequence's src
    or dst. Scans restart their blocking at each offset, so a sequence's outputs and states
    are those of the same tokens cut into chunks there."""

    cu: torch.Tensor  # [S+1] int32: each prefill sequence's first save
    offsets: torch.Tensor  # [N] int32: tokens of the sequence before the saved state
    slots: torch.Tensor  # [N] int64: where the state goes

    def by_sequence(self) -> list[list[tuple[int, int]]]:
        """On the host, each prefill sequence's saves as (offset, slot) pairs (the
        reference ops walk them so)."""
        cu, offsets, slots = (t.tolist() for t in self)
        return [list(zip(offsets[a:b], slots[a:b])) for a, b in zip(cu, cu[1:])]


@runtime_checkable
class KernelOps(Protocol):
    """The ops of one kernel backend; an `OpSet` (or the reference module) provides them all."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
        """RMSNorm over the last dim with float32 statistics. `weight_in_fp32`: multiply by
        the weight in float32, then cast to x's dtype (NemotronH); else cast first and
        multiply in torch's promoted dtype (Granite)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     weight_in_fp32: bool = True,
                     residual_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and the RMSNorm after it: returns (rms_norm(new_residual), new_residual)
        with new_residual = residual + x * residual_scale, each step rounded to the activation
        dtype as the separate torch ops round it (the scaled x, then the sum), and the norm
        exactly `rms_norm`'s. x, residual: same shape and dtype. residual None: x starts the
        residual stream (new_residual is x; `residual_scale` must then be None)."""

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                       group_size: int) -> torch.Tensor:
        """Mamba-2 output norm rmsnorm_per_group(x * silu(z)) * weight (norm after gating).
        x, z: [T, D] (any row stride); weight: [D]; statistics per `group_size` channels."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias), as `F.linear`: x [..., K], weight [N, K], bias [N] or None;
        the result [..., N] in x's dtype, float32 accumulation. Any row count; the fast op
        has its own kernel for the few rows of a decode step."""

    def linear_conv_update(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_start: int,
                           conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, conv_states: torch.Tensor,
                           src_slots: torch.Tensor, dst_slots: torch.Tensor,
                           activation: str | None = "silu") -> torch.Tensor:
        """A Mamba-2 decode step's in_proj and conv update as one op: y = linear(x, weight,
        bias), then y's columns [conv_start, conv_start + D) replaced by
        `causal_conv1d_update` of them (D = conv_weight.shape[0], conv_start + D <= N; row
        b's state from `src_slots[b]` to `dst_slots[b]`, both [B], -1: a padding row, zeros
        there). x: [B, K], one decode token per row. Returns y [B, N] in x's dtype; the other
        columns are exactly `linear`'s."""

    def linear_relu_square(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """relu(linear(x, weight, bias))^2: NemotronH's MLP up projection and activation as
        one op. The projection rounds as `linear` does; the square is taken in float32 from
        it and rounded once to x's dtype, as torch.square(F.relu(y)) rounds. The fast op
        squares in the few-row kernel's store (one kernel at decode), else it runs one
        in-place relu^2 pass after the projection."""

    def linear_write_kv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kv_start: int,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """An attention layer's stacked q/k/v projection and its KV cache write as one op:
        y = linear(x, weight, bias), whose columns [kv_start, kv_start + 2 * kv_heads * head_dim)
        are each row's keys then values ([kv_heads, head_dim] each, the caches' last two dims),
        also written to the caches as `write_kv_cache` writes them (slot_mapping [rows], -1:
        not written). x: [rows, K]. Returns y [rows, N], exactly `linear`'s. The fast op
        writes the keys and values from the few-row kernel's store (no write kernel at
        decode), else runs `linear` then `write_kv_cache`."""

    def causal_conv1d_varlen(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, cu_seqlens: torch.Tensor, src_slots: torch.Tensor,
                             dst_slots: torch.Tensor, activation: str | None = "silu",
                             saves: StateSaves | None = None) -> torch.Tensor:
        """Depthwise causal conv over packed prefill chunks, continuing from each sequence's
        saved state. x: [T, D]; weight: [D, K]; bias: [D] or None. Returns [T, D] in x's
        dtype. `saves`: conv states also written from inside the sequences (`StateSaves`)."""

    def causal_conv1d_update(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                             activation: str | None = "silu") -> torch.Tensor:
        """One decode token per row: y = conv(state ++ x), state <- the last K-1 inputs.
        x: [B, D]. Returns [B, D] in x's dtype."""

    def ssd_chunk_scan_varlen(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, D: torch.Tensor, cu_seqlens: torch.Tensor, ssm_states: torch.Tensor,
                              src_slots: torch.Tensor, dst_slots: torch.Tensor, dt_bias: torch.Tensor | None = None,
                              dt_limit: tuple[float, float] = (0.0, math.inf),
                              dt_limit_mask: torch.Tensor | None = None,
                              saves: StateSaves | None = None,
                              dt_limit_hits: torch.Tensor | None = None) -> torch.Tensor:
        """Mamba-2 SSD scan over packed prefill chunks (how it blocks the scan is each
        implementation's choice: the result does not depend on it, up to rounding; with
        `saves`, SSM states also written from inside the sequences, the blocking restarts at
        each save, see `StateSaves`). x: [T, H, P]; A, D: [H];
        B, C: [T, G, N]. dt: [T, H] (any row stride) as the scan uses it, float32, or raw
        when `dt_bias` [H] is given: softplus(dt + dt_bias) in float32 is applied inside.
        Then the tokens where `dt_limit_mask` [T] bool is True (all tokens when None) are
        clamped to `dt_limit` (the default (0, inf): no clamp); see
        `layers.kernels.reference.ssd.process_dt`. `dt_limit_hits` ([S] int32, with a
        mask): sequence s's entry is set to 1 when one of its unmasked tokens has a dt
        outside `dt_limit` (see `ssm_state_update`). Returns y: [T, H, P] in x's dtype (D
        skip included, gate not applied)."""

    def ssm_state_update(self, ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, src_slots: torch.Tensor,
                         dst_slots: torch.Tensor, dt_bias: torch.Tensor | None = None,
                         dt_limit: tuple[float, float] = (0.0, math.inf),
                         dt_limit_hits: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token per row of the SSM recurrence. x: [B, H, P]; dt: [B, H] processed,
        or raw when `dt_bias` [H] is given (softplus(dt + dt_bias) is applied inside, like
        mamba-ssm's `dt_softplus`); B, C: [B, G, N]. Returns y: [B, H, P] in x's dtype.
        A decode token is a generated token: `dt_limit` is never applied to it, only checked
        when `dt_limit_hits` ([B] int32) is given: a live row with a head whose dt lies
        outside the limit gets its entry set to 1 (never cleared; prefix caching keeps what
        such a row computed out of the cache, since a prefill of the same tokens as a prompt
        would clamp that dt)."""

    def causal_conv1d_verify(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                             activation: str | None = "silu") -> torch.Tensor:
        """Verify rows (speculative decoding): W consecutive tokens per row, each the
        `causal_conv1d_update` of one token, the state after position j written to
        `dst_slots[j]`. x: [B, W, D] (any row and position stride); src_slots: [B] (-1: a
        padding row); dst_slots: [W, B] (-1: a padding position: output zeros, nothing
        written; the row's later positions are padding too). Returns [B, W, D] in x's dtype."""

    def ssm_state_verify(self, ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, src_slots: torch.Tensor,
                         dst_slots: torch.Tensor, dt_bias: torch.Tensor | None = None,
                         dt_limit: tuple[float, float] = (0.0, math.inf),
                         dt_limit_hits: torch.Tensor | None = None) -> torch.Tensor:
        """Verify rows: W consecutive tokens per row, each the `ssm_state_update` of one
        token, the state after position j written to `dst_slots[j]` (so any accepted prefix
        can be committed). x: [B, W, H, P]; dt: [B, W, H]; B, C: [B, W, G, N]; src_slots [B]
        and dst_slots [W, B] as in `causal_conv1d_verify`; `dt_limit` / `dt_limit_hits` as
        in `ssm_state_update`, over the row's live positions. Returns y: [B, W, H, P]."""

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        """Scatter this step's keys/values [T, kv_heads, head_dim] into their cache slots
        (cache [num_blocks, block_size, kv_heads, head_dim]; slot = block * block_size +
        offset, -1 = do not write)."""

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                        max_seqlen_q: int | None = None, num_decode: int = 0) -> torch.Tensor:
        """Causal attention of packed queries [T, H, Dh] against the paged cache; query i of
        sequence s sits at position seq_len - q_len + i. seq_lens: [S] keys after this step
        (0 = padding row). `max_seqlen_q` and `num_decode` (leading one-query sequences) are
        host-known shape hints. Returns [T, H, Dh] in q's dtype."""

    def route_sigmoid_grouped(self, x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor,
                              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """NemotronH router, from the hidden states x [T, H] and router_weight [E, H]: the
        logits x @ router_weight^T in float32 (float32 products and sums, as transformers
        casts both operands), sigmoid scores, and the correction bias steers the
        group-limited top-k choice only (group score: the sum of a group's two best).
        Returns (weights [T, k] float32, expert ids [T, k] int64); the order of the k is the
        implementation's (the fast op: best first, ties to the lowest expert index). The
        fast op takes a decode step's few rows in one kernel, logits included."""

    def route_softmax_topk(self, x: torch.Tensor, router_weight: torch.Tensor,
                           top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Granite router, from x [T, H] and router_weight [E, H]: top-k of the logits
        x @ router_weight^T (rounded to x's dtype, as `linear` rounds them, then routed in
        float32), softmax over the chosen k. Returns (weights [T, k] float32, expert ids
        [T, k] int64), best first (the fast op breaks ties to the lowest expert index)."""

    def moe_experts(self, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str, shared_up: torch.Tensor | None = None,
                    shared_down: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k w_k * down_e(act(up_e(x))) over each token's chosen experts, plus the shared
        expert down_s(act(up_s(x))) (same activation, no biases) when its weights are given.
        x: [T, H]; w_up: [E, I or 2I (swiglu: gate then up), H]; w_down: [E, H, I];
        shared_up: [S or 2S, H]; shared_down: [H, S]; activation 'relu2' or 'swiglu'.
        Accumulates in float32, returns x's dtype."""

    def logits_argmax(self, logits: torch.Tensor, divisor: float | None = None) -> torch.Tensor:
        """Greedy sampling from the LM head's raw output: per row, the argmax of
        `(logits / divisor).float()` (divisor None: `logits.float()`), the division rounded
        to logits' dtype as torch rounds it on logits' device, then the first index among
        equal maxima, a NaN counting as the maximum (torch.argmax's rule). logits: [rows, V];
        returns int64 [rows]. The fast op does the division, cast and argmax in one kernel."""


# Every op of the protocol, in definition order.
OP_NAMES: tuple[str, ...] = tuple(
    name for name, member in vars(KernelOps).items() if callable(member) and not name.startswith("_")
)

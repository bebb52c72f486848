"""Batched, on-device token sampling for one engine step.

Everything in :func:`sample` runs as tensor ops on the logits' device with no
host synchronisation (no ``.item()``, no data-dependent shapes, no Python
branches on tensor values), so a step with fixed shapes can be captured in a
CUDA graph. The keyword flags of :func:`sample` are host-side facts about the
batch and only choose which code paths are traced.

Randomness is counter-based: the noise for (row, vocab id) is a hash of the
row's ``(seed, output_pos)`` and the vocab id, computed with int64 tensor
arithmetic that gives the same bits on CPU and CUDA. A request therefore draws
the same token at the same output position no matter which batch, row or
replay of the step it lands in; there is no ``torch.Generator`` and no global
RNG state to keep in sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SamplingTensors",
    "SamplerOutput",
    "sample",
    "apply_penalties",
    "apply_token_masks",
    "top_logprobs",
    "filtered_logits",
    "filtered_probs",
    "uniform_noise",
    "mix64",
    "derive_seed",
    "GREEDY_BELOW_TEMPERATURE",
]

# --- 64-bit hashing -----------------------------------------------------------
# splitmix64 (Steele et al.; finaliser "Mix13" by Stafford). The same constants
# drive the pure-Python version (derive_seed, and the tests' reference) and the
# tensor version, so the two can be checked against each other bit for bit.

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB
_MIX_SHIFTS = (30, 27, 31)


def _as_int64(x: int) -> int:
    """Reinterpret an unsigned 64-bit value as the signed int64 with the same bits.

    torch has no usable unsigned 64-bit arithmetic, so the unsigned constants
    are fed to int64 tensors by their two's-complement value; multiplication and
    addition then wrap modulo 2**64 exactly like the unsigned originals.
    """
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix64_int(x: int) -> int:
    """splitmix64 finaliser on a Python int, result as an unsigned 64-bit int."""
    s1, s2, s3 = _MIX_SHIFTS
    x &= _MASK64
    x = ((x ^ (x >> s1)) * _MIX_MUL1) & _MASK64
    x = ((x ^ (x >> s2)) * _MIX_MUL2) & _MASK64
    return x ^ (x >> s3)


def _shr_logical(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Unsigned (logical) right shift of an int64 tensor, into a new tensor.

    ``>>`` on int64 is arithmetic (sign-extending); masking off the top
    ``shift`` bits afterwards yields what an unsigned shift would.
    """
    return (x >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """In-place :func:`mix64`; on [B, V] noise tensors in-place ops halve the CPU time."""
    s1, s2, s3 = _MIX_SHIFTS
    x.bitwise_xor_(_shr_logical(x, s1)).mul_(_as_int64(_MIX_MUL1))
    x.bitwise_xor_(_shr_logical(x, s2)).mul_(_as_int64(_MIX_MUL2))
    return x.bitwise_xor_(_shr_logical(x, s3))


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser applied elementwise to an int64 tensor (returns a new tensor).

    Bit-identical to the unsigned 64-bit algorithm (results are the same bits
    read as signed int64), and identical on every device because it uses only
    integer xor/shift/and and wrapping int64 multiplication.
    """
    return _mix64_(x.clone())


def derive_seed(engine_seed: int, counter: int) -> int:
    """Deterministic 63-bit seed for the ``counter``-th unseeded request of an engine.

    The engine gives every request a seed so the on-device sampler never needs
    global RNG state; unseeded requests get ``derive_seed(engine_seed, n)`` for a
    running counter ``n``, which makes a whole run reproducible from the engine
    seed while keeping different requests' streams unrelated. The result is in
    ``[0, 2**63)`` so it fits an int64 tensor.
    """
    state = _mix64_int(engine_seed) + (counter + 1) * _GOLDEN_GAMMA
    return _mix64_int(state) >> 1


def uniform_noise(seed: torch.Tensor, output_pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), one per (row, vocab id): a pure function of the inputs.

    Row ``b`` gets the splitmix64 stream keyed by ``(seed[b], output_pos[b])``
    and vocab id ``v`` takes element ``v`` of that stream, so a value never
    depends on the batch it is computed in. Returns float32 ``[B, vocab_size]``
    on ``seed``'s device.
    """
    gamma = _as_int64(_GOLDEN_GAMMA)
    # Two splitmix64 steps: seed -> per-request stream, position -> per-step key.
    key = mix64(mix64(seed) + (output_pos + 1) * gamma)
    vocab_offsets = torch.arange(1, vocab_size + 1, device=seed.device, dtype=torch.int64) * gamma
    bits = _mix64_(key[:, None] + vocab_offsets[None, :])
    # Top 23 bits -> odd multiples of 2**-24, which float32 holds exactly and
    # which avoid both 0 and 1 (so the log-log in the Gumbel transform is finite).
    return _shr_logical(bits, 41).mul_(2).add_(1).to(torch.float32).mul_(2.0**-24)


# Below this temperature, logits / temperature can overflow float32 (inf, then NaN): a row
# with a lower (nonzero) temperature samples greedily, the limit it tends to -- only exact
# ties could tell the two apart. Applied where a request's sampling row is built.
GREEDY_BELOW_TEMPERATURE = 1e-20


def apply_token_masks(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Structured outputs: the logits with -inf wherever a row's grammar forbids the token.

    `rows` [B] is each row's index into `masks` (-1: unconstrained), `masks` [M, ceil(V/8)]
    uint8 holds one bit per token id (bit t % 8 of byte t // 8). Applied before `sample`, as
    vLLM applies its grammar bitmask, so a constrained row's logprobs are those of the
    distribution it was sampled from.
    """
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    packed = masks[rows.clamp(min=0).long()][:, vocab >> 3]
    allowed = packed.bitwise_right_shift((vocab & 7).to(torch.uint8)).bitwise_and_(1).bool()
    return logits.masked_fill((rows >= 0)[:, None] & ~allowed, float("-inf"))


# --- Parameter / result containers -------------------------------------------------


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, as device tensors (one row per sequence that samples)."""

    temperature: torch.Tensor  # [B] float32; 0.0 means greedy (argmax of the penalized logits)
    top_k: torch.Tensor  # [B] int32; 0 (or >= vocab) means off
    top_p: torch.Tensor  # [B] float32 in (0, 1]; 1.0 means off
    min_p: torch.Tensor  # [B] float32 in [0, 1]; 0 means off
    # [B] float32; 1.0 means off. vLLM/HF semantics over prompt AND output
    # tokens: a seen token's logit > 0 is divided by the penalty, else multiplied.
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor  # [B] float32; logit -= presence * (count > 0), output tokens only
    frequency_penalty: torch.Tensor  # [B] float32; logit -= frequency * count, output tokens only
    seed: torch.Tensor  # [B] int64 per-request seed
    output_pos: torch.Tensor  # [B] int64 index of the drawn token within the request's output
    # [B, L] int64: prompt tokens then output tokens so far, padded (any pad
    # value); None when no row uses penalties.
    token_history: torch.Tensor | None = None
    prompt_len: torch.Tensor | None = None  # [B] int64 leading history entries that are prompt
    history_len: torch.Tensor | None = None  # [B] int64 valid history length (prompt + output)


@dataclass
class SamplerOutput:
    """Tokens drawn in one step, plus the requested logprobs of the raw logits."""

    sampled_token_ids: torch.Tensor  # [B] int64
    # [B, 1 + K] float32: logprob of the sampled token, then the top-K logprobs (descending)
    logprobs: torch.Tensor | None = None
    # [B, 1 + K] int64: sampled token id, then the top-K token ids
    logprob_token_ids: torch.Tensor | None = None


# --- Distribution shaping -------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Return float32 logits with repetition, then frequency/presence penalties applied.

    Rows with neutral parameters (1.0 / 0.0 / 0.0) come out unchanged, so the
    whole batch can take this path when any row needs it. Needs
    ``params.token_history``, ``prompt_len`` and ``history_len``. Does not
    modify ``logits``.
    """
    history, prompt_len, history_len = params.token_history, params.prompt_len, params.history_len
    if history is None or prompt_len is None or history_len is None:
        raise ValueError("apply_penalties needs token_history, prompt_len and history_len")
    logits = logits.to(torch.float32)
    positions = torch.arange(history.shape[1], device=history.device)[None, :]
    in_prompt = positions < prompt_len[:, None]
    in_output = (positions < history_len[:, None]) & ~in_prompt
    # Pad entries may hold any value; point them at id 0 with weight 0 so the
    # scatter never goes out of range and never counts them.
    token_ids = torch.where(positions < history_len[:, None], history, 0)

    def count(valid: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(logits)
        return counts.scatter_add_(1, token_ids, valid.to(torch.float32))

    output_counts = count(in_output)
    seen = (count(in_prompt) + output_counts) > 0

    rep = params.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return (
        logits
        - params.frequency_penalty[:, None] * output_counts
        - params.presence_penalty[:, None] * (output_counts > 0).to(torch.float32)
    )


def _top_k_top_p_drop_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens that top-k, then top-p on the survivors, remove.

    Works on one stable descending sort so ties are broken by vocab id, the same
    way on every device.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)
    keep = ranks < k[:, None]
    # top-p looks at the distribution that top-k left, renormalised.
    sorted_probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # A token stays if the tokens ranked above it hold less than top_p of the
    # mass; that keeps the smallest prefix reaching top_p and always the first
    # token. top_p >= 1 is exact "off", immune to the cumsum rounding to 1 early.
    # A top_p that underflows float32 to 0 still keeps the first token (rank 0).
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= (mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0) | (ranks == 0)
    return torch.empty_like(keep).scatter_(1, order, ~keep)


def filtered_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (dropped tokens at -inf).

    ``logits`` are the (already penalized) float32 logits. Greedy rows
    (temperature 0) are scaled by 1 here; :func:`sample` overrides their token
    with the argmax. The top token of every row always survives, so no row is
    ever all -inf.
    """
    temperature = params.temperature
    scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
    scaled.masked_fill_(_top_k_top_p_drop_mask(scaled, params.top_k, params.top_p), float("-inf"))
    # prob / max_prob == exp(logit - max_logit); no normalisation needed.
    relative = (scaled - scaled.amax(dim=-1, keepdim=True)).exp()
    scaled.masked_fill_(relative < params.min_p[:, None], float("-inf"))
    return scaled


def filtered_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The distribution :func:`sample` draws from for non-greedy rows: softmax of :func:`filtered_logits`."""
    return filtered_logits(logits, params).softmax(dim=-1)


# --- Sampling ----------------------------------------------------------------------


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of float32 ``logprobs`` and their token ids,
    largest first, equal values in ascending token id.

    ``torch.topk`` leaves the order of equal values to its kernel, which changes with
    ``k`` and the shape; since a step computes the most logprobs any of its rows asked
    for and each request keeps its own first n, a request's top-n would then depend on
    the other requests in its batch (ties are common among logits rounded to bfloat16).
    Here the first n of the top-k are the top-n for every k >= n, on every device: the
    selection runs on int64 keys, the value's float32 bits mapped to an order-preserving
    integer in the high half and the complement of the token id in the low half.
    """
    bits = logprobs.view(torch.int32)
    # Negative floats order backwards as integers: flip every bit but the sign.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(logprobs.shape[-1], device=logprobs.device, dtype=torch.int64)
    top_ids = (ordered * (1 << 32) - ids).topk(k, dim=-1).indices
    return logprobs.gather(1, top_ids), top_ids


def _gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the raw logits: sampled token first, then the top ``num_logprobs``."""
    logprobs = raw_logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids[:, None])
    top_values, top_ids = top_logprobs(logprobs, num_logprobs)
    return torch.cat((sampled, top_values), dim=1), torch.cat((token_ids[:, None], top_ids), dim=1)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    *,
    num_logprobs: int = -1,
    all_greedy: bool = False,
    use_penalties: bool = False,
) -> SamplerOutput:
    """Draw one token per row of ``logits`` [B, V] according to ``params``.

    Order (as vLLM): penalties -> greedy rows take the argmax -> temperature ->
    top-k -> top-p -> min-p -> draw. The draw is a Gumbel-max race with noise
    from :func:`uniform_noise`, so it depends only on the row's seed, output
    position and filtered distribution.

    The flags are host-known facts about the batch that only skip work:
    ``all_greedy`` skips filtering and noise, ``use_penalties`` enables
    :func:`apply_penalties` (needs the history tensors).
    ``num_logprobs >= 0`` returns ``1 + num_logprobs`` columns of logprobs of
    the raw logits (log_softmax before penalties/temperature/filters).
    """
    raw = logits.to(torch.float32)
    penalized = apply_penalties(raw, params) if use_penalties else raw
    tokens = penalized.argmax(dim=-1)
    if not all_greedy:
        scores = filtered_logits(penalized, params)
        # Gumbel-max: argmax(logit + G), G = -log(-log u), draws from softmax(logit).
        gumbel = uniform_noise(params.seed, params.output_pos, scores.shape[-1]).log_().neg_().log_().neg_()
        drawn = scores.add_(gumbel).argmax(dim=-1)
        tokens = torch.where(params.temperature == 0, tokens, drawn)
    if num_logprobs < 0:
        return SamplerOutput(sampled_token_ids=tokens)
    logprobs, logprob_ids = _gather_logprobs(raw, tokens, num_logprobs)
    return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs, logprob_token_ids=logprob_ids)

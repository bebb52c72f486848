"""Tests for hybrid_engine.sampling, each against something the code did not compute itself:
published splitmix64 test vectors, per-row Python references written from the
definitions (penalties, temperature/top-k/top-p/min-p), argmax for greedy, and
empirical frequencies of many seeded draws against the reference distribution (bounds
derived from the binomial standard deviation). Also counter-based determinism,
logprobs, and (on a GPU) CPU/CUDA agreement and graph capture."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybrid_engine.sampling import (
    SamplingTensors,
    apply_penalties,
    derive_seed,
    filtered_probs,
    mix64,
    sample,
    uniform_noise,
)
from hybrid_engine.sampling_params import SamplingParams


def make_params(batch: int, device: str | torch.device = "cpu", **rows: list) -> SamplingTensors:
    """SamplingTensors for ``batch`` rows: neutral defaults, overridden per field by lists of per-row values."""
    defaults = {
        "temperature": (1.0, torch.float32),
        "top_k": (0, torch.int32),
        "top_p": (1.0, torch.float32),
        "min_p": (0.0, torch.float32),
        "repetition_penalty": (1.0, torch.float32),
        "presence_penalty": (0.0, torch.float32),
        "frequency_penalty": (0.0, torch.float32),
        "seed": (0, torch.int64),
        "output_pos": (0, torch.int64),
    }
    fields = {
        name: torch.tensor(rows.get(name, [default] * batch), dtype=dtype, device=device)
        for name, (default, dtype) in defaults.items()
    }
    return SamplingTensors(**fields)


def with_history(
    params: SamplingTensors, histories: list[list[int]], prompt_lens: list[int], pad: int = -1
) -> SamplingTensors:
    """Attach padded token history (prompt then output tokens per row) to ``params``."""
    width = max(len(h) for h in histories)
    device = params.seed.device
    params.token_history = torch.tensor([h + [pad] * (width - len(h)) for h in histories], device=device)
    params.prompt_len = torch.tensor(prompt_lens, device=device)
    params.history_len = torch.tensor([len(h) for h in histories], device=device)
    return params


# --- Per-row Python references ------------------------------------------------------------


def ref_penalties(
    logits: list[float], history: list[int], prompt_len: int, rep: float, presence: float, frequency: float
) -> list[float]:
    """One row's penalized logits, written out token by token."""
    seen = set(history)
    out_counts: dict[int, int] = {}
    for tok in history[prompt_len:]:
        out_counts[tok] = out_counts.get(tok, 0) + 1
    result = []
    for tok, logit in enumerate(logits):
        if tok in seen:
            logit = logit / rep if logit > 0 else logit * rep
        count = out_counts.get(tok, 0)
        logit -= frequency * count + presence * (1 if count > 0 else 0)
        result.append(logit)
    return result


def ref_filtered_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """One row's sampling distribution after temperature, top-k, top-p and min-p."""
    vocab = len(logits)
    scaled = [x / (temperature if temperature > 0 else 1.0) for x in logits]
    order = sorted(range(vocab), key=lambda v: (-scaled[v], v))
    kept = order[: top_k if 0 < top_k < vocab else vocab]

    def softmax(tokens: list[int]) -> dict[int, float]:
        top = max(scaled[v] for v in tokens)
        weights = {v: math.exp(scaled[v] - top) for v in tokens}
        total = sum(weights.values())
        return {v: w / total for v, w in weights.items()}

    if top_p < 1.0:
        probs, prefix, mass = softmax(kept), [], 0.0
        for v in kept:
            prefix.append(v)
            mass += probs[v]
            if mass >= top_p:
                break
        kept = prefix
    probs = softmax(kept)
    max_prob = max(probs.values())
    kept = [v for v in kept if probs[v] >= min_p * max_prob]
    probs = softmax(kept)
    return [probs.get(v, 0.0) for v in range(vocab)]


# --- Hash and seeds -----------------------------------------------------------------------

# splitmix64 as published (Steele, Lea and Flood 2014; Vigna's splitmix64.c), on unsigned
# Python ints: next() adds the golden gamma to the state and returns the mixed state.
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def ref_splitmix64_mix(z: int) -> int:
    """The splitmix64 output function of one 64-bit state, written from the published algorithm."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def to_int64(u: int) -> int:
    """The signed int64 with the same bits as the unsigned 64-bit value `u`."""
    return u - (1 << 64) if u >= 1 << 63 else u


def test_reference_splitmix64_reproduces_published_vectors() -> None:
    """The test's own splitmix64 gives the published first outputs for two seeds."""
    expected = {
        # Seed 0: the first outputs every splitmix64 port reproduces.
        0: [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F],
        # Rosetta Code's SplitMix64 task, seed 1234567.
        1234567: [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                  16408922859458223821],
    }
    for seed, outputs in expected.items():
        states = [(seed + k * _GAMMA) & _MASK64 for k in range(1, len(outputs) + 1)]
        assert [ref_splitmix64_mix(s) for s in states] == outputs


def test_mix64_matches_published_splitmix64() -> None:
    """The int64 tensor hash has the bits of unsigned splitmix64: the published vectors and
    5000 random states (including the sign-bit edge cases) against the reference above."""
    published_state = to_int64((1234567 + _GAMMA) & _MASK64)
    assert mix64(torch.tensor([published_state])).tolist() == [to_int64(6457827717110365317)]
    rng = random.Random(0)
    values = [rng.getrandbits(64) for _ in range(5000)] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    got = mix64(torch.tensor([to_int64(v) for v in values]))
    assert got.tolist() == [to_int64(ref_splitmix64_mix(v)) for v in values]


def test_uniform_noise_is_a_pure_function_in_open_unit_interval() -> None:
    seed = torch.tensor([0, 7, -3, 2**62])
    pos = torch.tensor([0, 1, 5, 1000])
    first = uniform_noise(seed, pos, 4096)
    assert torch.equal(first, uniform_noise(seed, pos, 4096))
    assert bool((first > 0).all()) and bool((first < 1).all())
    # A row's noise does not depend on the other rows or the vocab width.
    assert torch.equal(uniform_noise(seed[2:3], pos[2:3], 100)[0], first[2, :100])


def test_uniform_noise_is_uniform() -> None:
    """262,144 noise values (64 (seed, position) rows x 4096 ids) fill 16 equal bins evenly."""
    noise = uniform_noise(torch.arange(64), torch.arange(64) * 7, 4096).flatten()
    counts = torch.histc(noise, bins=16, min=0.0, max=1.0)
    # Each bin count is Binomial(262144, 1/16): mean 16384, std ~124; bound ~5 std.
    assert (counts - noise.numel() / 16).abs().max() < 620, counts.tolist()


def test_consecutive_positions_are_uncorrelated() -> None:
    """First 1000 draws of one request from a fair coin: balanced, and no run structure."""
    n = 1000
    params = make_params(n, seed=[1234] * n, output_pos=list(range(n)))
    tokens = sample(torch.zeros(n, 2), params).sampled_token_ids.tolist()
    ones = sum(tokens)
    repeats = sum(a == b for a, b in zip(tokens, tokens[1:]))
    # Both counts are Binomial(~1000, 1/2): std ~16, bounds ~4 sigma.
    assert abs(ones - n / 2) < 65
    assert abs(repeats - (n - 1) / 2) < 65


def test_derive_seed_is_deterministic_63_bit_and_distinct() -> None:
    seeds = [derive_seed(42, i) for i in range(1000)]
    assert seeds == [derive_seed(42, i) for i in range(1000)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == len(seeds)
    assert derive_seed(43, 0) != derive_seed(42, 0)


# --- Penalties and filters ---------------------------------------------------------------


def test_apply_penalties_matches_reference() -> None:
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(4, vocab) * 3
    histories = [[1, 2, 2, 5, 5, 5], [0, 11, 3, 3], [], [7, 7, 8, 1, 9, 9, 2]]
    prompt_lens = [2, 4, 0, 3]
    penalties = {
        "repetition_penalty": [1.3, 0.8, 1.5, 1.0],
        "presence_penalty": [0.5, 0.0, 1.0, -0.4],
        "frequency_penalty": [0.25, 0.7, 0.0, 0.3],
    }
    params = with_history(make_params(4, **penalties), histories, prompt_lens)
    got = apply_penalties(logits, params)
    for row in range(4):
        expected = ref_penalties(
            logits[row].tolist(),
            histories[row],
            prompt_lens[row],
            penalties["repetition_penalty"][row],
            penalties["presence_penalty"][row],
            penalties["frequency_penalty"][row],
        )
        assert got[row].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_apply_penalties_requires_history() -> None:
    with pytest.raises(ValueError):
        apply_penalties(torch.zeros(1, 4), make_params(1))


@pytest.mark.parametrize(
    "rows",
    [
        {"top_k": [1, 3, 0, 25, 5, 2]},
        {"top_p": [0.05, 0.5, 0.9, 1.0, 0.3, 0.999]},
        {"min_p": [0.0, 0.05, 0.3, 0.9, 1.0, 0.1]},
        {
            "temperature": [0.5, 1.0, 2.0, 0.0, 1.3, 0.7],
            "top_k": [4, 0, 10, 6, 20, 8],
            "top_p": [0.8, 0.6, 1.0, 0.95, 0.4, 0.7],
            "min_p": [0.1, 0.0, 0.02, 0.2, 0.05, 0.0],
        },
    ],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_filtered_probs_match_reference(rows: dict[str, list[float]]) -> None:
    torch.manual_seed(1)
    batch, vocab = 6, 20
    logits = torch.randn(batch, vocab) * 2
    params = make_params(batch, **rows)
    got = filtered_probs(logits, params)
    for row in range(batch):
        values = {name: getattr(params, name)[row].item() for name in ("temperature", "top_k", "top_p", "min_p")}
        expected = ref_filtered_probs(logits[row].tolist(), **values)
        # Same support exactly, same probabilities up to float32 rounding.
        assert [p > 0 for p in got[row].tolist()] == [p > 0 for p in expected]
        assert got[row].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_p_one_keeps_tiny_tail_tokens() -> None:
    """top_p == 1.0 is exactly 'off' even when float32 cumsum saturates before the tail."""
    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0]])
    probs = filtered_probs(logits, make_params(1, top_p=[1.0]))  # min_p 0: off
    assert bool((probs > 0).all())


# --- Greedy --------------------------------------------------------------------------------


def test_all_greedy_is_argmax_of_penalized_logits() -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, 30)
    histories = [[int(logits[r].argmax())] for r in range(5)]
    params = with_history(make_params(5, temperature=[0.0] * 5, repetition_penalty=[3.0] * 5), histories, [1] * 5)
    expected = torch.tensor([
        max(range(30), key=ref_penalties(logits[r].tolist(), histories[r], 1, 3.0, 0.0, 0.0).__getitem__)
        for r in range(5)
    ])
    assert torch.equal(sample(logits, params, all_greedy=True, use_penalties=True).sampled_token_ids, expected)
    # The mixed-batch path gives the same for temperature-0 rows.
    assert torch.equal(sample(logits, params, use_penalties=True).sampled_token_ids, expected)
    # And the penalty really moved the argmax away from the repeated token.
    assert not torch.equal(expected, logits.argmax(dim=-1))


def test_greedy_rows_unaffected_by_other_rows_in_mixed_batch() -> None:
    torch.manual_seed(3)
    batch, vocab = 8, 64
    logits = torch.randn(batch, vocab)
    temperatures = [0.0, 1.0, 0.0, 2.0, 0.0, 0.5, 1.5, 0.0]
    params = make_params(
        batch,
        temperature=temperatures,
        top_k=[0, 3, 0, 10, 0, 0, 2, 0],
        top_p=[1.0, 0.5, 1.0, 0.9, 1.0, 0.3, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.0],
        seed=list(range(batch)),
    )
    tokens = sample(logits, params).sampled_token_ids
    greedy_rows = [i for i, t in enumerate(temperatures) if t == 0.0]
    assert torch.equal(tokens[greedy_rows], logits[greedy_rows].argmax(dim=-1))


# --- Counter-based determinism ------------------------------------------------------------------


def test_same_row_same_token_in_any_batch_or_position() -> None:
    torch.manual_seed(4)
    vocab = 1000
    row_logits = torch.randn(vocab)
    row = {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "seed": 987654321, "output_pos": 17}
    reference = sample(row_logits[None], make_params(1, **{k: [v] for k, v in row.items()})).sampled_token_ids

    for batch, at in [(2, 1), (7, 0), (7, 6), (33, 20)]:
        logits = torch.randn(batch, vocab) * 3
        logits[at] = row_logits
        others = make_params(
            batch,
            temperature=torch.rand(batch).tolist(),
            top_k=torch.randint(0, vocab, (batch,)).tolist(),
            seed=torch.randint(0, 2**62, (batch,)).tolist(),
            output_pos=torch.randint(0, 100, (batch,)).tolist(),
        )
        merged = {name: getattr(others, name).tolist() for name in row}
        for name, value in row.items():
            merged[name][at] = value
        tokens = sample(logits, make_params(batch, **merged)).sampled_token_ids
        assert tokens[at] == reference[0]


def test_draws_repeat_on_replay_and_vary_with_position() -> None:
    vocab, steps = 1000, 50
    logits = torch.zeros(steps, vocab)
    params = make_params(steps, seed=[5] * steps, output_pos=list(range(steps)))
    first = sample(logits, params).sampled_token_ids
    assert torch.equal(first, sample(logits, params).sampled_token_ids)
    # Uniform over 1000 tokens: 50 positions colliding much would mean a broken counter.
    assert len(set(first.tolist())) >= 45
    # The seed matters too.
    other_seed = make_params(steps, seed=[6] * steps, output_pos=list(range(steps)))
    assert not torch.equal(first, sample(logits, other_seed).sampled_token_ids)


def test_top_k_one_is_greedy_and_top_k_zero_is_off() -> None:
    """top_k=1 leaves only the argmax at any temperature; top_k=0 draws exactly what top_k=vocab does."""
    torch.manual_seed(7)
    n, vocab = 64, 50
    logits = torch.randn(n, vocab) * 2
    rows = {"temperature": [1.5] * n, "seed": list(range(n)), "output_pos": [3] * n}
    top1 = sample(logits, make_params(n, top_k=[1] * n, **rows)).sampled_token_ids
    assert torch.equal(top1, logits.argmax(dim=-1))
    off = sample(logits, make_params(n, top_k=[0] * n, **rows)).sampled_token_ids
    assert torch.equal(off, sample(logits, make_params(n, top_k=[vocab] * n, **rows)).sampled_token_ids)
    # At temperature 1.5 over 50 tokens most draws are not the argmax: top_k=0 really is off.
    assert (off != top1).sum() > n // 2


@pytest.mark.parametrize(
    "row",
    [
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 0.7, "top_k": 5, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 0.8, "min_p": 0.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.2},
        {"temperature": 1.3, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_draws_follow_the_reference_distribution(row: dict[str, float]) -> None:
    """20,000 seeded draws from one row: filtered-out tokens never appear, and every token's
    frequency matches the reference distribution. bf16 logits are accepted."""
    n, vocab = 20_000, 10
    logits = torch.tensor([1.5, 1.2, 1.0, 0.6, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5], dtype=torch.bfloat16)
    # 20k distinct (seed, position) pairs: 2000 requests x 10 positions each.
    params = make_params(n, seed=[i // 10 for i in range(n)], output_pos=[i % 10 for i in range(n)],
                         **{name: [value] * n for name, value in row.items()})
    tokens = sample(logits.expand(n, -1), params).sampled_token_ids
    expected = torch.tensor(ref_filtered_probs(logits.float().tolist(), **row))
    freqs = torch.bincount(tokens, minlength=vocab).float() / n
    assert bool((freqs[expected == 0] == 0).all())
    # A frequency's std is sqrt(p(1-p)/n) <= 0.0036; allow ~4.5 std.
    bound = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-9
    assert bool(((freqs - expected).abs() <= bound).all()), (freqs.tolist(), expected.tolist())


# --- Logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_are_raw_log_softmax(k: int) -> None:
    torch.manual_seed(5)
    batch, vocab = 4, 40
    logits = torch.randn(batch, vocab, dtype=torch.float16)
    params = with_history(
        make_params(batch, temperature=[0.0, 0.7, 1.0, 2.0], frequency_penalty=[1.0] * batch, seed=[1, 2, 3, 4]),
        [[0, 1, 2, 3]] * batch,
        [0] * batch,
    )
    out = sample(logits, params, num_logprobs=k, use_penalties=True)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == (batch, 1 + k) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.shape == (batch, 1 + k) and out.logprob_token_ids.dtype == torch.int64
    raw = logits.float().log_softmax(dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top = raw.topk(k, dim=-1)
    assert torch.equal(out.logprobs[:, 1:], top.values)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)


def test_top_logprobs_order_ties_by_token_id_for_every_k() -> None:
    """Equal logprobs come in ascending token id, so a row's top-n is the first n of its
    top-k for any k >= n and does not change with the other rows of the batch (a step
    computes the most logprobs any row asked for; torch.topk orders ties as its kernel
    happens to). Float16 logits of a small range tie often, as bfloat16 ones do."""
    torch.manual_seed(3)
    logits = (torch.randn(6, 300) * 4).round().to(torch.float16)  # many equal values per row
    raw = logits.float().log_softmax(dim=-1)
    by_value_then_id = [sorted(range(300), key=lambda t, r=r: (-raw[r, t].item(), t)) for r in range(6)]
    for k in (1, 3, 8, 20):
        for rows in (slice(0, 6), slice(2, 3), slice(1, 5)):
            out = sample(logits[rows], make_params(len(range(6)[rows])), num_logprobs=k, all_greedy=True)
            for i, r in enumerate(range(6)[rows]):
                assert out.logprob_token_ids[i, 1:].tolist() == by_value_then_id[r][:k], (k, r)
                assert out.logprobs[i, 1:].tolist() == raw[r, by_value_then_id[r][:k]].tolist()
    assert any(raw[r, a] == raw[r, b] for r in range(6) for a, b in zip(by_value_then_id[r][:20],
                                                                        by_value_then_id[r][1:20]))


def test_no_logprobs_by_default() -> None:
    out = sample(torch.randn(2, 8), make_params(2))
    assert out.logprobs is None and out.logprob_token_ids is None


# --- No host synchronisation ----------------------------------------------------------------------


@pytest.mark.parametrize("all_greedy", [False, True])
def test_sample_runs_on_meta_tensors(all_greedy: bool) -> None:
    """Meta tensors have no data: any .item()/.tolist(), value branch or
    data-dependent shape inside sample() would raise here."""
    batch, vocab = 3, 50
    params = with_history(make_params(batch, device="meta"), [[1, 2]] * batch, [1] * batch)
    out = sample(
        torch.empty(batch, vocab, device="meta"), params, num_logprobs=2, all_greedy=all_greedy, use_penalties=True
    )
    assert out.sampled_token_ids.shape == (batch,)
    assert out.logprobs is not None and out.logprobs.shape == (batch, 3)


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_matches_cpu_and_is_graph_capturable() -> None:
    torch.manual_seed(6)
    batch, vocab = 64, 32_000
    logits = torch.randn(batch, vocab) * 2
    params_cpu = with_history(
        make_params(
            batch,
            temperature=torch.rand(batch).mul(1.5).tolist(),
            top_k=torch.randint(0, 100, (batch,)).tolist(),
            top_p=torch.rand(batch).mul(0.5).add(0.5).tolist(),
            min_p=torch.rand(batch).mul(0.1).tolist(),
            repetition_penalty=[1.2] * batch,
            frequency_penalty=[0.3] * batch,
            seed=torch.randint(0, 2**62, (batch,)).tolist(),
            output_pos=torch.randint(0, 1000, (batch,)).tolist(),
        ),
        torch.randint(0, vocab, (batch, 40)).tolist(),
        [20] * batch,
    )
    params_gpu = SamplingTensors(**{k: v.cuda() for k, v in params_cpu.__dict__.items()})
    kwargs = {"num_logprobs": 3, "use_penalties": True}

    # The hash is integer-only, so its bits must agree exactly.
    assert torch.equal(mix64(params_gpu.seed).cpu(), mix64(params_cpu.seed))
    assert torch.equal(
        uniform_noise(params_gpu.seed, params_gpu.output_pos, vocab).cpu(),
        uniform_noise(params_cpu.seed, params_cpu.output_pos, vocab),
    )
    expected = sample(logits, params_cpu, **kwargs).sampled_token_ids

    logits_gpu = logits.cuda()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside sample() raises
    try:
        eager = sample(logits_gpu, params_gpu, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(eager.sampled_token_ids.cpu(), expected)

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits_gpu, params_gpu, **kwargs)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = sample(logits_gpu, params_gpu, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.sampled_token_ids.cpu(), expected)


def test_parameters_at_float32_underflow_behave_as_their_limit(make_llm) -> None:
    """A temperature that would overflow logits / temperature in float32 samples greedily, and
    a top_p that underflows float32 to 0 keeps the top token: both equal greedy decoding
    (before, the first gave NaN garbage and the second always token 0)."""
    llm = make_llm(max_num_seqs=4)
    prompt = [(7 * i + 3) % 256 for i in range(12)]
    greedy, tiny_t, tiny_p = llm.generate(
        [prompt] * 3,
        [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=1e-40, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=1.0, top_p=5e-324, seed=3, ignore_eos=True)],
        use_tqdm=False)
    assert len(set(greedy.output_token_ids)) > 1  # a real continuation, not one repeated id
    assert tiny_t.output_token_ids == greedy.output_token_ids
    assert tiny_p.output_token_ids == greedy.output_token_ids

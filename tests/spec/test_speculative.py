"""Speculative decoding end to end (CPU, float32, the embedded model): a request's tokens
and logprobs with speculation equal those without, for every proposer (oracle, adversarial,
partially wrong, n-gram, broken), greedy and seeded, serial and launch-ahead (with injected
rejections), under KV pressure, chunked prefill, stops, penalties and aborts; and the
counters say what was proposed and accepted."""
import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from tests.engine.engine_helpers import assert_drained, byte_prompt, drive
from tests.spec.proposers import (AdversarialProposer, OracleProposer, OutOfVocabProposer, PartialProposer,
                                  RaisingProposer)

K = 4
MODES = {"serial": dict(async_scheduling=False), "async": dict(async_scheduling=True),
         "async-rejections": dict(async_scheduling=True, inject_rejection_rate=0.3)}


def _params(i: int, max_tokens: int = 24, **kw) -> SamplingParams:
    """Alternately greedy and seeded sampling (top-p, top-k), some with penalties."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i,
                          ignore_eos=True, **kw)


def _workload(n: int = 6, **kw) -> list[tuple[str, list[int], SamplingParams]]:
    # Repetitive prompts give the n-gram proposer something to find.
    return [(f"r{i}", byte_prompt(5 + 7 * i, i) * 2, _params(i, **kw)) for i in range(n)]


def _run(workload, **engine_kw) -> tuple[dict, dict]:
    """Outputs by request id, and the engine's stats, after driving the workload."""
    llm = LLM(device="cpu", dtype="float32", seed=7, **{"max_num_seqs": 4, **engine_kw})
    run = drive(llm.engine, [(i % 3, rid, prompt, params) for i, (rid, prompt, params) in enumerate(workload)])
    assert_drained(llm.engine)
    return run.finals, llm.engine.stats()


def _truth(workload, finals) -> dict[str, list[int]]:
    return {rid: prompt + finals[rid].output_token_ids for rid, prompt, _ in workload}


def _assert_same(finals, expected, logprobs: bool = False) -> None:
    assert finals.keys() == expected.keys()
    for rid, out in expected.items():
        got = finals[rid]
        assert got.output_token_ids == out.output_token_ids, rid
        assert (got.finish_reason, got.stop_reason, got.text) == (out.finish_reason, out.stop_reason, out.text), rid
        if logprobs:
            for mine, theirs in zip(got.logprobs, out.logprobs):
                assert mine.keys() == theirs.keys(), rid
                assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine), rid


@pytest.fixture(scope="module")
def baseline():
    workload = _workload()
    finals, stats = _run(workload, async_scheduling=False)
    assert stats["spec_steps"] == 0
    return workload, finals


@pytest.mark.parametrize("mode", MODES)
def test_oracle_proposer_accepts_nearly_everything_and_changes_nothing(baseline, mode):
    workload, expected = baseline
    proposer = OracleProposer(_truth(workload, expected))
    spec = {"method": "proposer", "proposer": proposer, "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
    _assert_same(finals, expected)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_steps"] > 0
    if "rejections" not in mode:
        assert stats["spec_accepted_tokens"] >= 0.95 * stats["spec_proposed_tokens"], stats
        # Up to K+1 tokens per verify step: far fewer steps than tokens.
        total = sum(len(o.output_token_ids) for o in finals.values())
        assert stats["steps"] < total / 2, stats


@pytest.mark.parametrize("mode", MODES)
def test_adversarial_proposer_accepts_nothing_and_changes_nothing(baseline, mode):
    workload, expected = baseline
    spec = {"method": "proposer", "proposer": AdversarialProposer(_truth(workload, expected)),
            "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
    _assert_same(finals, expected)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] == 0, stats


@pytest.mark.parametrize("mode", MODES)
def test_partially_wrong_proposer_changes_nothing(baseline, mode):
    workload, expected = baseline
    spec = {"method": "proposer", "proposer": PartialProposer(_truth(workload, expected), rate=0.25),
            "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
    _assert_same(finals, expected)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats


@pytest.mark.parametrize("mode", MODES)
def test_ngram_changes_nothing(baseline, mode):
    workload, expected = baseline
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
    _assert_same(finals, expected)
    assert stats["spec_proposed_tokens"] > 0, stats


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_logprobs_and_penalties_per_accepted_position(mode):
    """Each accepted position's logprobs come from its own logits, and the penalties of the
    row of draft j see the drafts before it (outputs, logprobs equal within 1e-5)."""
    workload = _workload(4, logprobs=3, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    expected, _ = _run(workload, **MODES[mode])
    spec = {"method": "proposer", "proposer": OracleProposer(_truth(workload, expected)), "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
    _assert_same(finals, expected, logprobs=True)
    assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"] > 0, stats


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_kv_pressure_chunked_prefill_and_limits(mode):
    """Few KV blocks (pauses, evictions), a small token budget (chunked prefill, drafts cut
    to fit), max_tokens and the context limit inside a verify row: outputs unchanged."""
    # The last request reaches the context limit (prompt 38 + 26 = 64 tokens).
    workload = [(f"r{i}", byte_prompt(4 + 3 * i, i) * 2, _params(i, max_tokens=10 + 3 * i + (i == 5)))
                for i in range(6)]
    engine_kw = dict(num_kv_blocks=24, kv_block_size=4, max_num_batched_tokens=16, max_model_len=64, **MODES[mode])
    expected, base_stats = _run(workload, **engine_kw)
    spec = {"method": "proposer", "proposer": PartialProposer(_truth(workload, expected), rate=0.2),
            "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **engine_kw)
    _assert_same(finals, expected)
    assert stats["pauses"] + stats["evictions"] > 0 and stats["spec_accepted_tokens"] > 0, stats


def test_stops_inside_accepted_drafts():
    """A stop token or stop string met inside an accepted run ends the request there: the
    later accepted tokens are discarded, as without speculation."""
    base = _workload(4, max_tokens=30)
    expected, _ = _run(base, async_scheduling=False)
    workload = []
    for i, (rid, prompt, params) in enumerate(base):
        out = expected[rid].output_token_ids
        stop = {"stop_token_ids": [out[7]]} if i % 2 == 0 else {"stop": [expected[rid].text[9:11]]}
        workload.append((rid, prompt, _params(i, max_tokens=30, **stop)))
    expected, _ = _run(workload, async_scheduling=False)
    assert all(o.finish_reason == "stop" for o in expected.values())
    spec = {"method": "proposer", "proposer": OracleProposer(_truth(base, _run(base, async_scheduling=False)[0])),
            "num_speculative_tokens": K}
    for mode in ("serial", "async"):
        finals, stats = _run(workload, speculative_config=spec, **MODES[mode])
        _assert_same(finals, expected)


def test_aborts_with_drafts_in_flight():
    workload = _workload(6, max_tokens=40)
    expected, _ = _run(workload)
    spec = {"method": "proposer", "proposer": OracleProposer(_truth(workload, expected)), "num_speculative_tokens": K}
    llm = LLM(device="cpu", dtype="float32", seed=7, max_num_seqs=4, speculative_config=spec)
    run = drive(llm.engine, [(0, rid, p, s) for rid, p, s in workload], aborts={3: ["r1"], 5: ["r4", "r5"]})
    assert_drained(llm.engine)
    for rid, out in run.finals.items():
        if out.finish_reason == "abort":
            assert out.output_token_ids == expected[rid].output_token_ids[: len(out.output_token_ids)]
        else:
            assert out.output_token_ids == expected[rid].output_token_ids


def test_broken_proposers_cost_only_drafts(caplog):
    """A proposer that raises for one request (proposing and forgetting it), or returns ids
    outside the vocabulary, costs those drafts only (logged once per request); outputs are
    unchanged and every block and slot comes back (`_run` checks)."""
    workload = _workload(4)
    expected, _ = _run(workload)
    for proposer in (RaisingProposer("r1"), OutOfVocabProposer()):
        caplog.clear()
        spec = {"method": "proposer", "proposer": proposer, "num_speculative_tokens": K}
        finals, stats = _run(workload, speculative_config=spec)
        _assert_same(finals, expected)
        warnings = [r for r in caplog.records if "proposer failed" in r.getMessage()]
        assert 1 <= len(warnings) <= len(workload)
        assert len({w.getMessage().split("request ")[1].split(" ")[0] for w in warnings}) == len(warnings)
        forgets = [r for r in caplog.records if "forget failed for request r1" in r.getMessage()]
        assert len(forgets) == isinstance(proposer, RaisingProposer)


def test_backs_off_when_every_draft_is_rejected(baseline):
    """With acceptance at zero, requests draft exponentially less often: most verify rows
    are never launched, so most steps are plain decode steps."""
    workload, expected = baseline
    proposer = AdversarialProposer(_truth(workload, expected))
    spec = {"method": "proposer", "proposer": proposer, "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, async_scheduling=False)
    decode_rows = sum(len(o.output_token_ids) - 1 for o in finals.values())
    assert proposer.calls < decode_rows / 3, (proposer.calls, decode_rows)


def _committed_states(engine, record_all: bool) -> dict:
    """Wrap engine._retire: after each retirement, the committed Mamba state (every layer)
    of each live request, keyed by (request id, tokens committed). With `record_all`
    False only requests whose verify row just rejected a draft are recorded."""
    states, retire = {}, engine._retire

    def recording_retire(handle, samples):
        retired = retire(handle, samples)
        for r in (retired.advanced if record_all else retired.mispredicted):
            if r.state is not None:
                slot = r.state.committed
                states[(r.request_id, r.num_computed)] = (engine.mamba.conv_states[:, slot].clone(),
                                                          engine.mamba.ssm_states[:, slot].clone())
        return retired

    engine._retire = recording_retire
    return states


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_state_after_partial_acceptance_equals_non_speculative_state(mode):
    """After a verify row accepts some drafts and rejects the next, the committed conv and
    SSM states equal (within 1e-5) a non-speculative run's states at the same position."""
    workload = _workload(4, max_tokens=30)
    llm = LLM(device="cpu", dtype="float32", seed=7, max_num_seqs=4, **MODES[mode])
    expected = _committed_states(llm.engine, record_all=True)
    run = drive(llm.engine, [(0, rid, p, s) for rid, p, s in workload])
    spec = {"method": "proposer", "proposer": PartialProposer(_truth(workload, run.finals), rate=0.3),
            "num_speculative_tokens": K}
    llm = LLM(device="cpu", dtype="float32", seed=7, max_num_seqs=4, speculative_config=spec, **MODES[mode])
    partial = _committed_states(llm.engine, record_all=False)
    drive(llm.engine, [(0, rid, p, s) for rid, p, s in workload])
    assert len(partial) >= 10
    for key, (conv, ssm) in partial.items():
        want_conv, want_ssm = expected[key]
        torch.testing.assert_close(conv, want_conv, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(ssm, want_ssm, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


class _OnlyFor(OracleProposer):
    """The oracle, for one request only."""

    def __init__(self, truth: dict[str, list[int]], request_id: str):
        super().__init__(truth)
        self.request_id = request_id

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        return super().propose(request_id, token_ids, num_tokens) if request_id == self.request_id else []


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_large_batch_verifies_only_when_enough_rows_draft(mode):
    """With 16 decode rows, drafts for one request alone would widen all 16 rows: they are
    dropped (no verify step, the same tokens); drafts for every request are verified."""
    workload = _workload(16, max_tokens=40)
    expected, _ = _run(workload, max_num_seqs=16, **MODES[mode])
    truth = _truth(workload, expected)
    for proposer, verified in ((_OnlyFor(truth, "r3"), False), (OracleProposer(truth), True)):
        spec = {"method": "proposer", "proposer": proposer, "num_speculative_tokens": K}
        finals, stats = _run(workload, speculative_config=spec, max_num_seqs=16, **MODES[mode])
        _assert_same(finals, expected)
        assert proposer.calls > 0
        if verified:
            assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"] > 16 * K, stats
        else:  # (verified only once the batch, finishing, is down to the always-verify size)
            assert stats["spec_proposed_tokens"] <= 2 * K, stats


def test_dropped_drafts_give_their_blocks_back():
    """One request drafts in a batch of 10 (sparse: dropped). The blocks reserved for its
    drafts go back before the step launches, so the steady-decode fast path (checked
    against the general path by the tests) sees the block tables it expects; every
    request ends normally with the plain engine's tokens."""
    class OneRowProposer:
        def propose(self, request_id, token_ids, num_tokens):
            return [1] * num_tokens if request_id == "r0" else []

    arrivals = [(0, f"r{i}", byte_prompt(6, i), _params(0, max_tokens=20)) for i in range(10)]
    outputs = []
    for spec in (None, {"method": "proposer", "proposer": OneRowProposer(), "num_speculative_tokens": 1}):
        llm = LLM(device="cpu", dtype="float32", seed=7, max_num_seqs=10, kv_block_size=4, speculative_config=spec)
        outputs.append(drive(llm.engine, arrivals).finals)
        assert_drained(llm.engine)
    _assert_same(outputs[1], outputs[0])
    assert all(out.finish_reason == "length" for out in outputs[1].values())


def test_proposer_may_return_numpy_ids():
    workload = _workload(2)
    expected, _ = _run(workload)
    proposer = OracleProposer(_truth(workload, expected))

    class NumpyProposer:
        def propose(self, request_id, token_ids, num_tokens):
            return np.array(proposer.propose(request_id, token_ids, num_tokens), dtype=np.int64)

    spec = {"method": "proposer", "proposer": NumpyProposer(), "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec)
    _assert_same(finals, expected)
    assert stats["spec_accepted_tokens"] > 0, stats


def test_a_row_without_drafts_leaves_the_budget_to_the_next_rows():
    """The token budget and KV blocks are charged for the drafts a row gets, not for the room
    it had: with a budget of 6, r0 (no drafts) leaves r1 room for K drafts every step."""
    workload = _workload(2, max_tokens=40)
    engine_kw = dict(max_num_batched_tokens=6, async_scheduling=False)
    expected, _ = _run(workload, **engine_kw)
    spec = {"method": "proposer", "proposer": _OnlyFor(_truth(workload, expected), "r1"), "num_speculative_tokens": K}
    finals, stats = _run(workload, speculative_config=spec, **engine_kw)
    _assert_same(finals, expected)
    # r1's 40 tokens in verify rows of up to K+1: about 40 / (K+1) rows of K drafts each.
    assert stats["spec_proposed_tokens"] >= 0.7 * 40 * K / (K + 1), stats

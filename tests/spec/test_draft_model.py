"""The "draft_model" method end to end (CPU, float32, tiny HF checkpoints): coupled drafting
(a draft model equal to the target proposes the target's own tokens, greedy and seeded,
penalties included: every draft is accepted), outputs and logprobs equal non-speculative
decoding with any draft model, proposals resume from the draft engine's checkpoints (only
the new tokens are computed), aborts and stops, failure isolation, and config errors.
(HF parity with a draft model: tests/models/test_hf_oracle_paths.py.)"""
import dataclasses
import logging
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.engine import LLMEngine
from hybrid_engine.spec.draft_model import DRAFT_CHECKPOINTS_PER_SEQ
from tests.engine.engine_helpers import assert_drained, drive
from tests.models.conftest import make_hf_checkpoint

K = 4
MODEL = "nemotron_moe_sharp_open"
MODES = {"serial": dict(async_scheduling=False), "async": dict(async_scheduling=True),
         "async-rejections": dict(async_scheduling=True, inject_rejection_rate=0.3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The target, the target with 5% noise on its weights (a draft that agrees in part),
    another random checkpoint of its architecture, and one with a different vocabulary."""
    paths = {name: str(tmp_path_factory.mktemp(name)) for name in ("target", "close", "other", "vocab")}
    make_hf_checkpoint(paths["target"], MODEL)
    shutil.copytree(paths["target"], paths["close"], dirs_exist_ok=True)
    weights = load_file(f"{paths['close']}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.is_floating_point() and v.numel() > 1
             else v for k, v in weights.items()}
    save_file(noisy, f"{paths['close']}/model.safetensors", metadata={"format": "pt"})
    make_hf_checkpoint(paths["other"], MODEL, seed=1)
    make_hf_checkpoint(paths["vocab"], "granite_dense_nope")
    return paths


def _params(i: int, max_tokens: int = 24, **kw) -> SamplingParams:
    """Alternately greedy and seeded sampling (top-p, top-k, penalties on some)."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i,
                          ignore_eos=True, repetition_penalty=1.2 if i % 4 == 1 else 1.0,
                          frequency_penalty=0.3 if i % 4 == 3 else 0.0, **kw)


def _workload(n: int = 6, **kw) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", [3 + (7 * i + 5 * j) % 90 for j in range(6 + 9 * i)], _params(i, **kw)) for i in range(n)]


def _run(target: str, workload, aborts=None, **engine_kw):
    """(final outputs by request id, stats, the engine) after driving the workload."""
    llm = LLM(target, device="cpu", dtype="float32", seed=7, **{"max_num_seqs": 4, **engine_kw})
    run = drive(llm.engine, [(i % 3, rid, prompt, params) for i, (rid, prompt, params) in enumerate(workload)],
                aborts=aborts)
    assert_drained(llm.engine)
    if llm.engine.draft_engine is not None:
        assert_drained(llm.engine.draft_engine)
    return run.finals, llm.engine.stats(), llm.engine


def _assert_same(finals, expected) -> None:
    assert finals.keys() == expected.keys()
    for rid, out in expected.items():
        got = finals[rid]
        assert got.output_token_ids == out.output_token_ids, rid
        assert (got.finish_reason, got.stop_reason) == (out.finish_reason, out.stop_reason), rid
        for mine, theirs in zip(got.logprobs or [], out.logprobs or []):
            assert mine.keys() == theirs.keys(), rid
            assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine), rid


def _draft(model: str, **kw) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K, **kw}


@pytest.mark.parametrize("mode", MODES)
def test_draft_equal_to_target_accepts_everything(checkpoints, mode):
    """Coupled drafting: the draft samples each position with the target's parameters, seed
    and history, so a draft equal to the target proposes the target's tokens."""
    workload = _workload(logprobs=2)
    expected, _, _ = _run(checkpoints["target"], workload, **MODES[mode])
    finals, stats, engine = _run(checkpoints["target"], workload, speculative_config=_draft(checkpoints["target"]),
                                 **MODES[mode])
    _assert_same(finals, expected)
    assert stats["spec_accepted_tokens"] >= 0.99 * stats["spec_proposed_tokens"] > 0, stats
    total = sum(len(o.output_token_ids) for o in finals.values())
    assert stats["steps"] < total / 2, stats
    # Each proposal resumes from the draft engine's checkpoint at the target's committed
    # end: it computes the tokens committed since, not the whole context again.
    prompts = sum(len(p) for _, p, _ in workload)
    draft = engine.draft_engine.stats()
    assert prompts <= draft["prefill_tokens"] <= prompts + 2 * total, (draft, prompts, total)


@pytest.mark.parametrize("mode", MODES)
def test_another_draft_model_changes_nothing(checkpoints, mode):
    workload = _workload(logprobs=2)
    expected, _, _ = _run(checkpoints["target"], workload, **MODES[mode])
    finals, stats, _ = _run(checkpoints["target"], workload, speculative_config=_draft(checkpoints["other"]),
                            **MODES[mode])
    _assert_same(finals, expected)
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"], stats


def test_a_draft_model_of_a_shorter_context_drafts_up_to_it(checkpoints, tmp_path):
    """A draft checkpoint with fewer positions than the target's context: the engine starts
    (max_model_len is checked against the target's model only), the draft engine's context
    is its own, and the outputs are the non-speculative ones."""
    import json

    short = tmp_path / "short"
    shutil.copytree(checkpoints["target"], short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 40
    (short / "config.json").write_text(json.dumps(config))
    workload = _workload()
    expected, _, _ = _run(checkpoints["target"], workload, max_model_len=96)
    finals, stats, engine = _run(checkpoints["target"], workload, max_model_len=96,
                                 speculative_config=_draft(str(short)))
    _assert_same(finals, expected)
    assert engine.max_model_len == 96 and engine.draft_engine.max_model_len == 40
    assert stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_proposals_compute_only_new_tokens_with_a_partly_right_draft(checkpoints, mode):
    """Whatever a proposal's drafts were, the next proposal of the request resumes at the
    target's committed end (its checkpoint is kept while the request lives, and the one it
    superseded is evicted first): the draft engine prefills each prompt once, then only the
    tokens committed since and the drafts in flight -- long prompts, partial acceptance,
    back-off (requests that skip drafting while the others go on)."""
    workload = [(f"r{i}", [3 + (11 * i + 5 * j) % 90 for j in range(n)], _params(i, max_tokens=40))
                for i, n in enumerate((700, 60, 1300, 90))]
    expected, _, _ = _run(checkpoints["target"], workload, **MODES[mode])
    finals, stats, engine = _run(checkpoints["target"], workload, speculative_config=_draft(checkpoints["close"]),
                                 **MODES[mode])
    _assert_same(finals, expected)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    prompts = sum(len(p) for _, p, _ in workload)
    outputs = sum(len(o.output_token_ids) for o in finals.values())
    draft = engine.draft_engine.stats()
    assert prompts <= draft["prefill_tokens"] <= prompts + 2 * outputs, (draft, prompts, outputs)


def test_kv_pressure_chunked_prefill_stops_and_aborts(checkpoints):
    """A tiny token budget and KV pool (pauses or evictions of the target's requests), stop
    tokens met inside accepted drafts, and aborts with drafts in flight: outputs unchanged."""
    engine_kw = dict(max_num_batched_tokens=7, num_kv_blocks=16, kv_block_size=4)
    plain = _workload(6, max_tokens=12)
    reference, _, _ = _run(checkpoints["target"], plain, **engine_kw)
    workload = [(rid, prompt, dataclasses.replace(params, stop_token_ids=[reference[rid].output_token_ids[9]]))
                for rid, prompt, params in plain]
    expected, _, _ = _run(checkpoints["target"], workload, **engine_kw)
    assert all(o.finish_reason == "stop" for o in expected.values())
    aborts = {4: ["r1"], 9: ["r4"]}
    finals, stats, _ = _run(checkpoints["target"], workload, aborts=aborts,
                            speculative_config=_draft(checkpoints["target"]), **engine_kw)
    assert stats["pauses"] + stats["evictions"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    for rid, out in finals.items():
        want = expected[rid].output_token_ids
        if out.finish_reason == "abort":
            assert out.output_token_ids == want[: len(out.output_token_ids)], rid
        else:
            assert (out.output_token_ids, out.finish_reason, out.stop_reason) == (
                want, "stop", expected[rid].stop_reason), rid


def test_a_failing_draft_model_costs_only_drafts(checkpoints, caplog, monkeypatch):
    workload = _workload(4)
    expected, _, _ = _run(checkpoints["target"], workload)
    llm = LLM(checkpoints["target"], device="cpu", dtype="float32", seed=7, max_num_seqs=4,
              speculative_config=_draft(checkpoints["target"]))

    def broken(queries):
        raise RuntimeError("draft model broke")

    monkeypatch.setattr(llm.engine.drafter.draft_model, "propose", broken)
    with caplog.at_level(logging.ERROR):
        run = drive(llm.engine, [(0, rid, p, s) for rid, p, s in workload])
    _assert_same(run.finals, expected)
    assert llm.engine.stats()["spec_proposed_tokens"] == 0
    assert sum("draft model failed" in r.getMessage() for r in caplog.records) == 1


def test_an_error_inside_the_draft_engine_leaves_nothing_behind(checkpoints, caplog, monkeypatch):
    """An error that escapes a draft-engine step (here: its scheduler, every 5th call) ends
    that step's proposals: the target's outputs are unchanged, and the draft engine holds
    no request, block or state slot afterwards."""
    workload = _workload(4)
    expected, _, _ = _run(checkpoints["target"], workload)
    llm = LLM(checkpoints["target"], device="cpu", dtype="float32", seed=7, max_num_seqs=4,
              speculative_config=_draft(checkpoints["target"]))
    scheduler = llm.engine.draft_engine.scheduler
    schedule, calls = scheduler.schedule, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) % 5 == 0:
            raise RuntimeError("draft scheduler broke")
        return schedule(*args, **kwargs)

    monkeypatch.setattr(scheduler, "schedule", flaky)
    draft_model, draft = llm.engine.drafter.draft_model, llm.engine.draft_engine
    propose, live_after_a_call = draft_model.propose, []

    def checked(queries):
        try:
            return propose(queries)
        finally:  # every proposal of the call has ended (aborted if the step failed)
            live_after_a_call.extend(r for r in draft.requests.values() if not r.finished)

    monkeypatch.setattr(draft_model, "propose", checked)
    with caplog.at_level(logging.ERROR):
        run = drive(llm.engine, [(0, rid, p, s) for rid, p, s in workload])
    _assert_same(run.finals, expected)
    assert len(calls) >= 5 and llm.engine.stats()["spec_accepted_tokens"] > 0
    assert not live_after_a_call
    while draft.has_unfinished_requests():  # (aborted proposals' final outputs)
        draft.step()
    assert_drained(draft)


@pytest.mark.parametrize("model, message", [
    ("vocab", "speculative_config.model .* vocabulary of 64 tokens; the target's has 96"),
    ("/no/such/dir", "speculative_config.model: model must be"),
    ("preset:no-such-preset", "speculative_config.model"),
])
def test_bad_draft_models_name_the_field(checkpoints, model, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoints["target"], device="cpu", speculative_config=_draft(checkpoints.get(model, model)))


def test_the_draft_model_shares_the_memory_budget(checkpoints, monkeypatch):
    """`_size_pools` on a (simulated) CUDA device: a draft whose pools cost what the
    target's cost leaves about half the KV blocks, and the draft's bytes per request come
    out of the budget before max_num_seqs is chosen."""
    engine = LLM(checkpoints["target"], device="cpu", dtype="float32", max_num_seqs=4).engine
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 3 << 30))
    fake = types.SimpleNamespace(
        config=dataclasses.replace(engine.config, num_kv_blocks=None, gpu_memory_utilization=1.0),
        model_config=engine.model_config, max_model_len=1 << 30, state_banks=engine.state_banks,
        state_positions=engine.state_positions, _user_max_num_seqs=True, device=torch.device("cuda"),
        model=engine.model, group=None)
    fake.kv_blocks_floor = lambda: 1
    fake._pool_bytes = lambda *args: LLMEngine._pool_bytes(fake, *args)
    own = fake._pool_bytes(engine.model.pool_shape(), engine.model_config.conv_kernel - 1, "float32",
                           engine.state_banks)
    seqs, alone, _ = LLMEngine._size_pools(fake)
    seqs_shared, shared, _ = LLMEngine._size_pools(fake, own)
    assert seqs == seqs_shared == 4
    left = alone * own.per_block  # what the KV cache got alone (to a block)
    extra = seqs * (own.per_seq + DRAFT_CHECKPOINTS_PER_SEQ * own.per_slot)  # the draft's states
    assert abs(shared - (left - extra) // (2 * own.per_block)) <= 1, (alone, shared)

"""Launch-ahead (async) scheduling must give exactly the serial engine's outputs, on every
path where a launched step gets rejected, and restore Mamba state bit for bit."""
import pytest
import torch

from hybrid_engine import LLM, SamplingParams

PROMPTS = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 30, 7, 50, 12, 9, 20, 4))]


def _params(i: int, max_tokens: int = 24, **overrides) -> SamplingParams:
    base = dict(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
    return SamplingParams(**{**base, **overrides})


def run(async_scheduling: bool, params: list[SamplingParams], prompts=PROMPTS, arrive_every: int = 2,
        abort_after: dict[str, int] | None = None, **engine_kwargs) -> tuple[dict, dict]:
    """Staggered arrivals into engine.add_request/step; returns ({id: (tokens, reason, text)}, stats)."""
    kwargs = {"max_num_seqs": 6, "kv_block_size": 16, "seed": 1, **engine_kwargs}
    engine = LLM(async_scheduling=async_scheduling, **kwargs).engine
    pending, results, step = list(enumerate(prompts)), {}, 0
    abort_after = abort_after or {}
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params[i])
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.output_token_ids, out.finish_reason, out.text)
            elif len(out.output_token_ids) >= abort_after.get(out.request_id, 1 << 30):
                engine.abort_request(out.request_id)
        step += 1
        assert step < 5000, "engine made no progress"
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_mamba_slots"] == stats["total_mamba_slots"]
    return results, stats


def assert_same(serial: dict, launched: dict) -> None:
    assert serial.keys() == launched.keys()
    for rid in serial:
        assert launched[rid] == serial[rid], f"request {rid} differs"


def test_greedy_and_seeded_staggered():
    params = [_params(i) for i in range(len(PROMPTS))]
    serial, s_stats = run(False, params)
    launched, stats = run(True, params)
    assert_same(serial, launched)
    assert s_stats["launch_ahead_steps"] == 0
    assert stats["launch_ahead_steps"] > stats["steps"] // 2


@pytest.mark.parametrize("rate", [0.1, 0.5, 1.0])
def test_injected_rejections_leave_outputs_unchanged(rate):
    params = [_params(i) for i in range(len(PROMPTS))]
    serial, _ = run(False, params)
    launched, stats = run(True, params, inject_rejection_rate=rate)
    assert_same(serial, launched)
    assert stats["rejected_launches"] > 0 and stats["state_restores"] > 0


def test_pauses_and_evictions_under_kv_pressure():
    params = [_params(i, max_tokens=40) for i in range(len(PROMPTS))]
    serial, _ = run(False, params, num_kv_blocks=12)
    launched, stats = run(True, params, num_kv_blocks=12, inject_rejection_rate=0.3)
    assert_same(serial, launched)
    assert stats["pauses"] > 0 and stats["evictions"] > 0 and stats["launch_ahead_steps"] > 0


def test_kv_block_boundary_crossings():
    params = [_params(i, max_tokens=30) for i in range(4)]
    serial, _ = run(False, params, prompts=PROMPTS[:4], kv_block_size=4)
    launched, stats = run(True, params, prompts=PROMPTS[:4], kv_block_size=4, inject_rejection_rate=0.2)
    assert_same(serial, launched)
    assert stats["launch_ahead_steps"] > 0


def test_chunked_prefill_of_arrivals_while_others_decode():
    prompts = [PROMPTS[0], list(range(3, 90)), PROMPTS[2], list(range(10, 70))]
    params = [_params(i, max_tokens=20) for i in range(4)]
    serial, _ = run(False, params, prompts=prompts, max_num_batched_tokens=8, arrive_every=5)
    launched, stats = run(True, params, prompts=prompts, max_num_batched_tokens=8, arrive_every=5)
    assert_same(serial, launched)
    assert stats["launch_ahead_steps"] > 0


def _greedy_reference(prompt: list[int], max_tokens: int = 24) -> tuple[list[int], str]:
    out = LLM(async_scheduling=False).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    return out.output_token_ids, out.text


@pytest.mark.parametrize("finish", ["stop_token", "stop_string", "eos", "length"])
def test_finish_at_a_launch_ahead_boundary(finish):
    """The request ends while its next step is already launched: that row must be dropped."""
    prompts = list(PROMPTS[:4])
    if finish == "eos":  # a prompt whose greedy continuation emits EOS within max_tokens
        prompts[1] = list("héllo wörld 🙂".encode())
    tokens, text = _greedy_reference(prompts[1])
    k = 9  # finish on the 10th token
    if finish == "stop_token":
        override = dict(stop_token_ids=[tokens[k]])
    elif finish == "stop_string":
        override = dict(stop=[text[len(text) // 2: len(text) // 2 + 2]])
    elif finish == "eos":
        override = dict(ignore_eos=False)
    else:
        override = dict(max_tokens=k + 1)
    params = [_params(i, **override) if i == 1 else _params(i) for i in range(4)]
    params[1] = SamplingParams(**{**params[1].to_dict(), "temperature": 0.0})
    serial, _ = run(False, params, prompts=prompts)
    launched, stats = run(True, params, prompts=prompts)
    assert_same(serial, launched)
    if finish != "length":  # a surely-final sample is never launched past
        assert serial["1"][1] == "stop"
        assert stats["rejected_launches"] > 0


def test_abort_mid_flight():
    params = [_params(i, max_tokens=30) for i in range(5)]
    aborts = {"1": 4, "3": 11}
    serial, _ = run(False, params, prompts=PROMPTS[:5], abort_after=aborts)
    launched, stats = run(True, params, prompts=PROMPTS[:5], abort_after=aborts)
    assert_same(serial, launched)
    assert serial["1"][1] == serial["3"][1] == "abort"
    assert stats["rejected_launches"] > 0


def test_rejected_launch_restores_mamba_state_bit_exactly():
    """Snapshot every row's input state at launch-ahead; after rejection the committed
    state of each live request must equal it bit for bit."""
    engine = LLM(async_scheduling=True, inject_rejection_rate=1.0, max_num_seqs=4, seed=3).engine
    mamba = engine.mamba
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    checked = []
    launch, reconcile = engine._launch, engine._reconcile

    def spying_launch(sched, prev):
        if prev is not None:  # a launch-ahead: record what each (already scheduled) row will read
            snapshots.clear()
            for chunk in sched.chunks:
                r, src = chunk.request, chunk.state_src
                snapshots[id(r)] = (r, mamba.conv_states[:, src].clone(), mamba.ssm_states[:, src].clone())
        return launch(sched, prev)

    def spying_reconcile(ahead, retired):
        result = reconcile(ahead, retired)
        assert result is not ahead  # rate 1.0 rejects every launch-ahead
        for r, conv, ssm in snapshots.values():
            if not r.finished:
                slot = r.state.committed
                assert torch.equal(mamba.conv_states[:, slot], conv)
                assert torch.equal(mamba.ssm_states[:, slot], ssm)
                checked.append(r.request_id)
        return result

    engine._launch, engine._reconcile = spying_launch, spying_reconcile
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, _params(i, max_tokens=12))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 20
    assert engine.stats()["state_restores"] >= len(checked)


def test_steady_decode_fast_path_runs_checked_and_catches_a_wrong_field(monkeypatch):
    """Most launch-ahead decode steps take the runner's steady-state fast path; with the
    tests' HYBRID_ENGINE_CHECK_FAST_PATHS=1 each is compared with the general path, and
    the comparison does catch a wrong field."""
    params = [_params(i, max_tokens=40) for i in range(4)]
    llm = LLM(async_scheduling=True, max_num_seqs=6, kv_block_size=16, seed=1)
    runner = llm.engine.runner
    assert runner.check_steady_decode
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    serial = LLM(async_scheduling=False, max_num_seqs=6, kv_block_size=16, seed=1).generate(
        PROMPTS[:4], params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in serial]
    assert runner.num_steady_steps > 20  # of ~40 decode steps: not the first, nor a step entering a KV block

    original = runner._write_steady_decode

    def off_by_one_position(sched, prev):
        plan = original(sched, prev)
        if plan is not None:
            runner.buffer.host_group("token_i64")[1, 0] += 1
        return plan

    monkeypatch.setattr(runner, "_write_steady_decode", off_by_one_position)
    # The failed check fails the step: its requests end with the message, nothing hangs.
    failed = llm.generate(PROMPTS[:2], params[:2], use_tqdm=False)
    assert [o.finish_reason for o in failed] == ["error", "error"]
    assert all("fast path differs" in o.error for o in failed)
    stats = llm.engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_mamba_slots"] == stats["total_mamba_slots"]

"""The lifecycle's `fail` event: a step that raises ends exactly the requests it touched with
finish_reason "error" and a message, returns their KV blocks and Mamba state, and the engine
keeps serving: everyone else's tokens are those of a run without the failure."""
import pytest

from tests.engine.engine_helpers import assert_drained, byte_prompt, drive, greedy, seeded


def _work():
    """Five requests through an engine of two rows: a failing step holds only some of them."""
    return [
        (0, "a", byte_prompt(9, 1), greedy(12)),
        (0, "b", byte_prompt(20, 2), seeded(12, seed=3)),
        (1, "c", byte_prompt(5, 3), greedy(10, logprobs=2)),
        (4, "d", byte_prompt(14, 4), seeded(9, seed=4)),
        (9, "e", byte_prompt(6, 5), greedy(8)),
    ]


@pytest.fixture(scope="module")
def clean_runs():
    from tests.conftest import _make_llm

    return {mode: drive(_make_llm(max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=mode).engine,
                        _work()).finals for mode in (False, True)}


def _fail_at(engine, name, calls_that_fail) -> list[set[str]]:
    """Make `engine.runner.<name>` raise on the given (0-based) calls; returns, per fault,
    the ids of the requests with rows in unretired steps at that moment (the step being
    prepared or launched, and the launch-ahead neighbour)."""
    original = getattr(engine.runner, name)
    count, in_flight = [0], []

    def flaky(*args, **kwargs):
        count[0] += 1
        if count[0] - 1 in calls_that_fail:
            in_flight.append({c.request.request_id for s in engine._unretired for c in s.chunks})
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    setattr(engine.runner, name, flaky)
    return in_flight


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("where", ["prepare", "launch"])
def test_failed_step_ends_only_its_requests(make_llm, clean_runs, async_scheduling, where):
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    engine = llm.engine
    in_flight = _fail_at(engine, where, {3, 11})
    run = drive(engine, _work())
    assert len(in_flight) == 2
    errored = {rid for rid, out in run.finals.items() if out.finish_reason == "error"}
    assert errored, "the injected faults ended no request"
    for rid in errored:
        assert "injected fault" in run.finals[rid].error
    # Only requests with a row in flight at a fault failed.
    assert errored <= in_flight[0] | in_flight[1]
    # Everyone else is untouched: the same tokens as a run without failures.
    clean = clean_runs[async_scheduling]
    survivors = set(clean) - errored
    assert survivors
    for rid in survivors:
        assert run.finals[rid].output_token_ids == clean[rid].output_token_ids, rid
        assert run.finals[rid].finish_reason == clean[rid].finish_reason, rid
    assert_drained(engine)
    # The engine still serves.
    after = llm.generate([byte_prompt(9, 1)], greedy(12), use_tqdm=False)[0]
    assert after.output_token_ids == clean["a"].output_token_ids


def test_failure_while_waiting_for_samples_releases_both_steps(make_llm):
    """A fault surfacing in the wait (e.g. a device error) with a launch-ahead step in
    flight ends the requests of both steps and returns everything."""
    llm = make_llm(max_num_seqs=4, async_scheduling=True)
    engine = llm.engine
    launch = engine.runner.launch
    calls = [0]

    def launch_with_failing_wait(plan):
        handle = launch(plan)
        calls[0] += 1
        if calls[0] == 5:
            def broken_wait():
                raise RuntimeError("device fault")
            handle.wait = broken_wait
        return handle

    engine.runner.launch = launch_with_failing_wait
    run = drive(engine, _work()[:3])
    assert all(out.finish_reason == "error" for out in run.finals.values())
    assert all("device fault" in out.error for out in run.finals.values())
    assert_drained(engine)


def test_an_error_touching_no_request_is_raised(make_llm):
    """A fault in scheduling touches no launched row: it is the engine's own and propagates
    (nothing is silently retried); the queued request is not lost."""
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", byte_prompt(5), greedy(3))
    schedule = engine.scheduler.schedule

    def broken_schedule(*args, **kwargs):
        engine.scheduler.schedule = schedule  # fails once
        raise RuntimeError("injected fault")

    engine.scheduler.schedule = broken_schedule
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    run = drive(engine, [])
    assert run.finals["a"].finish_reason == "length"
    assert_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_failure_in_the_admitting_step_leaves_the_pool_clean(make_llm, async_scheduling):
    """A fault in the step that admits requests (before their new state slots are zeroed)
    ends them alone: requests admitted later into the same slots run normally."""
    llm = make_llm(max_num_seqs=2, async_scheduling=async_scheduling)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", byte_prompt(5, i), greedy(4))
    in_flight = _fail_at(engine, "prepare", {0})
    run = drive(engine, [])
    assert in_flight == [{"r0", "r1"}]
    assert {rid: out.finish_reason for rid, out in run.finals.items()} == {
        "r0": "error", "r1": "error", "r2": "length", "r3": "length"}
    for rid in ("r2", "r3"):
        solo = make_llm(max_num_seqs=1).generate([byte_prompt(5, int(rid[1]))], greedy(4), use_tqdm=False)[0]
        assert run.finals[rid].output_token_ids == solo.output_token_ids
    assert_drained(engine)


def test_fault_draining_a_rejected_launch_keeps_finished_outputs(make_llm):
    """Request a finishes at step N; N+1 is rejected whole and drained, and that drain raises.
    a's final output (decided before the fault) still comes out, b ends with the error, and
    nothing stays unfinished."""
    llm = make_llm(async_scheduling=True, inject_rejection_rate=1.0)
    engine = llm.engine
    engine.add_request("a", byte_prompt(5, 1), greedy(2))
    engine.add_request("b", byte_prompt(5, 2), greedy(20))
    reconcile = engine._reconcile

    def reconcile_with_failing_drain(ahead, retired):
        if retired.finished:
            def broken_wait():
                raise RuntimeError("device fault")
            ahead.wait = broken_wait
            engine._reconcile = reconcile
        return reconcile(ahead, retired)

    engine._reconcile = reconcile_with_failing_drain
    run = drive(engine, [])
    assert run.finals["a"].finish_reason == "length" and len(run.finals["a"].output_token_ids) == 2
    assert run.finals["b"].finish_reason == "error" and "device fault" in run.finals["b"].error
    assert_drained(engine)

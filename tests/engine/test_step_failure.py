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


def _interrupt_at(engine, obj, name, call) -> None:
    """Make `obj.<name>` raise KeyboardInterrupt (Ctrl-C) on its `call`-th (0-based) call."""
    original, count = getattr(obj, name), [0]

    def interrupted(*args, **kwargs):
        count[0] += 1
        if count[0] - 1 == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    setattr(obj, name, interrupted)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("where", ["launch", "retire"])
def test_an_interrupted_step_ends_its_requests_then_raises(make_llm, clean_runs, async_scheduling, where):
    """Ctrl-C inside a step (the device launch, or the bookkeeping that retires a step)
    leaves it as half done as an error: the requests it touched end with "error" (their
    outputs come with the next step), every block and slot comes back, and the others
    decode exactly as without the interrupt. It used to leave rows in flight that no step
    retired: later steps failed every request, and aborts leaked their slots."""
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    engine = llm.engine
    if where == "launch":
        _interrupt_at(engine, engine.runner, "launch", 5)
    else:
        _interrupt_at(engine, engine.scheduler, "retire", 5)
    with pytest.raises(KeyboardInterrupt):
        drive(engine, _work())
    run = drive(engine, [])
    errored = {rid for rid, out in run.finals.items() if out.finish_reason == "error"}
    assert errored and all("KeyboardInterrupt" in run.finals[rid].error for rid in errored)
    clean = clean_runs[async_scheduling]
    for rid in set(run.finals) - errored:
        assert run.finals[rid].output_token_ids == clean[rid].output_token_ids, rid
    assert_drained(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_generate_interrupted_leaves_the_llm_ready(make_llm, clean_runs, async_scheduling):
    """Ctrl-C in `generate`: its requests leave the engine with their resources, again and
    again (each used to leak its rows' slots until generate hung), and the next call gives
    the tokens of an uninterrupted one."""
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    prompts, params = [p for _, _, p, _ in _work()], [s for _, _, _, s in _work()]
    for attempt in range(4):
        _interrupt_at(llm.engine, llm.engine.runner, "launch", 2 + attempt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
        llm.engine.runner.launch = type(llm.engine.runner).launch.__get__(llm.engine.runner)
        assert_drained(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    clean = clean_runs[async_scheduling]
    assert [o.output_token_ids for o in outs] == [clean[rid].output_token_ids for _, rid, _, _ in _work()]


def test_an_error_finish_has_the_text_its_stream_carried(make_llm):
    """A request that fails while text is held back (it may start a stop string) ends with
    `text` equal to what its stream carried: the held-back tail goes to neither."""
    llm = make_llm(async_scheduling=False)
    engine, prompt = llm.engine, byte_prompt(7, 2)
    free = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    # A stop string that starts with an ASCII character the request generates (and never
    # completes): from that token on, its text is held back.
    at = next(i for i, t in enumerate(free.output_token_ids) if i >= 1 and 33 <= t < 127)
    params = greedy(8, stop=[chr(free.output_token_ids[at]) + "\x00never"])
    _fail_at(engine, "launch", {at + 1})  # the step after that token (serial: a launch per step)
    engine.add_request("r", prompt, params)
    stream = []
    while engine.has_unfinished_requests():
        stream += engine.step()
    final = stream[-1]
    assert final.finish_reason == "error" and len(final.output_token_ids) == at + 1
    assert "".join(out.new_text for out in stream) == final.text
    assert final.output_token_ids == free.output_token_ids[:at + 1]
    assert_drained(engine)

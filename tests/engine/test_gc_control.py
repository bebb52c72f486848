"""The engine owns Python's garbage collection only while it has requests."""
import gc

import pytest

from hybrid_engine import SamplingParams
from hybrid_engine import gc_control


@pytest.fixture(autouse=True)
def restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_automatic_gc_off_while_busy_and_back_when_idle(make_llm):
    engine = make_llm().engine
    gc.enable()
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    assert not gc.isenabled()
    while engine.has_unfinished_requests():
        engine.step()
    assert gc.isenabled()


def test_a_process_without_automatic_gc_keeps_it_off(make_llm):
    engine = make_llm().engine
    gc.disable()
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not gc.isenabled()


def test_a_failing_step_gives_gc_back(make_llm, monkeypatch):
    engine = make_llm().engine
    gc.enable()
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))

    def broken_schedule(*args, **kwargs):
        raise RuntimeError("scheduler exploded")

    monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
    with pytest.raises(RuntimeError, match="exploded"):
        engine.step()
    assert gc.isenabled()


def test_collection_cadence(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_control.gc, "collect", lambda generation=2: calls.append(generation))
    gc.enable()
    collector = gc_control.StepGarbageCollector()
    collector.busy()
    for _ in range(gc_control.FULL_EVERY):
        collector.collect_in_slack()
    collector.idle()
    assert calls.count(2) == 1
    assert calls.count(1) == gc_control.FULL_EVERY // gc_control.MIDDLE_EVERY - 1
    assert calls.count(0) == (gc_control.FULL_EVERY // gc_control.YOUNG_EVERY
                              - gc_control.FULL_EVERY // gc_control.MIDDLE_EVERY)


def test_a_dropped_engine_is_freed_without_the_collector(make_llm):
    """No reference cycle holds an engine (or its pools): dropping the last reference frees
    it at once -- a cycle would wait for a collection (and GPU memory with it)."""
    import weakref

    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    refs = [weakref.ref(o) for o in (engine, engine.runner, engine.kv, engine.mamba, engine.model)]
    gc.disable()
    del llm, engine
    assert all(r() is None for r in refs)

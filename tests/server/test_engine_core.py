"""The messages between the server's engine core and its front end (engine_core.py): a
request's outputs, sent as per-step deltas through a pickle round trip (what the engine
process does) and rebuilt by the front end, equal the engine's own outputs."""
import pickle

import pytest

from hybrid_engine import SamplingParams
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.async_llm import _Stream
from hybrid_engine.server.engine_core import Failure, OutputDelta, StepReport


def _fields(out) -> tuple:
    return (out.request_id, out.prompt_token_ids, out.output_token_ids, out.logprobs, out.text, out.finished,
            out.finish_reason, out.stop_reason, out.new_token_ids, out.new_text, out.error, out.num_cached_tokens)


@pytest.mark.parametrize("spec", [0, 3])
def test_outputs_rebuilt_from_pickled_deltas_equal_the_engines(spec: int):
    """Every step's output of requests with logprobs, stop strings (text held back) and
    speculative steps (several tokens per step), rebuilt on the front end from the deltas
    of pickled `StepReport`s, equals the engine's output field by field."""
    speculative = {"method": "ngram", "num_speculative_tokens": spec} if spec else None
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=128, speculative_config=speculative))
    sampled = dict(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request("probe", [40, 41, 42], SamplingParams(**sampled))
    while engine.has_unfinished_requests():
        text = engine.step()[0].text
    # A stop string that begins with the 4th character of the text and never matches: the
    # text is held back from that character on (it might begin the stop string) until it can't.
    stop = text[3] + "\x00\x00"
    requests = {
        "plain": ([5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
        "logprobs": ([9, 8, 7], SamplingParams(max_tokens=15, temperature=0.9, seed=3, logprobs=2, ignore_eos=True)),
        "stop": ([40, 41, 42], SamplingParams(**sampled, stop=[stop])),
    }
    streams = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
        streams[request_id] = _Stream(None, None, prompt, [] if params.logprobs is not None else None, [])
    finals, held = set(), False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        report = pickle.loads(pickle.dumps(StepReport([OutputDelta.of(o) for o in outputs], {"steps": 1}, [0.5])))
        assert report.stats == {"steps": 1} and report.step_seconds == [0.5]
        for out, delta in zip(outputs, report.items, strict=True):
            assert isinstance(delta, OutputDelta)
            rebuilt = streams[out.request_id].output(delta)
            assert _fields(rebuilt) == _fields(out)
            held = held or bool(out.held_text)
            if out.finished:
                finals.add(out.request_id)
    assert finals == set(requests)
    assert held  # the stop-string request did hold text back at some step
    assert streams["stop"].output_ids and streams["logprobs"].logprobs


def test_failures_keep_their_kind_through_a_step_report():
    report = pickle.loads(pickle.dumps(StepReport([Failure("a", "boom"), OutputDelta(
        "b", [1], "x", None, "", True, "length", None, None, 0)], {}, [])))
    assert report.items == [Failure("a", "boom"), OutputDelta("b", [1], "x", None, "", True, "length", None, None, 0)]
    assert [type(item) for item in report.items] == [Failure, OutputDelta]


def test_merged_step_reports_rebuild_the_same_outputs():
    """Step reports that queued up in the engine process, merged into one, give each request
    the output its last step gave (cumulative fields) with the new tokens, text and logprobs
    of every merged step; a failure is not folded into the outputs before it."""
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=128))
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=1, logprobs=1, ignore_eos=True)
    for request_id in "ab":
        engine.add_request(request_id, [7, 8, 9], params)
    reports, last = [], {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        reports.append(StepReport([OutputDelta.of(o) for o in outputs], {"steps": len(reports)}, [0.1]))
        last.update({o.request_id: o for o in outputs})
    reports.append(StepReport([Failure("c", "boom")], {"steps": -1}, []))
    merged = StepReport.merged(reports)
    assert merged.stats == {"steps": -1} and merged.step_seconds == [0.1] * (len(reports) - 1)
    assert [item.request_id for item in merged.items] == ["a", "b", "c"]
    for delta in merged.items[:2]:
        out = _Stream(None, None, [7, 8, 9], [], []).output(delta)
        expected = last[delta.request_id]
        assert (out.output_token_ids, out.logprobs, out.text, out.finished, out.finish_reason) == (
            expected.output_token_ids, expected.logprobs, expected.text, True, "length")
        assert out.new_token_ids == expected.output_token_ids and len(out.output_token_ids) == 9
    assert merged.items[2] == Failure("c", "boom")
    # A request's deltas on both sides of a failure of another request still fold; its own
    # failure ends its run.
    d = OutputDelta("x", [1], "p", None, "", False, None, None, None, 0)
    folded = StepReport.merged([StepReport([d, Failure("x", "late")], {}, []), StepReport([d], {}, [])])
    assert folded.items == [d, Failure("x", "late"), d]

"""The engine process's side of the pipe (engine_host.py): what crosses it, and in what order."""
import pickle

from hybrid_engine.prompts import ContextLengthExceeded
from hybrid_engine.server.engine_core import Accepted, OutputDelta, StepReport, Stopped
from hybrid_engine.server.engine_host import _coalesce, portable


class _Unpicklable(ValueError):
    def __init__(self, a, b):  # pickles as _Unpicklable(message): rebuilding it raises TypeError
        super().__init__(f"{a} {b}")


def test_refusals_cross_the_process_boundary_with_their_field():
    """A validation error keeps its type and the field it names (the 400's `param`); an
    exception that cannot be rebuilt from its pickle becomes a ValueError saying what it was."""
    error = pickle.loads(pickle.dumps(Accepted(3, portable(ContextLengthExceeded("max_tokens", "max_tokens: 9")))))
    assert type(error.error) is ContextLengthExceeded and error.error.param == "max_tokens"
    assert str(error.error) == "max_tokens: 9"
    fallback = portable(_Unpicklable("bad", "input"))
    assert type(fallback) is ValueError and str(fallback) == "_Unpicklable: bad input"


def test_queued_reports_go_out_in_order_with_step_runs_merged():
    """Consecutive step reports merge; an answer to a call between them stays between them
    (its request's outputs must not arrive before it), and `Stopped` stays last."""
    def step(token: int) -> StepReport:
        return StepReport([OutputDelta("r", [token], "", None, "", False, None, None, None, 0)], {"t": token}, [0.1])

    accepted, stopped = Accepted(1, None), Stopped()
    out = _coalesce([step(1), step(2), accepted, step(3), stopped])
    assert [type(report) for report in out] == [StepReport, Accepted, StepReport, Stopped]
    assert out[0].items[0].new_token_ids == [1, 2] and out[0].stats == {"t": 2} and out[0].step_seconds == [0.1] * 2
    assert out[1] is accepted and out[2].items[0].new_token_ids == [3] and out[3] is stopped

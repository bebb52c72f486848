"""How `Generation` hands a call's queued outputs to its consumer."""
import asyncio

import pytest

from hybrid_engine.request import RequestOutput
from hybrid_engine.server.async_llm import Generation, RequestFailed


def _output(rid: str, outputs: list[int], new: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], outputs, None, None, "", finished, "length" if finished else None, None,
                         new, "".join(chr(96 + t) for t in new), None)


class _NoAborts:
    """The AsyncLLM side of a Generation that is never closed early."""

    def abort(self, request_ids: list[str]) -> None:
        raise AssertionError(f"nothing should be aborted, got {request_ids}")


def _drain(items: list, request_ids: list[str], got: list | None = None) -> list[tuple[int, RequestOutput]]:
    """Everything a Generation yields for `items`, queued before it is read (into `got`
    as it comes, so that what came before an exception can be looked at)."""
    got = [] if got is None else got

    async def run() -> list[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        async for pair in Generation(_NoAborts(), request_ids, queue):
            got.append(pair)
        return got
    return asyncio.run(run())


def test_outputs_that_queued_up_come_as_one_per_request():
    """A consumer that fell three steps behind gets one output per request, whose deltas
    cover every step it missed, in the order the requests first appeared."""
    items = [_output("a", [1], [1]), _output("b", [4], [4]), _output("a", [1, 2], [2]),
             _output("a", [1, 2, 3], [3], finished=True), _output("b", [4, 5], [5], finished=True)]
    got = _drain(items, ["a", "b"])
    assert [(i, o.request_id) for i, o in got] == [(0, "a"), (1, "b")]
    (_, first), (_, second) = got
    assert first.new_token_ids == [1, 2, 3] and first.new_text == "abc" and first.finished
    assert first.output_token_ids == [1, 2, 3]
    assert second.new_token_ids == [4, 5] and second.new_text == "de"


def test_a_failure_queued_behind_outputs_comes_after_them():
    """Outputs queued before a failure reach the consumer (merged), then the failure raises."""
    items = [_output("a", [1], [1]), _output("a", [1, 2], [2]), RequestFailed("a", "boom")]
    got: list = []
    with pytest.raises(RequestFailed, match="boom"):
        _drain(items, ["a"], got)
    assert [out.new_token_ids for _, out in got] == [[1, 2]]

"""AsyncLLM: the server's front end to its `EngineCore` (engine_core.py), on asyncio.

The core runs on a thread of this process or in a process of its own (engine_host.py,
`engine_process`); the front end talks to it only through commands and reports. It keeps,
per request, where its outputs go (an asyncio queue on a given event loop) and the
cumulative output the core's deltas extend, and turns each report into one wake-up per
event loop. The event loop thus never blocks on a model step, and the engine never waits
on HTTP.

Admission (accept all or nothing, the bounded waiting room, round-robin between calls) and
failure containment are the core's; see its module doc. If the core goes away -- shut
down, its engine dead, or its process killed -- every request still in flight fails, and
`submit` raises `EngineUnavailable` (503) from then on.
"""
import asyncio
import concurrent.futures
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from hybrid_engine.engine import LLMEngine
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling_params import ParameterError, SamplingParams
from hybrid_engine.server.engine_core import (Abort, Accepted, AddCall, EngineInfo, Failure, OutputDelta, QueueFull,
                                              Report, StartFailed, Started, StepReport, Stop, Stopped, fold_runs)
from hybrid_engine.server.engine_host import EngineHost, EngineProcess, EngineProcessDied, EngineThread
from hybrid_engine.server.metrics import REQUEST_GAUGES, ServerMetrics

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineInfo", "EngineUnavailable", "Generation", "QueueFull", "RequestFailed"]


class EngineUnavailable(Exception):
    """The engine is stopped or stopping (answered with 503)."""


class RequestFailed(Exception):
    """A request ended with an error instead of a finish reason (answered with 500)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class _Stream:
    """One request's consumer (an asyncio queue on a given event loop) and its output so
    far, which the core's deltas extend (lists only grow: each `RequestOutput` keeps
    references and lengths, see `RequestOutput`)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # None: the request asked for none
    text_parts: list[str] | None  # None: the engine has no tokenizer
    output_ids: list[int] = field(default_factory=list)

    def output(self, delta: OutputDelta) -> RequestOutput:
        """The request's `RequestOutput` after `delta`."""
        self.output_ids.extend(delta.new_token_ids)
        if self.logprobs is not None and delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        if self.text_parts is not None and delta.new_text:
            self.text_parts.append(delta.new_text)
        return RequestOutput(delta.request_id, None, self.prompt_token_ids, self.output_ids, self.logprobs,
                             self.text_parts, delta.held_text, delta.finished, delta.finish_reason,
                             delta.stop_reason, delta.new_token_ids, delta.new_text, delta.error,
                             delta.num_cached_tokens)


@dataclass
class _PendingCall:
    """An `AddCall` sent and not answered yet."""

    accepted: concurrent.futures.Future
    request_ids: list[str]
    prompt_tokens: int


class Generation:
    """The outputs of one API call's engine requests (one per prompt and choice), as they come.

    Iterate for `(request index, RequestOutput)` pairs until every request finished;
    a request that errors raises `RequestFailed`. Always `close()` (idempotent): it
    aborts whatever has not finished, e.g. when the client went away.
    """

    def __init__(self, llm: "AsyncLLM", request_ids: list[str], outputs: asyncio.Queue):
        self._llm, self._outputs = llm, outputs
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (request index, output) as the core's reports deliver them; a request's
        outputs that queued up while the consumer was busy come as one (`_merge_queued`)."""
        while self._unfinished:
            items = [await self._outputs.get()]
            while not self._outputs.empty():
                items.append(self._outputs.get_nowait())
            for item in _merge_queued(items):
                yield self._index[item.request_id], self._account(item)

    def _account(self, item: RequestOutput | RequestFailed) -> RequestOutput:
        """Note which requests finished; a failed one raises `RequestFailed`."""
        if isinstance(item, RequestFailed):
            self._unfinished.discard(item.request_id)
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if item.finish_reason == "error":
                raise RequestFailed(item.request_id, item.error or "the engine failed this request")
        return item

    def close(self) -> None:
        """Abort the requests that have not finished (they free their blocks and slot)."""
        if self._unfinished:
            self._llm.abort(sorted(self._unfinished))
            self._unfinished.clear()


class AsyncLLM:
    """Serves an `LLMEngine` to asyncio code; the engine runs in an `EngineCore` elsewhere.

    `engine_factory` builds the engine where the core runs: on a thread of this process, or
    with `engine_process=True` in a child process (then it must be picklable, e.g.
    `functools.partial(LLMEngine, config)`). The constructor returns once the engine is
    built, re-raising its construction error. At most `max_num_seqs + max_waiting_requests`
    requests are in flight; beyond that `submit` raises `QueueFull`. One call brings at most
    `max_prompts_per_request` prompts (default: max_num_seqs, so one call can fill the
    running batch but not the waiting room as well).
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine], max_waiting_requests: int = 256,
                 max_prompts_per_request: int | None = None, engine_process: bool = False):
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        if max_prompts_per_request is not None and max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics(lambda: self.stats)
        self.info: EngineInfo
        self.stats: dict[str, int] = {}  # the core's latest stats, replaced whole
        self._streams: dict[str, _Stream] = {}  # every request sent and not finished
        self._pending: dict[int, _PendingCall] = {}  # by AddCall.seq
        self._next_seq = 0
        self._stopping = False  # shutdown() was called
        self._gone = False  # the core said Stopped (or never started)
        self._lock = threading.Lock()  # orders submits against the core going away
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        host = EngineProcess if engine_process else EngineThread
        self._host: EngineHost = host(engine_factory, max_waiting_requests, self._on_report)
        try:
            self._started.wait()
        except BaseException:  # e.g. SystemExit from a signal while the model loads
            self._host.join(0.0)  # an engine process still loading exits at once
            raise
        if self._start_error is not None:
            self._host.join(10.0)
            raise self._start_error
        self.max_prompts_per_request = (self.info.max_num_seqs if max_prompts_per_request is None
                                        else max_prompts_per_request)

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once: the running batch plus the bounded waiting queue."""
        return self.info.max_num_seqs + self.max_waiting_requests

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None when the engine runs on a thread of this process)."""
        return self._host.pid

    @property
    def healthy(self) -> bool:
        """True while the engine runs and accepts requests."""
        return self._host.alive and not (self._stopping or self._gone)

    def check_num_prompts(self, num_prompts: int) -> None:
        """ParameterError("prompt") for more prompts in one call than `max_prompts_per_request`."""
        if num_prompts > self.max_prompts_per_request:
            raise ParameterError("prompt", f"prompt: {num_prompts} prompts in one request; this server takes at most "
                                           f"{self.max_prompts_per_request} per request (--max-prompts-per-request)")

    # ---- event-loop side -------------------------------------------------------------
    async def submit(self, request_id: str, requests: list[tuple[list[int], SamplingParams]]) -> Generation:
        """Queue one engine request per (prompt token ids, params); returns once the core
        accepted them (they reach the engine as it has room, see engine_core.py).

        Raises ValueError (invalid request or too many prompts, nothing queued), QueueFull,
        EngineUnavailable, or whatever else validating them raised. Engine request ids are
        `{request_id}-{i}`.
        """
        self.check_num_prompts(len(requests))
        request_ids = [f"{request_id}-{i}" for i in range(len(requests))]
        loop, out_queue = asyncio.get_running_loop(), asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.healthy:
                raise EngineUnavailable("the engine is not running")
            for rid in request_ids:
                if rid in self._streams:
                    raise ValueError(f"request_id {rid!r} is already in use")
            has_text = self.info.tokenizer is not None
            for rid, (prompt, params) in zip(request_ids, requests):
                self._streams[rid] = _Stream(loop, out_queue, prompt, [] if params.logprobs is not None else None,
                                             [] if has_text else None)
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._pending[seq] = _PendingCall(accepted, request_ids, sum(len(prompt) for prompt, _ in requests))
            self._host.send(AddCall(seq, request_ids, requests))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            # The caller went away while the core was adding: undo (the core ends any
            # accepted prompt with "abort"; a refused call has nothing to undo).
            self.abort(request_ids)
            raise
        return Generation(self, request_ids, out_queue)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the core to abort these requests (thread-safe, idempotent)."""
        self._host.send(Abort(request_ids))

    def abort_all(self) -> None:
        """Ask the core to abort every request in flight (their callers get finish_reason "abort")."""
        self._host.send(Abort(None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the core and wait for it (idempotent)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._host.send(Stop())
        self._host.join(timeout)

    # ---- reports (on the core's thread, or the thread receiving its process's reports) ----
    def _on_report(self, report: Report) -> None:
        if isinstance(report, StepReport):
            self._on_step(report)
        elif isinstance(report, Accepted):
            self._on_accepted(report)
        elif isinstance(report, Started):
            self.info, self.stats = report.info, report.stats
            self._started.set()
        elif isinstance(report, StartFailed):
            self._gone, self._start_error = True, report.error
            self._started.set()
        elif isinstance(report, Stopped):
            if not self._started.is_set():  # it stopped before it could say it started
                self._gone, self._start_error = True, EngineProcessDied(report.reason or "the engine stopped")
                self._started.set()
                return
            self._on_stopped(report)

    def _on_accepted(self, report: Accepted) -> None:
        with self._lock:
            call = self._pending.pop(report.seq, None)
            if call is None:
                return  # failed already (the core went away meanwhile)
            if report.error is not None:
                for rid in call.request_ids:
                    del self._streams[rid]
        if report.error is None:
            self.metrics.prompt_tokens.inc(call.prompt_tokens)
        elif isinstance(report.error, QueueFull):
            self.metrics.queue_full.inc()
        if call.accepted.set_running_or_notify_cancel():  # False: the caller stopped waiting
            if report.error is None:
                call.accepted.set_result(None)
            else:
                call.accepted.set_exception(report.error)

    def _on_step(self, report: StepReport) -> None:
        self.stats = report.stats
        for seconds in report.step_seconds:
            self.metrics.step_seconds.observe(seconds)
        deliveries: list[tuple[_Stream, RequestOutput | RequestFailed]] = []
        for item in report.items:
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue
            if isinstance(item, Failure):
                self._end(item.request_id, "error")
                deliveries.append((stream, RequestFailed(item.request_id, item.message)))
                continue
            if item.finished:
                self._end(item.request_id, item.finish_reason or "unknown")
            self.metrics.generation_tokens.inc(len(item.new_token_ids))
            deliveries.append((stream, stream.output(item)))
        _deliver(deliveries)

    def _on_stopped(self, report: Stopped) -> None:
        """The core is gone: fail the calls it never answered and the requests it never ended,
        and report no requests from then on (the last snapshot counted those just failed)."""
        with self._lock:
            self._gone = True
            self.stats = {**self.stats, **dict.fromkeys(REQUEST_GAUGES, 0)}
            pending, self._pending = self._pending, {}
            for call in pending.values():  # their submits raise instead
                for rid in call.request_ids:
                    del self._streams[rid]
            streams = list(self._streams.items())
            self._streams.clear()
        for call in pending.values():
            if call.accepted.set_running_or_notify_cancel():
                call.accepted.set_exception(EngineUnavailable(report.reason or "the server is shutting down"))
        self.metrics.finished.labels("error").inc(len(streams))
        message = report.reason or "the server is shutting down"
        _deliver([(stream, RequestFailed(rid, message)) for rid, stream in streams])

    def _end(self, request_id: str, finish_reason: str) -> None:
        """Forget a finished request's stream and count it."""
        del self._streams[request_id]
        self.metrics.finished.labels(finish_reason).inc()


def _deliver(deliveries: list[tuple[_Stream, RequestOutput | RequestFailed]]) -> None:
    """Hand outputs to their consumers: one wake-up per event loop per report, not one per output."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
    for stream, item in deliveries:
        by_loop[stream.loop].append((stream.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # that event loop is closed: nobody is waiting for these outputs


def _merge_queued(items: list[RequestOutput | RequestFailed]) -> list[RequestOutput | RequestFailed]:
    """Items of one consumer's queue, each request's run of outputs folded into its latest
    one (`fold_runs`, `RequestOutput.merge_earlier`); a failure is never folded. When the
    event loop falls behind the engine (many streams, a fast model), this turns a backlog of
    per-step chunks into one chunk per request instead of deepening it, as vLLM's output
    collector does."""
    return fold_runs(items, lambda item: isinstance(item, RequestOutput), _merge_run)


def _merge_run(run: list[RequestOutput]) -> RequestOutput:
    run[-1].merge_earlier(run[:-1])
    return run[-1]


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for out_queue, item in batch:
        out_queue.put_nowait(item)

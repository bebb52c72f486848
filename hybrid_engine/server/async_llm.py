"""AsyncLLM: the engine loop on its own thread, requests and outputs on asyncio.

`LLMEngine` is synchronous and not thread-safe. Rather than lock it, exactly one thread
(the engine thread, which also builds it) ever touches it: the event loop sends
commands (add, abort, stop) through a thread-safe queue that the engine thread drains
between steps, and the engine thread hands each step's outputs back to the waiting
coroutines with `loop.call_soon_threadsafe`. The event loop thus never blocks on a
model step, and the engine never waits on HTTP.

Admission: an API call's prompts are accepted all or nothing (validated with the engine's
own checks, 429 only beyond `max_in_flight`), then wait on a server-side list. The engine
is handed only as many prompts as it has Mamba slots, and each free place goes to the
waiting API call with the fewest prompts in the engine, then the fewest handed over so
far, then the earliest -- so prompts of concurrent calls are admitted round-robin, and
one call with many prompts does not hold every slot until it is done.

Failure containment: a request the engine refuses fails alone (ValueError -> 400,
anything else -> 500); if a whole `step()` raises, every in-flight request fails with
the error, the engine is told to abort them, and the loop keeps serving new requests.
An engine that died (a tensor-parallel worker exited: `LLMEngine.dead`) has failed every
request itself; the loop then stops, and the server answers 503 from then on.
"""
import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from hybrid_engine.engine import LLMEngine
from hybrid_engine.prompts import RequestLimits, validate_request
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling_params import ParameterError, SamplingParams
from hybrid_engine.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# After a failed step, wait this long (doubling per consecutive failure, capped) before
# stepping again, so a persistently broken engine logs errors instead of spinning a core.
_FAILURE_BACKOFF_S = 0.01
_FAILURE_BACKOFF_MAX_S = 1.0


class QueueFull(Exception):
    """The server already holds as many requests as it admits (answered with 429)."""


class EngineUnavailable(Exception):
    """The engine thread is stopped or stopping (answered with 503)."""


class RequestFailed(Exception):
    """A request ended with an error instead of a finish reason (answered with 500)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP layer needs to know about the engine, read once at start-up."""

    model_name: str
    tokenizer: Any | None  # the front end's own copy, for its tokenizer thread only (see AsyncLLM._describe)
    limits: RequestLimits  # what a request must fit (the engine's own, `LLMEngine.limits`)
    max_num_seqs: int
    kv_block_size: int
    total_kv_blocks: int
    device: str
    dtype: str
    kernels: str

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.total_kv_blocks * self.kv_block_size

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + output of one request: the context and the cache both bound it."""
        return self.limits.max_request_tokens


@dataclass
class _Route:
    """Where a request's outputs go: an asyncio queue on a given event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_ids: list[str]
    requests: list[tuple[list[int], SamplingParams]]
    route: _Route
    accepted: concurrent.futures.Future


@dataclass
class _Queued:
    """One API call's prompts while some still wait on the server-side list (engine thread only)."""

    seq: int  # arrival order: the last tie-break between calls
    route: _Route
    prompts: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)  # not yet in the engine
    in_engine: int = 0  # its prompts the engine holds now
    admitted: int = 0  # its prompts handed to the engine so far


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request in flight


class _Stop:
    """Command: leave the engine loop."""


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
        """Yield (request index, output) as the engine thread delivers them; a request's
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
    """Runs an `LLMEngine` on a dedicated thread and serves it to asyncio code.

    `engine_factory` is called on the engine thread (so the engine, its device state
    and any thread-local settings live there). The constructor returns once the
    engine is built, re-raising its construction error. At most
    `max_num_seqs + max_waiting_requests` requests are in flight; beyond that
    `submit` raises `QueueFull`. One call brings at most `max_prompts_per_request`
    prompts (default: max_num_seqs, so one call can fill the running batch but not
    the waiting room as well).
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine], max_waiting_requests: int = 256,
                 max_prompts_per_request: int | None = None):
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        if max_prompts_per_request is not None and max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics(lambda: self.stats)
        self.info: EngineInfo
        self.stats: dict[str, int] = {}  # the latest engine.stats() plus in_flight, replaced whole
        self._commands: queue.Queue = queue.Queue()
        # Engine thread only: where every in-flight request's outputs go; the calls with
        # prompts still on the server-side list (by arrival), and each prompt's call.
        self._routes: dict[str, _Route] = {}
        self._queued: dict[int, _Queued] = {}
        self._owner: dict[str, _Queued] = {}
        self._next_seq = 0
        self._stopping = False
        self._lock = threading.Lock()  # orders "queue a submit" against "engine thread exits"
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(engine_factory,), name="engine-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error
        self.max_prompts_per_request = (self.info.max_num_seqs if max_prompts_per_request is None
                                        else max_prompts_per_request)

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once: the running batch plus the bounded waiting queue."""
        return self.info.max_num_seqs + self.max_waiting_requests

    @property
    def healthy(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return self._thread.is_alive() and not self._stopping

    @property
    def _num_queued(self) -> int:
        """Prompts on the server-side list (engine thread only)."""
        return sum(len(call.prompts) for call in self._queued.values())

    def check_num_prompts(self, num_prompts: int) -> None:
        """ParameterError("prompt") for more prompts in one call than `max_prompts_per_request`."""
        if num_prompts > self.max_prompts_per_request:
            raise ParameterError("prompt", f"prompt: {num_prompts} prompts in one request; this server takes at most "
                                           f"{self.max_prompts_per_request} per request (--max-prompts-per-request)")

    # ---- event-loop side -------------------------------------------------------------
    async def submit(self, request_id: str, requests: list[tuple[list[int], SamplingParams]]) -> Generation:
        """Queue one engine request per (prompt token ids, params); returns once the engine
        thread accepted them (they reach the engine as it has room, see the module doc).

        Raises ValueError (invalid request or too many prompts, nothing queued), QueueFull,
        EngineUnavailable, or whatever else validating them raised. Engine request ids are
        `{request_id}-{i}`.
        """
        self.check_num_prompts(len(requests))
        request_ids = [f"{request_id}-{i}" for i in range(len(requests))]
        route = _Route(asyncio.get_running_loop(), asyncio.Queue())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.healthy:
                raise EngineUnavailable("the engine is not running")
            self._commands.put(_Add(request_ids, requests, route, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine was adding: undo (a no-op if the add
            # was cancelled before it started).
            self.abort(request_ids)
            raise
        return Generation(self, request_ids, route.queue)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort these requests (thread-safe, idempotent)."""
        self._commands.put(_Abort(request_ids))

    def abort_all(self) -> None:
        """Ask the engine thread to abort every request in flight (their callers get finish_reason "abort")."""
        self._commands.put(_Abort(None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the engine thread and wait for it (idempotent)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._commands.put(_Stop())
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------
    def _main(self, engine_factory: Callable[[], LLMEngine]) -> None:
        try:
            engine = engine_factory()
            self.info = self._describe(engine)
            self._publish_stats(engine)
        except BaseException as exc:  # noqa: BLE001 -- handed to the constructing thread
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(engine)
        finally:
            self._close(engine)

    @staticmethod
    def _describe(engine: LLMEngine) -> EngineInfo:
        stats = engine.stats()
        # The HTTP side tokenizes prompts on its tokenizer thread (`serving.TokenizerThread`);
        # a private copy keeps it from ever sharing the tokenizer object with the engine
        # thread (HF fast tokenizers can raise "Already borrowed" under concurrent use).
        tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        cfg = engine.config
        return EngineInfo(
            model_name=engine.model_name, tokenizer=tokenizer, limits=engine.limits, max_num_seqs=stats["total_mamba_slots"],
            kv_block_size=cfg.kv_block_size, total_kv_blocks=stats["total_kv_blocks"], device=str(cfg.device),
            dtype=cfg.dtype, kernels=engine.kernels.name,
        )

    def _loop(self, engine: LLMEngine) -> None:
        """Commands, then admissions, then a step, until told to stop; no exception ends the loop."""
        failures = 0
        while True:
            try:
                if not self._run_commands(engine, block=not (engine.has_unfinished_requests() or self._queued)):
                    return
                self._feed(engine)
                ok = self._step(engine) if engine.has_unfinished_requests() else True
                self._publish_stats(engine)
                if engine.dead is not None:  # a tensor-parallel worker died: nothing more can run
                    logger.error("the engine is dead (%s): the server stops taking requests", engine.dead)
                    return
            except Exception:  # a bug outside the step itself: log it, keep serving
                logger.exception("error in the engine loop")
                ok = False
            failures = 0 if ok else failures + 1
            if failures:
                time.sleep(min(_FAILURE_BACKOFF_S * 2 ** (failures - 1), _FAILURE_BACKOFF_MAX_S))

    def _run_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(engine, command)
            else:
                self._abort(engine, list(self._routes) if command.request_ids is None else command.request_ids)

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        """Accept an API call's prompts onto the server-side list, all or none."""
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller stopped waiting before we got here
        if len(self._routes) + len(command.request_ids) > self.max_in_flight:
            self.metrics.queue_full.inc()
            command.accepted.set_exception(QueueFull(
                f"the server is at capacity ({len(self._routes)} requests in flight, at most {self.max_in_flight}); "
                f"retry later"))
            return
        try:  # the engine's own checks now, so that a prompt handed over later cannot be refused
            for request_id, (prompt, params) in zip(command.request_ids, command.requests):
                if request_id in self._routes:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                validate_request(prompt, params, engine.limits, engine.tokenizer)
        except Exception as exc:
            if not isinstance(exc, ValueError):
                logger.exception("validating %s failed", command.request_ids)
            command.accepted.set_exception(exc)
            return
        call = _Queued(self._next_seq, command.route, dict(zip(command.request_ids, command.requests)))
        self._next_seq += 1
        if call.prompts:
            self._queued[call.seq] = call
        for request_id, (prompt, _) in call.prompts.items():
            self._routes[request_id] = command.route
            self._owner[request_id] = call
            self.metrics.prompt_tokens.inc(len(prompt))
        command.accepted.set_result(None)

    def _feed(self, engine: LLMEngine) -> None:
        """Hand waiting prompts to the engine while it holds fewer than max_num_seqs, each to
        the call with the fewest prompts in the engine, then the fewest admitted, then the earliest."""
        failed: list[tuple[_Route, RequestFailed]] = []
        while self._queued and len(self._routes) - self._num_queued < self.info.max_num_seqs:
            call = min(self._queued.values(), key=lambda c: (c.in_engine, c.admitted, c.seq))
            request_id = next(iter(call.prompts))
            prompt, params = self._unqueue(call, request_id)
            try:
                engine.add_requests([(request_id, prompt, params)])
            except Exception as exc:  # validated at accept time: an engine bug, fails this prompt alone
                logger.exception("add_requests failed for %s", request_id)
                self._end(request_id, "error")
                failed.append((call.route, RequestFailed(
                    request_id, f"the engine could not take the request: {type(exc).__name__}: {exc}")))
                continue
            call.in_engine += 1
            call.admitted += 1
        self._deliver(failed)

    def _unqueue(self, call: _Queued, request_id: str) -> tuple[list[int], SamplingParams]:
        """Take a prompt off the server-side list."""
        entry = call.prompts.pop(request_id)
        if not call.prompts:
            del self._queued[call.seq]
        return entry

    def _end(self, request_id: str, finish_reason: str) -> _Queued:
        """Forget a finished request's route, count it, and return its call."""
        del self._routes[request_id]
        self.metrics.finished.labels(finish_reason).inc()
        return self._owner.pop(request_id)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        """Abort requests: one still on the server-side list ends here with finish_reason
        "abort" (it never reaches the engine); the engine ends the others at its next step."""
        deliveries: list[tuple[_Route, RequestOutput]] = []
        for request_id in request_ids:
            call = self._owner.get(request_id)
            if call is None:
                continue  # finished already, or not ours
            if request_id not in call.prompts:
                engine.abort_request(request_id)
                continue
            prompt, params = self._unqueue(call, request_id)
            self._end(request_id, "abort")
            deliveries.append((call.route, RequestOutput(
                request_id, None, prompt, [], [] if params.logprobs is not None else None,
                None if engine.tokenizer is None else [], "", True, "abort", None, [], "", None)))
        self._deliver(deliveries)

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step, its outputs delivered; False if the step raised."""
        start = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._routes))
            self._fail_all(engine, f"engine step failed: {type(exc).__name__}: {exc}")
            return False
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        deliveries = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted by its caller (or rolled back); nobody is listening
            if out.finished:
                self._end(out.request_id, out.finish_reason or "unknown").in_engine -= 1
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            deliveries.append((route, out))
        self._deliver(deliveries)
        return True

    def _fail_all(self, engine: LLMEngine, message: str) -> None:
        """Fail every routed request with `message` and tell the engine to drop them."""
        failed = list(self._routes.items())
        self._routes.clear()
        self._queued.clear()
        self._owner.clear()
        for request_id, _ in failed:
            try:
                engine.abort_request(request_id)
            except Exception:
                logger.exception("abort_request(%s) failed", request_id)
        self.metrics.finished.labels("error").inc(len(failed))
        self._deliver([(route, RequestFailed(request_id, message)) for request_id, route in failed])

    @staticmethod
    def _deliver(deliveries: list[tuple[_Route, RequestOutput | RequestFailed]]) -> None:
        # One wake-up per event loop per step, not one per output.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        for route, item in deliveries:
            by_loop[route.loop].append((route.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # that event loop is closed: nobody is waiting for these outputs

    def _publish_stats(self, engine: LLMEngine) -> None:
        stats = engine.stats()
        # "waiting" as clients see it: in the engine's queue or on the server-side list.
        self.stats = {**stats, "waiting": stats["waiting"] + self._num_queued, "in_flight": len(self._routes)}

    def _close(self, engine: LLMEngine) -> None:
        """On exit: fail submits never processed, abort what is in flight."""
        with self._lock:  # after this, `submit` refuses instead of queueing into the void
            self._stopping = True
            pending = []
            while not self._commands.empty():
                pending.append(self._commands.get_nowait())
        for command in pending:
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(EngineUnavailable("the server is shutting down"))
        try:
            self._abort(engine, list(self._routes))
            if engine.has_unfinished_requests():
                self._step(engine)  # hands the aborts' final outputs to their callers
        except Exception:
            logger.exception("aborting in-flight requests at shutdown failed")
        self._fail_all(engine, "the server is shutting down")  # whatever the last step did not end
        engine.shutdown()  # tensor-parallel workers stop with the engine thread


def _merge_queued(items: list[RequestOutput | RequestFailed]) -> list[RequestOutput | RequestFailed]:
    """Items of one consumer's queue, each request's run of outputs folded into its latest
    one (`RequestOutput.merge_earlier`), in the order each request first appears; a failure
    is never merged, so outputs before it still reach the client. When the event loop falls
    behind the engine (many streams, a fast model), this turns a backlog of per-step chunks
    into one chunk per request instead of deepening it, as vLLM's output collector does."""
    runs: list[list[RequestOutput | RequestFailed]] = []
    open_run: dict[str, list[RequestOutput | RequestFailed]] = {}  # request id -> its run of outputs
    for item in items:
        run = open_run.get(item.request_id)
        if run is not None and isinstance(item, RequestOutput):
            run.append(item)
            continue
        runs.append([item])
        if isinstance(item, RequestOutput):
            open_run[item.request_id] = runs[-1]
        else:
            open_run.pop(item.request_id, None)
    merged = []
    for run in runs:
        if len(run) > 1:
            run[-1].merge_earlier(run[:-1])
        merged.append(run[-1])
    return merged


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for out_queue, item in batch:
        out_queue.put_nowait(item)

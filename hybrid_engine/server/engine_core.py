"""The engine side of the server: `EngineCore`, the loop that owns an `LLMEngine`, and the
messages it exchanges with the HTTP front end (`AsyncLLM`).

`LLMEngine` is synchronous and not thread-safe. Rather than lock it, exactly one thread
ever touches it: the core's. The core runs on a thread of the server process or in a
process of its own (`engine_host.py`); either way it sees only commands (`AddCall`,
`Abort`, `Stop`) and answers only with reports (`Started`, `Accepted`, `StepReport`,
`Stopped`), all plain picklable data. A step's outputs travel as `OutputDelta`s -- what
the step added -- and the front end rebuilds the cumulative `RequestOutput`s, so a
report's size does not grow with a request's length.

Admission: an API call's prompts are accepted all or nothing (validated with the engine's
own checks; `QueueFull` beyond `max_num_seqs + max_waiting_requests` in flight), then wait
on a server-side list. The engine is handed only as many prompts as it has Mamba slots,
and each free place goes to the waiting call with the fewest prompts in the engine, then
the fewest handed over so far, then the earliest -- so prompts of concurrent calls are
admitted round-robin, and one call with many prompts does not hold every slot until it
is done.

Failure containment: a request the engine refuses fails alone; if a whole `step()`
raises, every in-flight request fails with the error, the engine is told to abort them,
and the loop keeps serving new requests. An engine that died (a tensor-parallel worker
exited: `LLMEngine.dead`) has failed every request itself; the loop then stops.
"""
import copy
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, TypeVar

from hybrid_engine.engine import LLMEngine
from hybrid_engine.prompts import RequestLimits, validate_request
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# After a failed step, wait this long (doubling per consecutive failure, capped) before
# stepping again, so a persistently broken engine logs errors instead of spinning a core.
_FAILURE_BACKOFF_S = 0.01
_FAILURE_BACKOFF_MAX_S = 1.0


class QueueFull(Exception):
    """The server already holds as many requests as it admits (answered with 429)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP layer needs to know about the engine, read once at start-up."""

    model_name: str
    tokenizer: Any | None  # the front end's own copy, for its tokenizer thread only (see `describe`)
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


def describe(engine: LLMEngine) -> EngineInfo:
    """The engine's `EngineInfo`."""
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


# ---- commands: front end -> core -----------------------------------------------------
@dataclass
class AddCall:
    """One API call's requests (one per prompt and choice), to accept all or none."""

    seq: int  # the front end's number for the call: its `Accepted` answer carries it back
    request_ids: list[str]
    requests: list[tuple[list[int], SamplingParams]]


@dataclass
class Abort:
    """Abort these requests (None: every request in flight)."""

    request_ids: list[str] | None


class Stop:
    """Abort everything in flight and leave the loop."""


# ---- reports: core -> front end ------------------------------------------------------
@dataclass
class Started:
    """The engine is built; requests may come."""

    info: EngineInfo
    stats: dict[str, int]


@dataclass
class StartFailed:
    """Building the engine raised `error`; the core never ran."""

    error: BaseException


@dataclass
class Accepted:
    """The answer to `AddCall` number `seq`: None, or why it was refused (`QueueFull`, a
    ValueError of validation, ...)."""

    seq: int
    error: BaseException | None


class OutputDelta(NamedTuple):
    """What one step (or several merged) added to a request: `RequestOutput` less its
    cumulative fields, which the front end keeps. A tuple: cheap to pickle by the hundred."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None  # one row per new token; None without logprobs
    held_text: str  # decoded text held back (it may start a stop string); part of `text`
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    error: str | None
    num_cached_tokens: int

    @staticmethod
    def of(out: RequestOutput) -> "OutputDelta":
        """The delta of an engine output."""
        return OutputDelta(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs, out.held_text,
                           out.finished, out.finish_reason, out.stop_reason, out.error, out.num_cached_tokens)


class Failure(NamedTuple):
    """A request that ended with an error instead of an output (answered with 500)."""

    request_id: str
    message: str


@dataclass
class StepReport:
    """One pass of the loop (or several, `merged`): outputs and failures in order, the
    engine's stats after it, and the wall time of each step it ran."""

    items: list[OutputDelta | Failure]
    stats: dict[str, int]
    step_seconds: list[float]

    @staticmethod
    def merged(reports: list["StepReport"]) -> "StepReport":
        """Consecutive reports as one (`fold_runs`: each request's deltas joined into one, its
        new tokens, text and logprobs concatenated, the rest from its latest). What the engine
        process sends when the server reads its reports slower than the engine steps."""
        items = fold_runs([item for report in reports for item in report.items],
                          lambda item: isinstance(item, OutputDelta), _join_deltas)
        return StepReport(items, reports[-1].stats, [t for report in reports for t in report.step_seconds])

    def __reduce__(self):
        # The items cross the process boundary as plain tuples: pickling 128 NamedTuples
        # took ~110 us (each is rebuilt through its class), 128 plain tuples ~15 us.
        return _rebuild_step_report, ([tuple(item) for item in self.items], self.stats, self.step_seconds)


def _join_deltas(run: list[OutputDelta]) -> OutputDelta:
    """One request's consecutive deltas as one."""
    logprobs = None if run[-1].new_logprobs is None else [row for d in run for row in d.new_logprobs]
    return run[-1]._replace(new_token_ids=[t for d in run for t in d.new_token_ids],
                            new_text="".join(d.new_text for d in run), new_logprobs=logprobs)


T = TypeVar("T")


def fold_runs(items: list[T], foldable: Callable[[T], bool], fold: Callable[[list[T]], T]) -> list[T]:
    """`items` (each with a `request_id`) with each request's run of foldable items folded
    into one by `fold`, in the order each run first appears. An item that is not foldable (a
    failure) stands alone and ends its request's run, so that what came before it is still
    delivered. Both ends of the engine use it when their reader falls behind: queued step
    reports in the engine process, queued outputs in a stream's consumer."""
    runs: list[list[T]] = []
    open_run: dict[str, list[T]] = {}  # request id -> its run still open to folding
    for item in items:
        run = open_run.get(item.request_id)
        if run is not None and foldable(item):
            run.append(item)
            continue
        runs.append([item])
        if foldable(item):
            open_run[item.request_id] = runs[-1]
        else:
            open_run.pop(item.request_id, None)
    return [run[0] if len(run) == 1 else fold(run) for run in runs]


def _rebuild_step_report(rows: list[tuple], stats: dict[str, int], step_seconds: list[float]) -> StepReport:
    """Unpickle a `StepReport` (see its `__reduce__`)."""
    fields = len(OutputDelta._fields)
    items = [OutputDelta._make(row) if len(row) == fields else Failure._make(row) for row in rows]
    return StepReport(items, stats, step_seconds)


@dataclass
class Stopped:
    """The loop has ended: nothing else will come. `reason` says why when it was not asked to."""

    reason: str | None = None


Command = AddCall | Abort | Stop
Report = Started | StartFailed | Accepted | StepReport | Stopped


@dataclass
class _Call:
    """One API call's prompts while some still wait on the server-side list."""

    seq: int  # arrival order: the last tie-break between calls
    prompts: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)  # not yet in the engine
    in_engine: int = 0  # its prompts the engine holds now
    admitted: int = 0  # its prompts handed to the engine so far


class EngineCore:
    """Runs an `LLMEngine` for the server: applies commands, admits prompts, steps, and
    reports through `emit` (called on the core's own thread)."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int, emit: Callable[[Report], None]):
        self.engine, self.emit = engine, emit
        self.info = describe(engine)
        self.max_in_flight = self.info.max_num_seqs + max_waiting_requests
        self._in_flight: dict[str, _Call] = {}  # every accepted, unfinished request -> its call
        self._queued: dict[int, _Call] = {}  # calls with prompts on the server-side list, by arrival
        self._items: list[OutputDelta | Failure] = []  # this pass's, for its report
        self._step_seconds: list[float] = []
        self._stop_reason: str | None = None  # for `Stopped`, when the loop ends unasked

    def stats(self) -> dict[str, int]:
        """`LLMEngine.stats()` with "waiting" as clients see it (in the engine's queue or on the
        server-side list) and "in_flight" (accepted, unfinished)."""
        stats = self.engine.stats()
        return {**stats, "waiting": stats["waiting"] + self._num_queued, "in_flight": len(self._in_flight)}

    @property
    def _num_queued(self) -> int:
        return sum(len(call.prompts) for call in self._queued.values())

    def run(self, commands: "queue.Queue[Command]") -> None:
        """Commands, then admissions, then a step, reported, until told to stop; no Exception
        ends the loop. On the way out everything in flight is aborted and `Stopped` sent."""
        failures = 0
        try:
            while True:
                try:
                    busy = self.engine.has_unfinished_requests() or self._queued
                    if not self._run_commands(commands, block=not busy):
                        return
                    self._feed()
                    ok = self._step() if self.engine.has_unfinished_requests() else True
                    self._report()
                    if self.engine.dead is not None:  # a tensor-parallel worker died: nothing more can run
                        logger.error("the engine is dead (%s): the server stops taking requests", self.engine.dead)
                        self._stop_reason = f"the engine is dead: {self.engine.dead}"
                        return
                except Exception:  # a bug outside the step itself: log it, keep serving
                    logger.exception("error in the engine loop")
                    ok = False
                failures = 0 if ok else failures + 1
                if failures:
                    time.sleep(min(_FAILURE_BACKOFF_S * 2 ** (failures - 1), _FAILURE_BACKOFF_MAX_S))
        finally:
            self._close()

    def _run_commands(self, commands: "queue.Queue[Command]", block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                command = commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, Stop):
                return False
            if isinstance(command, AddCall):
                self._add(command)
            else:
                self._abort(list(self._in_flight) if command.request_ids is None else command.request_ids)

    def _add(self, command: AddCall) -> None:
        """Accept an API call's prompts onto the server-side list, all or none."""
        if len(self._in_flight) + len(command.request_ids) > self.max_in_flight:
            self.emit(Accepted(command.seq, QueueFull(
                f"the server is at capacity ({len(self._in_flight)} requests in flight, at most "
                f"{self.max_in_flight}); retry later")))
            return
        try:  # the engine's own checks now, so that a prompt handed over later cannot be refused
            for prompt, params in command.requests:
                validate_request(prompt, params, self.engine.limits, self.engine.tokenizer)
                self.engine.start_grammar(params)  # (compiled and cached for when it reaches the engine)
        except Exception as exc:
            if not isinstance(exc, ValueError):
                logger.exception("validating %s failed", command.request_ids)
            self.emit(Accepted(command.seq, exc))
            return
        call = _Call(command.seq, dict(zip(command.request_ids, command.requests)))
        if call.prompts:
            self._queued[call.seq] = call
        for request_id in call.prompts:
            self._in_flight[request_id] = call
        self.emit(Accepted(command.seq, None))

    def _feed(self) -> None:
        """Hand waiting prompts to the engine while it holds fewer than max_num_seqs, each to
        the call with the fewest prompts in the engine, then the fewest admitted, then the earliest."""
        while self._queued and len(self._in_flight) - self._num_queued < self.info.max_num_seqs:
            call = min(self._queued.values(), key=lambda c: (c.in_engine, c.admitted, c.seq))
            request_id = next(iter(call.prompts))
            prompt, params = self._unqueue(call, request_id)
            try:
                self.engine.add_requests([(request_id, prompt, params)])
            except Exception as exc:  # validated at accept time: an engine bug, fails this prompt alone
                logger.exception("add_requests failed for %s", request_id)
                del self._in_flight[request_id]
                self._items.append(Failure(request_id, f"the engine could not take the request: "
                                                       f"{type(exc).__name__}: {exc}"))
                continue
            call.in_engine += 1
            call.admitted += 1

    def _unqueue(self, call: _Call, request_id: str) -> tuple[list[int], SamplingParams]:
        """Take a prompt off the server-side list."""
        entry = call.prompts.pop(request_id)
        if not call.prompts:
            del self._queued[call.seq]
        return entry

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests: one still on the server-side list ends here with finish_reason
        "abort" (it never reaches the engine); the engine ends the others at its next step."""
        for request_id in request_ids:
            call = self._in_flight.get(request_id)
            if call is None:
                continue  # finished already, or not ours
            if request_id not in call.prompts:
                self.engine.abort_request(request_id)
                continue
            _, params = self._unqueue(call, request_id)
            del self._in_flight[request_id]
            self._items.append(OutputDelta(request_id, [], "", [] if params.logprobs is not None else None, "",
                                           True, "abort", None, None, 0))

    def _step(self) -> bool:
        """One engine step, its outputs kept for the report; False if the step raised."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._in_flight))
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            return False
        self._step_seconds.append(time.perf_counter() - start)
        for out in outputs:
            call = self._in_flight.get(out.request_id)
            if call is None:
                continue  # not one of ours (rolled back, or a direct engine user)
            if out.finished:
                del self._in_flight[out.request_id]
                call.in_engine -= 1
            self._items.append(OutputDelta.of(out))
        return True

    def _report(self) -> None:
        """Send this pass's outputs and the stats after it."""
        report = StepReport(self._items, self.stats(), self._step_seconds)
        self._items, self._step_seconds = [], []
        self.emit(report)

    def _fail_all(self, message: str) -> None:
        """Fail every in-flight request with `message` and tell the engine to drop them."""
        failed = list(self._in_flight)
        self._in_flight.clear()
        self._queued.clear()
        for request_id in failed:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort_request(%s) failed", request_id)
        self._items.extend(Failure(request_id, message) for request_id in failed)

    def _close(self) -> None:
        """On exit: abort what is in flight (its callers get finish_reason "abort"), fail what
        the last step did not end, stop the engine, and say `Stopped`."""
        try:
            self._abort(list(self._in_flight))
            if self.engine.has_unfinished_requests():
                self._step()  # hands the aborts' final outputs to their callers
        except Exception:
            logger.exception("aborting in-flight requests at shutdown failed")
        self._fail_all("the server is shutting down")
        try:
            self._report()
        finally:
            self.engine.shutdown()  # tensor-parallel workers stop with the engine loop
            self.emit(Stopped(self._stop_reason))

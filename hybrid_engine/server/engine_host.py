"""Where the server's `EngineCore` runs: on a thread of the server process (`EngineThread`)
or in a process of its own (`EngineProcess`, what `serve_hybrid.py` uses).

Why a process: the engine's host work (scheduling, bookkeeping, kernel launches) is Python,
and so is the HTTP side. In one process they share one interpreter lock, and every torch
call the engine makes releases it: a busy event loop then takes it each time and holds it
for up to the switch interval. Measured on the H100 with the peer model (docs/server.md):
a Python thread kept busy beside the engine turned a 0.66 ms decode step into 57.7 ms. In
its own process the engine never waits for the event loop.

Both hosts carry the same messages (`engine_core.py`): commands in, reports out to the
`on_report` callback, which runs on the core's thread (`EngineThread`) or on the
receiving thread (`EngineProcess`), one report at a time, in order.
"""
import atexit
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import weakref
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection
from typing import Callable

from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.engine_core import (Accepted, Command, EngineCore, Report, StartFailed, Started, StepReport,
                                              Stop, Stopped)

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], LLMEngine]
ReportHandler = Callable[[Report], None]


def run_core(engine_factory: EngineFactory, max_waiting_requests: int, commands: "queue.Queue[Command]",
             emit: ReportHandler) -> None:
    """Build the engine (reporting `Started`, or `StartFailed` and return), then run its loop
    until `Stop`; the loop reports `Stopped` last."""
    try:
        core = EngineCore(engine_factory(), max_waiting_requests, emit)
        started = Started(core.info, core.stats())
    except BaseException as exc:  # noqa: BLE001 -- handed to the constructing side
        emit(StartFailed(exc))
        return
    emit(started)
    core.run(commands)


class EngineHost(ABC):
    """Runs an `EngineCore` somewhere; carries commands to it and its reports back."""

    pid: int | None = None  # the engine's process when it has one of its own

    @abstractmethod
    def send(self, command: Command) -> None:
        """Queue a command for the core (thread-safe; a no-op once the core is gone)."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """True until the core's thread or process has ended."""

    @abstractmethod
    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the core to end (after `Stop`)."""


class EngineThread(EngineHost):
    """The core on a daemon thread of this process (the engine is built there too). For
    engines that must live in this process: tests that reach into them, factories that
    cannot be pickled."""

    def __init__(self, engine_factory: EngineFactory, max_waiting_requests: int, on_report: ReportHandler):
        self._commands: "queue.Queue[Command]" = queue.Queue()
        self._thread = threading.Thread(target=run_core, name="engine-loop", daemon=True,
                                        args=(engine_factory, max_waiting_requests, self._commands, on_report))
        self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class EngineProcessDied(RuntimeError):
    """The engine process exited without being told to (killed, out of memory, crashed)."""


class EngineProcess(EngineHost):
    """The core in a child process (spawned: CUDA cannot be forked), talking over two pipes.

    `engine_factory` must be picklable (e.g. `functools.partial(LLMEngine, config)`). The
    child ignores SIGINT and SIGTERM -- the server decides when it stops -- and exits when
    told to or when its command pipe closes: at once if the engine is still loading, after
    aborting what is in flight otherwise. This process closes that pipe on every way out,
    `shutdown` or not (an exit handler), so no engine process outlives its server. If the
    child dies, the receiving thread reports `Stopped` (or `StartFailed`) with its exit code.
    """

    def __init__(self, engine_factory: EngineFactory, max_waiting_requests: int, on_report: ReportHandler):
        context = multiprocessing.get_context("spawn")
        command_reader, self._command_writer = context.Pipe(duplex=False)
        self._report_reader, report_writer = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main, name="hybrid-engine-core",
            args=(engine_factory, max_waiting_requests, command_reader, report_writer, logging.getLogger().level))
        self._process.start()
        self.pid = self._process.pid
        command_reader.close()  # the child holds these ends: EOF here once it exits
        report_writer.close()
        self._send_lock = threading.Lock()
        self._reap_lock = threading.Lock()  # one thread at a time waits for the child
        self._closed = False
        self._exitcode: int | None = None
        # Before multiprocessing's own exit handler (registered earlier, so run later),
        # which would wait forever for a child that waits for its pipe to close. A weak
        # reference: a host collected after its child ended has nothing left to stop.
        atexit.register(_join_at_exit, weakref.ref(self))
        self._receiver = threading.Thread(target=self._receive, args=(on_report,), name="engine-reports", daemon=True)
        self._receiver.start()

    def send(self, command: Command) -> None:
        with self._send_lock:
            if self._closed:
                return
            try:
                self._command_writer.send(command)
            except OSError:  # BrokenPipeError and kin: the child is gone, its requests already failed
                logger.debug("engine process gone; dropped %s", type(command).__name__)

    @property
    def alive(self) -> bool:
        # The receiving thread ends when the child's reports end: it stopped, or died.
        return not self._closed and self._receiver.is_alive()

    def join(self, timeout: float) -> None:
        """Close the command pipe (the child stops: at once if still loading), wait up to
        `timeout` seconds, then kill it; frees the pipes and the process handle. An interrupt
        while waiting (a signal) kills at once rather than leaving the child behind."""
        self._close_commands()
        with self._reap_lock:
            if self._closed:
                return
            try:
                self._process.join(timeout)
            finally:
                if self._process.is_alive():
                    if timeout > 0:
                        logger.error("the engine process did not stop within %.0f s: killing it", timeout)
                    self._process.kill()
                    self._process.join()
                self._exitcode = self._process.exitcode
                self._closed = True
                self._process.close()
        self._receiver.join(timeout)

    def _close_commands(self) -> None:
        """Close the command pipe, unless a send is stuck on it (a child that stopped reading:
        the kill that follows ends it)."""
        if self._send_lock.acquire(timeout=1.0):
            try:
                self._command_writer.close()
            finally:
                self._send_lock.release()

    def _exit_code(self) -> int | None:
        with self._reap_lock:
            if not self._closed:
                self._process.join(5.0)
                self._exitcode = self._process.exitcode
            return self._exitcode

    def _receive(self, on_report: ReportHandler) -> None:
        """Hand every report to `on_report`; when the pipe ends without `Stopped` (or a report
        cannot be read), the child died: say so."""
        started = stopped = False
        try:
            while not stopped:
                report = self._report_reader.recv()
                started = started or isinstance(report, (Started, StartFailed))
                stopped = isinstance(report, (Stopped, StartFailed))
                try:
                    on_report(report)
                except Exception:  # a front-end bug must not stop the reports of other requests
                    logger.exception("handling an engine report failed")
        except Exception as exc:  # EOFError: the child exited; anything else: its reports are unreadable
            reason = f"the engine process exited (exit code {self._exit_code()})"
            if not isinstance(exc, EOFError):
                reason = f"reading the engine process's reports failed ({type(exc).__name__}: {exc})"
                self._close_commands()  # nobody hears it any more: it stops
            logger.error("%s", reason)
            on_report(Stopped(reason) if started else StartFailed(EngineProcessDied(f"{reason} while starting")))
        finally:
            self._report_reader.close()


def _join_at_exit(host: "weakref.ref[EngineProcess]") -> None:
    """At interpreter exit: stop a host's child that `shutdown` never stopped."""
    process = host()
    if process is not None:
        process.join(10.0)


def _child_main(engine_factory: EngineFactory, max_waiting_requests: int, command_reader: Connection,
                report_writer: Connection, log_level: int) -> None:
    """The engine process: the core on its main thread, one thread moving commands off the
    pipe, one writing reports to it (`_Outbox`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands: "queue.Queue[Command]" = queue.Queue()
    outbox = _Outbox(report_writer, on_gone=lambda: commands.put(Stop()))

    def pump() -> None:
        try:
            while True:
                commands.put(command_reader.recv())
        except (EOFError, OSError):  # the server closed its end (it stopped, or died)
            if not outbox.started:  # nobody will use the engine being built: free its memory now
                os._exit(0)
            commands.put(Stop())

    threading.Thread(target=pump, name="engine-commands", daemon=True).start()
    sender = threading.Thread(target=outbox.run, name="engine-reports", daemon=True)
    sender.start()
    run_core(engine_factory, max_waiting_requests, commands, outbox.put)
    sender.join()
    report_writer.close()


class _Outbox:
    """The engine process's reports on their way to the server. The engine thread only
    queues them, so a step never waits for the server to read; a sender thread pickles and
    writes them in order, folding consecutive step reports that queued up meanwhile into one
    (`StepReport.merged`): when the server reads slower than the engine steps, its messages
    get fewer and larger instead of piling up."""

    def __init__(self, writer: Connection, on_gone: Callable[[], None]):
        self._writer, self._on_gone = writer, on_gone
        self._reports: list[Report] = []
        self._ready = threading.Condition()
        self.started = False  # `Started` was queued: the engine is built

    def put(self, report: Report) -> None:
        """Queue a report (the engine thread; never blocks on the pipe)."""
        with self._ready:
            self._reports.append(report)
            self.started = self.started or isinstance(report, Started)
            self._ready.notify()

    def run(self) -> None:
        """Send reports until the last one (`Stopped` or `StartFailed`) is sent."""
        while True:
            with self._ready:
                while not self._reports:
                    self._ready.wait()
                batch, self._reports = self._reports, []
            for report in _coalesce(batch):
                if isinstance(report, (Accepted, StartFailed)) and report.error is not None:
                    report.error = portable(report.error)
                try:
                    self._writer.send(report)
                except (BrokenPipeError, ConnectionResetError):  # the server is gone: stop serving
                    self._on_gone()
                except Exception as exc:  # a report that cannot be sent: the server must not wait for it
                    logger.exception("sending a %s to the server failed", type(report).__name__)
                    self._on_gone()
                    report = Stopped(f"the engine process could not send a report: {type(exc).__name__}: {exc}")
                    self._writer.send(report)
                if isinstance(report, (Stopped, StartFailed)):
                    return


def _coalesce(reports: list[Report]) -> list[Report]:
    """`reports` in order, each run of consecutive `StepReport`s merged into one."""
    out: list[Report] = []
    run: list[StepReport] = []
    for report in [*reports, None]:
        if isinstance(report, StepReport):
            run.append(report)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else StepReport.merged(run))
            run = []
        if report is not None:
            out.append(report)
    return out


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a ValueError, OSError or RuntimeError with its type
    and message (the classes the front end maps to HTTP answers and start-up errors)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # an exception type that cannot be rebuilt from its pickle
        kind = next((kind for kind in (ValueError, OSError) if isinstance(exc, kind)), RuntimeError)
        return kind(f"{type(exc).__name__}: {exc}")

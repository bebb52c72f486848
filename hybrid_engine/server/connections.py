"""Connection handling uvicorn leaves open: read timeouts, a connection cap that holds before
file descriptors run out, half-closed clients, and quiet logs when many connections misbehave.

uvicorn (h11) has a keep-alive timeout, but no timeout on reading a request: a client that
sends half a header and then nothing holds its connection forever (slowloris), and enough
of them exhaust the process's file descriptors, after which asyncio logs a traceback for
every failed accept and nothing, /health included, gets in. Its `limit_concurrency` answers
503 to every request while the open connections exceed it, those on connections it was
already serving included. `GuardedH11Protocol` adds:

- a read deadline: a request's head and body must arrive within `request_read_timeout`
  seconds (from the connection's opening for its first request, from the first byte for
  later ones), or the connection is closed;
- a connection cap (`max_connections`): the first connections to open are served, and a
  request on a connection beyond them gets a JSON 503 and the connection closes, while the
  served ones carry on; a connection beyond them whose request comes after a served one
  closed takes its place;
- a hard cap below the open-file limit: a connection accepted beyond it is closed at once,
  so accepting never fails for lack of file descriptors;
- half-close: a client that shuts down its sending side right after a complete request
  (`shutdown(SHUT_WR)`) still gets the response (uvicorn took the EOF for a disconnect and
  aborted the request), and one that closed its socket is still noticed within a second
  (see `eof_received`); the connection closes once the response is sent;
- malformed requests answered with the server's JSON error body instead of plain text.

`quiet_connection_logs` turns the tracebacks of connection-level OS errors into one line and
lets each such message through at most once per interval.
"""
import asyncio
import json
import logging
import resource
import socket
import threading
import time
from collections import Counter
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybrid_engine.server.errors import SERVER_ERROR, APIError
from hybrid_engine.server.limits import ServerLimits

logger = logging.getLogger(__name__)

# The request line and headers may take this many bytes (h11's own default, made explicit);
# a longer head is a 400.
MAX_HEAD_BYTES = 16 * 1024
# File descriptors kept for everything but client connections (model files, the listening
# sockets, CUDA's device files, logs): connections beyond `open file limit - this` are closed.
RESERVED_FDS = 256
QUIET_LOG_INTERVAL_S = 10.0
# How often a half-closed client's connection is checked for a reset (it has gone).
HALF_CLOSE_CHECK_S = 0.5


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit (so that the connection
    cap, not the OS, refuses connections) where allowed; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # "unlimited" still has the kernel's per-process cap (fs.nr_open, 2**20 by default)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # not allowed here: keep the soft limit
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the guards in the module doc. Subclassed per server by
    `protocol_class` to set `read_timeout`, `max_connections`, `served` (that server's
    connections within `max_connections`) and `max_open_connections`."""

    read_timeout: float
    max_connections: int
    served: set["GuardedH11Protocol"]
    max_open_connections: int

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._serving_app = self.app
        self._read_deadline: asyncio.TimerHandle | None = None
        self._refused = False  # closed at accept: over the hard cap
        self._peer_closed = False  # EOF after the request: the client shut down its sending side, or left
        self._peer_check: asyncio.TimerHandle | None = None
        self._streaming = False  # the response in progress is an event stream (SSE)
        send = self.conn.send

        def noting_send(event: h11.Event) -> bytes | None:
            if isinstance(event, h11.Response):
                self._streaming = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                      for name, value in event.headers)
            return send(event)

        self.conn.send = noting_send

    # ---- accept and close --------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_open_connections:
            self._refused = True
            transport.close()
            return
        super().connection_made(transport)
        self._take_a_place()
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self.served.discard(self)
        self._disarm_read_deadline()
        if self._peer_check is not None:
            self._peer_check.cancel()
        super().connection_lost(exc)

    def _take_a_place(self) -> bool:
        """Whether this connection is among the `max_connections` served, taking a free place
        if it was not."""
        if self not in self.served and len(self.served) < self.max_connections:
            self.served.add(self)
        return self in self.served

    async def _over_the_connection_limit(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app for a request on a connection beyond `max_connections`: a JSON 503,
        then the connection closes."""
        logger.warning("a request on a connection beyond --max-connections (%d) was answered 503",
                       self.max_connections)
        error = APIError(f"the server is serving --max-connections ({self.max_connections}) connections; "
                         "retry once one closes", status=503, type=SERVER_ERROR, code="too_many_connections")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    # ---- reading a request -------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            if self._read_deadline is None:
                self._arm_read_deadline()  # the first bytes of a keep-alive connection's next request
            # uvicorn reads `self.app` when the request's head is in.
            self.app = self._serving_app if self._take_a_place() else self._over_the_connection_limit
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm_read_deadline()  # the request is in (or the connection is done)

    def _arm_read_deadline(self) -> None:
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection whose request did not arrive within %gs", self.read_timeout)
            self.transport.close()

    # ---- half-close --------------------------------------------------------------------
    def eof_received(self) -> bool | None:
        """EOF after a complete request whose response is not complete: maybe a half-close,
        so the socket stays open for the response while `_check_peer` finds out whether the
        client is still there. The EOF can reach the server before the response starts or
        after an event stream's first bytes. Any other EOF (mid-request, idle, during a
        non-streamed response's single write) closes the connection, which aborts a request
        in progress."""
        cycle = self.cycle
        if (cycle is None or cycle.response_complete or (cycle.response_started and not self._streaming)
                or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)):
            return None
        self._peer_closed = True
        # TCP cannot tell shutdown(SHUT_WR) from close() until data is sent: a closed socket
        # answers data with a reset. Before the response, an interim "100 Continue" is the
        # one thing HTTP/1.1 lets a server send, and clients skip it (none to HTTP/1.0
        # clients, which are then answered whether or not they are still there); in an
        # event stream, an SSE comment line, which clients skip too. Both go between whole
        # messages: the app writes each event in one piece.
        if not cycle.response_started and self.conn.their_http_version != b"1.0":
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                          reason=b"Continue")))
            cycle.waiting_for_100_continue = False
        elif cycle.response_started:
            self.transport.write(self.conn.send(h11.Data(data=b": connection check\n\n")))
        self._peer_check = self.loop.call_later(HALF_CLOSE_CHECK_S, self._check_peer)
        return True

    def _check_peer(self) -> None:
        """While answering a half-closed client: a reset means it has gone (aborting the
        request, as any disconnect does); otherwise look again later."""
        self._peer_check = None
        if self.transport.is_closing():
            return
        if self.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()
        else:
            self._peer_check = self.loop.call_later(HALF_CLOSE_CHECK_S, self._check_peer)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._peer_closed and not self.transport.is_closing():
            self.transport.close()  # nothing more can come from a client that half-closed

    # ---- errors ------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """A malformed request (or a head over MAX_HEAD_BYTES): 400 with the JSON error body, then close."""
        body = json.dumps(APIError(msg, code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def protocol_class(limits: ServerLimits, max_open_connections: int) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol for one server's limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout": limits.request_read_timeout, "max_connections": limits.max_connections,
                 "served": set(), "max_open_connections": max_open_connections})


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` under `limits` (other uvicorn options in `kwargs`).

    `GuardedH11Protocol` caps the connections served (`max_connections`), not uvicorn's
    `limit_concurrency`, which would refuse the served connections' requests too. Connections
    beyond the open-file limit less RESERVED_FDS are closed at accept (with a warning at
    start-up if that is below max_connections).
    """
    fd_cap = raise_open_file_limit() - RESERVED_FDS
    if fd_cap < limits.max_connections:
        logger.warning("--max-connections %d is above what the open-file limit allows (%d connections): "
                       "connections beyond %d are closed unanswered", limits.max_connections, fd_cap, fd_cap)
    # No WebSockets (ws="none"): an upgraded connection would leave GuardedH11Protocol
    # without its connection_lost, holding its place in `served` for good.
    return uvicorn.Config(app, http=protocol_class(limits, max(fd_cap, 1)), ws="none",
                          timeout_keep_alive=limits.timeout_keep_alive, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          **kwargs)


class _QuietConnectionLogs(logging.Filter):
    """One line for a connection-level OS error (no traceback), and each message (by its
    template) at most once per `interval` seconds, the next one counting what was held back."""

    def __init__(self, interval: float):
        super().__init__()
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held = Counter[str]()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = str(record.msg).split("\n", 1)[0]  # asyncio puts the transport (per connection) on later lines
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self._interval) < self._interval:
                self._held[key] += 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) or held:
            record.msg, record.args = record.getMessage(), None
            if isinstance(exc, OSError):
                record.msg += f": {type(exc).__name__}: {exc}"
                record.exc_info = record.exc_text = None
            if held:
                record.msg += f" ({held} more like this in the last {self._interval:g}s not logged)"
        return True


def quiet_connection_logs(interval: float = QUIET_LOG_INTERVAL_S) -> None:
    """Tame what misbehaving connections make asyncio, uvicorn and this module log (failed
    accepts, malformed requests, the connection cap): see `_QuietConnectionLogs`. Call after
    uvicorn configured logging (creating its Config does)."""
    quiet = _QuietConnectionLogs(interval)
    for name in ("asyncio", "uvicorn.error", __name__):
        logging.getLogger(name).addFilter(quiet)

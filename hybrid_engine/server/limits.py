"""The HTTP server's own limits (what a client may cost it before any model work), and the
request body-size limit that enforces the first of them.

`ServerLimits` holds them with their defaults (the CLI flags of the same names);
`connections.py` applies the connection-level ones to uvicorn. `BodySizeLimit` answers a
body larger than `max_request_body_bytes` with a 413 before reading it: at once when the
declared Content-Length is too large, and as soon as the count passes the limit for a
chunked body (which then never reaches the endpoint).
"""
import math
from dataclasses import dataclass, fields

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybrid_engine.server.errors import APIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """Limits on what one client can make the HTTP server hold (flags `--max-request-body-bytes`,
    `--max-connections`, `--timeout-keep-alive`, `--request-read-timeout`; docs/server.md).

    max_request_body_bytes: a larger request body is answered with 413 before it is read.
    max_connections: this many open connections are served (the first to open); a request on
        a further one is answered 503 and that connection closed.
    timeout_keep_alive: seconds an idle keep-alive connection stays open between requests.
    request_read_timeout: seconds a request's head and body have to arrive in full (from the
        connection's opening for its first request, from the first byte for later ones);
        a connection still sending after that is closed (slowloris).
    """

    max_request_body_bytes: int = 8 * MIB
    max_connections: int = 2048
    timeout_keep_alive: float = 5.0
    request_read_timeout: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.type is int and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
            if f.type is float and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value!r}")


def request_too_large(max_bytes: int) -> APIError:
    """The 413 for a body over the limit."""
    return APIError(f"the request body is larger than this server accepts ({max_bytes} bytes, "
                    f"--max-request-body-bytes)", status=413, code="request_too_large")


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length header's value (h11 already refused a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


class BodySizeLimit:
    """ASGI middleware: a request whose body is larger than `max_bytes` gets a 413 JSON error
    and the endpoint never sees its body.

    A declared Content-Length over the limit is answered before a byte of the body is read;
    a chunked body is counted as it arrives and answered the moment it passes the limit.
    Either way the endpoint then reads a disconnect and whatever it answers is dropped. The
    connection stays open: uvicorn discards the rest of the body as it comes (the request
    read timeout bounds how long), so a client that sends its whole body before reading
    still gets the 413 rather than a reset.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await request_too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0
        refused = started = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await request_too_large(self.max_bytes).response()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 answered this request
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

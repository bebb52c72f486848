"""OpenAI-style error bodies, and the handlers that give every failure that shape.

Every error the server answers with is `{"error": {"message", "type", "param", "code"}}`,
including FastAPI's own validation failures (422 by default, 400 here, as OpenAI does),
malformed JSON, unknown routes and unexpected exceptions, so clients can rely on one
format whatever went wrong.
"""
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid_engine.prompts import ContextLengthExceeded
from hybrid_engine.sampling_params import ParameterError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

# Suffixes of pydantic error types that mean "wrong JSON type" rather than "wrong value".
_TYPE_ERRORS = ("_type", "_parsing")
# An error repeats at most this much of one value the client sent (a field name, a key, a
# refused value), and a validation message at most MAX_MESSAGE_CHARS in all: an error
# should never be larger than the request (a 250 kB logit_bias, a 1 MB unknown key).
MAX_ECHOED_CHARS = 80
MAX_MESSAGE_CHARS = 400


def clipped(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """`text`, cut to `limit` characters and marked "..." where it was cut."""
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error to answer with: HTTP status plus the OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = "invalid_value", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON error object (also what a stream sends as its last event)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response carrying this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_input(exc: ValueError) -> APIError:
    """The 400 for a ValueError of the library's validation (`SamplingParams`,
    `hybrid_engine.prompts`, `add_request`), naming the field when the error does."""
    message = clipped(str(exc), MAX_MESSAGE_CHARS)  # (the library's messages repeat the value whole)
    if isinstance(exc, ParameterError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthExceeded) else "invalid_value"
        return APIError(message, param=exc.param, code=code)
    return APIError(message)


# Request fields of older vLLM releases, with what replaces them here (as in vLLM now).
_RENAMED = {
    "guided_json": 'use structured_outputs: {"json": schema}',
    "guided_regex": 'use structured_outputs: {"regex": pattern}',
    "guided_choice": 'use structured_outputs: {"choice": [...]}',
    "guided_grammar": "grammars other than JSON schema, regex and choice are not supported",
    "guided_decoding_backend": "structured outputs have one backend here: leave it out",
    "guided_whitespace_pattern": 'use structured_outputs: {"disable_any_whitespace": true} or leave it out',
}


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn pydantic's first complaint into one readable 400 naming the parameter."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    err = errors[0]
    # FastAPI prefixes body fields with "body"; union/validator tags are not parameter names.
    loc = [clipped(str(p)) for p in err.get("loc", ()) if p != "body" and not str(p).startswith(("function-", "list["))]
    # A check across fields (a model validator) names its field in the error's context.
    param = ".".join(loc) or (err.get("ctx") or {}).get("param")
    kind = err.get("type", "")
    message = clipped(str(err.get("msg", "invalid value")).removeprefix("Value error, "), MAX_MESSAGE_CHARS)
    if kind == "json_invalid":
        return APIError(f"request body is not valid JSON: {message}", code="invalid_json")
    if kind == "missing":
        if param is None:
            return APIError("request body is missing: send a JSON object", code="invalid_json")
        return APIError(f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        hint = _RENAMED.get(param)
        return APIError(f"unrecognized request argument supplied: {param}" + (f" ({hint})" if hint else ""),
                        param=param, code="unknown_parameter")
    if kind.endswith(_TYPE_ERRORS):
        if param is None:
            return APIError("the request body must be a JSON object (sent with Content-Type: application/json)",
                            code="invalid_type")
        return APIError(f"{param}: {message}", param=param, code="invalid_type")
    code = "not_implemented" if kind == "not_implemented" else "invalid_value"
    named = param is None or message.startswith(param)  # (messages of checks that name their field)
    return APIError(message if named else f"{param}: {message}", param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through `APIError` so all error bodies share the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI raises 400 "There was an error parsing the body" for bodies json.loads
        # cannot even decode (e.g. nesting deeper than the recursion limit).
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(str(exc.detail), status=exc.status_code, code=code,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500, type=SERVER_ERROR,
                        code="internal_error").response()

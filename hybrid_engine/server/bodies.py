"""Request bodies: read on the event loop, decoded and validated off it, failing as FastAPI
would.

The two generating routes read their JSON bodies themselves instead of declaring a body
parameter: FastAPI would decode and validate on the event loop, and a body of megabytes
(two million one-token prompts fit in 8 MB) holds the loop for seconds, stalling /health
and every other client (docs/server.md, "Limits"). The route reads the bytes
(`read_body`), and the handler decodes and validates them (`validated`) in the same job on
the tokenizer thread that builds the engine inputs (`serving.OpenAIServing.prepare`). The
errors raised are the ones FastAPI's body parameter raises, so
`errors.install_error_handlers` answers alike, and `document_bodies` puts the request
models back into the OpenAPI schema.
"""
import email.message
import json
from typing import TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)
_NO_BODY = object()
_UNPARSEABLE = "There was an error parsing the body"  # (FastAPI's own 400 detail)


def _decoded(raw: bytes, content_type: str | None) -> object:
    """The body as FastAPI (strict_content_type, its default) would validate it: _NO_BODY
    when empty, parsed JSON for a JSON content type, else the bytes (which then fail
    validation). No Content-Type is not JSON: a browser may send such a POST cross-site
    without a CORS preflight."""
    if not raw:
        return _NO_BODY
    if not content_type:
        return raw
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    if message.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
        return raw
    return json.loads(raw)


def validated(model: type[Model], raw: bytes, content_type: str | None) -> Model:
    """A body decoded and validated as `model`, raising what FastAPI's own body parameter
    would (a RequestValidationError, or its 400 for a body it cannot parse)."""
    try:
        body = _decoded(raw, content_type)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from exc
    except Exception as exc:  # e.g. nesting deeper than the recursion limit
        raise HTTPException(status_code=400, detail=_UNPARSEABLE) from exc
    if body is _NO_BODY:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]) from exc


async def read_body(request: Request) -> bytes:
    """The request's body. One that cannot be read (the client left, or
    `limits.BodySizeLimit` refused it) is FastAPI's 400, as with its own body parameter; a
    middleware's HTTPException passes through."""
    try:
        return await request.body()
    except HTTPException:
        raise
    except Exception as exc:
        raise HTTPException(status_code=400, detail=_UNPARSEABLE) from exc


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request models of the POST routes that read their own bodies (`read_body`)
    into the app's OpenAPI schema (/docs and /openapi.json), where FastAPI would have put
    them: FastAPI's own schema, with each route's request body added."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)  # FastAPI's, cached by it as app.openapi_schema: patched in place
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                                "content": {"application/json": {"schema": ref}}}
        return app.openapi_schema
    app.openapi = openapi

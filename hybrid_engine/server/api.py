"""The FastAPI application: routes, lifespan, and client-disconnect handling."""
import asyncio
import contextlib
import email.message
import json
from typing import Awaitable, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.chat import ChatHandler
from hybrid_engine.server.completions import CompletionsHandler
from hybrid_engine.server.errors import install_error_handlers
from hybrid_engine.server.limits import BodySizeLimit, ServerLimits
from hybrid_engine.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from hybrid_engine.server.serving import TokenizerThread, TokenTexts

# nginx's "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED_REQUEST = 499
Body = TypeVar("Body", bound=BaseModel)


_NO_BODY = object()


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


def _validated(model: type[Body], raw: bytes, content_type: str | None) -> Body:
    """Decode and validate a body, raising what FastAPI's own body parameter would (so the
    error handlers answer alike)."""
    try:
        body = _decoded(raw, content_type)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from exc
    except Exception as exc:  # e.g. nesting deeper than the recursion limit
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    if body is _NO_BODY:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]) from exc


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as `model`, decoded and validated on a worker thread: a body
    of megabytes takes seconds there, which on the event loop would stall every client
    (docs/server.md, "Limits"). A body that cannot be read (the client left, or
    `BodySizeLimit` refused it) is FastAPI's 400, as with its own body parameter."""
    try:
        raw = await request.body()
    except HTTPException:  # (a middleware's own answer, as FastAPI lets it through)
        raise
    except Exception as exc:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    return await asyncio.to_thread(_validated, model, raw, request.headers.get("content-type"))


def _document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request models of routes that parse their own bodies (`parse_body`) into the
    app's OpenAPI schema, where FastAPI would have put them (/docs and /openapi.json)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                                "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


async def _disconnected(request: Request) -> None:
    """Return when the client hangs up (call only after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it if the client disconnects first.

    A non-streamed response is produced only at the end, so without this a client that
    gave up would keep its engine request generating (and holding KV blocks and a
    Mamba slot) until max_tokens. Cancelling runs the handler's cleanup, which aborts
    the engine requests. (Streamed bodies are cancelled by Starlette itself.)
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


def build_app(llm: AsyncLLM, served_model_name: str | None = None, limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The OpenAI-compatible app over `llm`, refusing bodies over `limits.max_request_body_bytes`
    (the connection limits are uvicorn's: `connections.uvicorn_config`); the app's shutdown
    stops the engine thread."""
    model_name = served_model_name or llm.info.model_name
    tokenizer_thread = TokenizerThread(llm.info.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Runs after uvicorn drained (or cancelled) the open requests: abort what is
        # left in the engine and stop its thread, off the event loop.
        tokenizer_thread.close()
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="hybrid-engine OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    install_error_handlers(app)
    texts = TokenTexts(llm.info.tokenizer)
    completions = CompletionsHandler(llm, model_name, tokenizer_thread, texts)
    chat = ChatHandler(llm, model_name, tokenizer_thread, texts)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        """OpenAI completions (text or token-id prompts)."""
        body = await parse_body(request, CompletionRequest)
        return await cancel_on_disconnect(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        """OpenAI chat completions."""
        body = await parse_body(request, ChatCompletionRequest)
        return await cancel_on_disconnect(request, chat.create(body))

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, root=llm.info.model_name, max_model_len=llm.info.max_request_tokens)

    _document_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest})

    @app.get("/v1/models")
    async def list_models() -> Response:
        """The one served model."""
        return Response(ModelList(data=[model_card()]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        """The served model's card (404 for any other name; names may hold slashes)."""
        completions.check_model(model_id)
        return Response(model_card().model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread serves, 503 otherwise."""
        if llm.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.head("/health", include_in_schema=False)
    async def health_head() -> Response:
        """GET /health's status, without the body (load balancers probe with HEAD)."""
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(generate_latest(llm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

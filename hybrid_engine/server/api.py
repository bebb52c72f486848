"""The FastAPI application: routes, lifespan, and client-disconnect handling."""
import asyncio
import contextlib
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from hybrid_engine import __version__
from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.bodies import document_bodies, read_body
from hybrid_engine.server.chat import ChatHandler
from hybrid_engine.server.completions import CompletionsHandler
from hybrid_engine.server.errors import install_error_handlers
from hybrid_engine.server.limits import BodySizeLimit, ServerLimits
from hybrid_engine.server.protocol import ModelCard, ModelList
from hybrid_engine.server.serving import TokenizerThread, TokenTexts
from hybrid_engine.server.tokenize import DetokenizeRequest, TokenizeHandler, TokenizeRequest

# nginx's "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED_REQUEST = 499


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


def build_app(llm: AsyncLLM, served_model_names: list[str] | None = None,
              limits: ServerLimits = ServerLimits(), chat_template: str | None = None,
              reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over `llm`, refusing bodies over `limits.max_request_body_bytes`
    (the connection limits are the HTTP protocol's: `connections.uvicorn_config`), rendering chat
    with `chat_template` (default: the tokenizer's) and splitting chat replies' reasoning with
    `reasoning_parser` (`reasoning.REASONING_PARSERS`; default: none), parsing tool calls out
    of them with `tool_call_parser` (`tool_calls.TOOL_CALL_PARSERS`; default: none, so tools can
    only be shown); the app's shutdown stops the engine thread."""
    model_names = served_model_names or [llm.info.model_name]
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
    completions = CompletionsHandler(llm, model_names, tokenizer_thread, texts)
    chat = ChatHandler(llm, model_names, tokenizer_thread, texts, chat_template=chat_template,
                       reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)

    async def answer(request: Request, handle: Callable[[bytes, str | None], Awaitable[Response]]) -> Response:
        # The body is read before the disconnect watcher starts (both read the same stream);
        # all after it, decoding included, is cancelled if the client leaves.
        raw = await read_body(request)
        return await cancel_on_disconnect(request, handle(raw, request.headers.get("content-type")))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        """OpenAI completions (text or token-id prompts)."""
        return await answer(request, completions.create)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        """OpenAI chat completions."""
        return await answer(request, chat.create)

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=llm.info.model_name, max_model_len=llm.info.max_request_tokens)

    @app.get("/v1/models")
    async def list_models() -> Response:
        """The served model, a card per served name."""
        return Response(ModelList(data=[model_card(name) for name in model_names]).model_dump_json(),
                        media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        """The served model's card (404 for any other name; names may hold slashes)."""
        completions.check_model(model_id)
        return Response(model_card(model_id).model_dump_json(), media_type="application/json")

    tokenize = TokenizeHandler(chat)

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> Response:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as generation would build them."""
        return await answer(request, tokenize.tokenize)

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text."""
        return await answer(request, tokenize.detokenize)

    document_bodies(app, {"/v1/completions": completions.body_model, "/v1/chat/completions": chat.body_model,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})

    @app.get("/version")
    async def version() -> Response:
        """The server's version."""
        return JSONResponse({"version": __version__})

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

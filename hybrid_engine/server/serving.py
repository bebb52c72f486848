"""What both endpoints share: model check, prompt checks, output budget, submission,
logprob rows, and the two response modes (collect everything, or stream SSE).

A validated request becomes engine inputs here: prompts are tokenized on the tokenizer
thread (`TokenizerThread`, with the front end's own tokenizer copy) and checked with the
engine's own checks (`hybrid_engine.prompts`, `SamplingParams`), so that every "bad
request" answer -- empty, out-of-vocabulary id, too long, out of range -- is a 400 naming
the field, decided before anything is queued.

What can take long stays off the event loop, so /health and other clients' streams never
wait on one big request: tokenizing (seconds for a prompt of megabytes) runs on the
tokenizer thread, building a non-streamed response (tens of MB with logprobs) on a worker
thread (`render_off_loop`).
"""
import asyncio
import concurrent.futures
import copy
import json
import logging
import math
import threading
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Generic, TypeVar

from pydantic import BaseModel
from pydantic_core import to_json
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from hybrid_engine.detokenizer import REPLACEMENT_CHAR
from hybrid_engine.prompts import check_max_tokens, check_params, check_prompt, encode_prompt
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling import derive_seed
from hybrid_engine.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams
from hybrid_engine.server.async_llm import AsyncLLM, EngineUnavailable, Generation, RequestFailed
from hybrid_engine.server.bodies import validated
from hybrid_engine.server.engine_core import QueueFull
from hybrid_engine.server.errors import RATE_LIMIT, SERVER_ERROR, APIError, clipped, invalid_input
from hybrid_engine.server.protocol import (ChatCompletionResponse, CompletionResponse, PromptTokensDetails,
                                           SamplingRequest, UsageInfo)
from hybrid_engine.server.tool_calls import user_schema_path
from hybrid_engine.structured.grammar import check_grammar
from hybrid_engine.tokenizer import TokenBytes

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor.
LOGPROB_FLOOR = -9999.0
RETRY_AFTER_S = "1"

# (token id, its logprob, [(alternative id, logprob), ...] most likely first)
LogprobRow = tuple[int, float, list[tuple[int, float]]]
T = TypeVar("T")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def logprob_rows(out: RequestOutput, top_n: int, new_only: bool) -> list[LogprobRow]:
    """Logprob rows of all output tokens, or of those this output added (streaming)."""
    if out.logprobs is None:
        return []
    tokens = out.new_token_ids if new_only else out.output_token_ids
    first = len(out.output_token_ids) - len(tokens)  # the engine's logprobs list is cumulative
    rows = []
    for token, entry in zip(tokens, out.logprobs[first:]):
        # The engine puts the sampled token first, then the top-n (deduplicated); sorting
        # recovers the top-n whether or not the sampled token is among them.
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        rows.append((token, _finite(entry.get(token, LOGPROB_FLOOR)), [(t, _finite(lp)) for t, lp in top]))
    return rows


def usage(finals: list[RequestOutput], n: int = 1) -> UsageInfo:
    """The usage block of a response: token counts summed over its requests' final outputs
    (in choice order), each prompt's counted once for its `n` choices, as OpenAI counts."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals[::n])
    completion_tokens = sum(len(out.output_token_ids) for out in finals)
    cached_tokens = sum(out.num_cached_tokens for out in finals[::n])
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# Characters JSON may leave raw in a string that Python's str.splitlines ends a line at (and
# so httpx's `aiter_lines`): written as \u escapes, so that an SSE event stays one line for
# every client (the JSON is the same). Replaced one by one: `str.translate` looks at every
# character of an event once any is non-ASCII (~1 ms for a 20 KB logprobs chunk).
_LINE_BREAKS_IN_JSON = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def _sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying `payload` as JSON on its one data line."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    for raw, escaped in _LINE_BREAKS_IN_JSON:
        data = data.replace(raw, escaped)
    return f"data: {data}\n\n"


# Requests with a larger body go to the tokenizer thread's second lane, so that a prompt of
# megabytes (seconds to encode) never holds up the ordinary requests behind it. By the body's
# bytes, which bound its characters of text and its messages (each one template work).
LARGE_REQUEST_BYTES = 1 << 16


class TokenizerThread:
    """The threads on which the HTTP server turns request bodies into engine inputs
    (`OpenAIServing.prepare`: decoding the JSON, validating it, rendering chat templates,
    tokenizing), one job per request: one thread for bodies of up to LARGE_REQUEST_BYTES,
    one for larger ones, each with a tokenizer copy of its own (`tokenizer`, on that thread)
    that nothing else uses.

    Off the event loop, so that a body of megabytes (seconds to decode and encode) stalls no
    one else; two lanes, so that it does not hold up the small requests behind it either
    (docs/server.md, Limits), and so that one large request at a time takes the memory that
    its decoding and encoding need; one thread per copy, because encoding can change the
    tokenizer (transformers sets the Rust tokenizer's `encode_special_tokens` per call),
    which must not happen while another thread uses it. Work still queued when its client
    hangs up is dropped.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self._local = threading.local()
        copies = (tokenizer, None if tokenizer is None else copy.deepcopy(tokenizer))
        self._lanes = [concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                                             initializer=self._bind, initargs=(copy_,))
                       for name, copy_ in zip(("tokenizer", "tokenizer-large"), copies)]

    def _bind(self, tokenizer: Any | None) -> None:
        self._local.tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer of the lane this code runs on (only on a lane's thread)."""
        try:
            return self._local.tokenizer
        except AttributeError:
            raise RuntimeError("TokenizerThread.tokenizer is only available on a tokenizer thread") from None

    async def run(self, fn: Callable[..., T], *args: Any, body_bytes: int) -> T:
        """`fn(*args)` on the lane for a request body of `body_bytes`."""
        lane = self._lanes[body_bytes > LARGE_REQUEST_BYTES]
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def close(self) -> None:
        """Stop the threads (queued work is dropped)."""
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)


class TokenTexts:
    """The texts and bytes logprobs show for token ids, from a tokenizer copy of its own.

    Used from the event loop (streams) and from response-building threads at once: it only
    decodes (`decode`, `convert_ids_to_tokens` only read the Rust tokenizer), and it never
    shares a tokenizer with the tokenizer thread, whose encoding writes to its copy.
    """

    def __init__(self, tokenizer: Any | None):
        self._tokenizer = None if tokenizer is None else copy.deepcopy(tokenizer)
        # Looked up once: logprobs ask for every generated token and its 20 alternatives, so
        # a big response asks for the same few thousand tokens a million times (a decode is
        # ~2 us, a dict hit ~50 ns). At most one entry per vocabulary id.
        self._num_known = 0 if tokenizer is None else len(self._tokenizer)
        self._bytes = None if tokenizer is None else TokenBytes(self._tokenizer)
        self._texts: dict[int, str] = {}
        self._byte_strings: dict[int, bytes] = {}

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs (`token_id:N` when the model has no tokenizer, as vLLM;
        "" for an id of the model's padded vocabulary that the tokenizer does not have)."""
        text = self._texts.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = "" if token_id >= self._num_known else self._tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (part of a character included), for logprobs."""
        raw = self._byte_strings.get(token_id)
        if raw is None:
            raw = self.token_text(token_id).encode("utf-8") if self._bytes is None else self._bytes(token_id)
            self._byte_strings[token_id] = raw
        return raw

    def legacy_logprobs_entry(self, sampled: tuple[int, float],
                              top: list[tuple[int, float]]) -> tuple[str, dict[str, float]]:
        """One position of the legacy completions format: the sampled token's key and the
        `top_logprobs` dict, which holds the sampled token first (as OpenAI's and vLLM's
        do, so up to n + 1 entries), then the alternatives. Keys are token texts; a token
        whose text is not whole characters (U+FFFD) or already taken by another token is
        keyed by its bytes, "bytes:\\xe2\\x80" (as OpenAI writes such tokens), and failing
        that by "token_id:N". The sampled token's key is what `tokens` lists, so
        `top_logprobs[i][tokens[i]]` is always its logprob."""
        entries: dict[str, float] = {}
        for token_id, logprob in [sampled, *(alt for alt in top if alt[0] != sampled[0])]:
            key = self.token_text(token_id)
            if key in entries or REPLACEMENT_CHAR in key:
                key = "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))
            if key in entries:
                key = f"token_id:{token_id}"
            entries[key] = logprob
        return next(iter(entries)), entries


def _json_choice_by_choice(response: CompletionResponse | ChatCompletionResponse) -> bytes:
    """The response as JSON, serialized one choice at a time: pydantic holds the GIL through a
    whole dump (~5 ms per MB), and with it the event loop and the engine thread; between
    choices they get their turn. (Quotes inside JSON strings are escaped, so the empty
    `"choices":[]` can only be the key.)"""
    head, tail = to_json(response.model_copy(update={"choices": []})).split(b'"choices":[]', 1)
    return b"".join((head, b'"choices":[', b",".join(map(to_json, response.choices)), b"]", tail))


async def render_off_loop(build: Callable[[], CompletionResponse | ChatCompletionResponse]) -> Response:
    """A non-streamed JSON response, built and serialized on a worker thread: with logprobs
    it can run to tens of MB, which on the event loop would stall every other client."""

    def render() -> Response:
        return Response(_json_choice_by_choice(build()), media_type="application/json")

    return await asyncio.to_thread(render)


EngineInputs = list[tuple[list[int], SamplingParams]]  # (prompt token ids, params) per prompt
Body = TypeVar("Body", bound=SamplingRequest)


class OpenAIServing(Generic[Body]):
    """Base of the endpoint handlers: turns request bodies into engine inputs, outputs into
    responses.

    `prepare` runs on `tokenizer_thread`, and with it `engine_inputs`, `prompt_ids`,
    `sampling_params` and what calls them."""

    body_model: type[Body]  # the endpoint's request model

    def __init__(self, llm: AsyncLLM, served_model_names: list[str], tokenizer_thread: TokenizerThread,
                 texts: TokenTexts):
        self.llm, self.info, self.served_model_names = llm, llm.info, served_model_names
        self.tokenizer_thread, self.texts = tokenizer_thread, texts

    async def prepare(self, raw: bytes, content_type: str | None) -> tuple[Body, EngineInputs]:
        """The request (the body decoded and validated, `bodies.validated`) and its engine
        inputs, built in one job on the tokenizer lane for the body's size: the decoded body
        is not kept waiting for a second turn on the lane, and the job is dropped if the
        client leaves while it is queued."""
        return await self.tokenizer_thread.run(self._prepared, raw, content_type, body_bytes=len(raw))

    def _prepared(self, raw: bytes, content_type: str | None) -> tuple[Body, EngineInputs]:
        request = validated(self.body_model, raw, content_type)
        self.check_model(request.model)
        return request, self.engine_inputs(request)

    def engine_inputs(self, request: Body) -> EngineInputs:
        """(prompt token ids, params) per prompt, checked (on the tokenizer thread)."""
        raise NotImplementedError

    # ---- request checks ----------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent or one of the served names."""
        if model is not None and model not in self.served_model_names:
            served = ", ".join(map(repr, self.served_model_names))
            raise APIError(f"the model {clipped(repr(model))} does not exist; this server serves {served}",
                           status=404, param="model", code="model_not_found")

    def response_model(self, request: SamplingRequest) -> str:
        """The `model` a response names: the one the request named, else the first served
        name (as vLLM answers)."""
        return request.model or self.served_model_names[0]

    def prompt_ids(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, checked against the model (`hybrid_engine.prompts`, as the
        engine checks it): 400 naming `param` for no tokenizer, an empty prompt, an id outside
        the vocabulary, or no room left to generate."""
        try:
            token_ids = encode_prompt(prompt, self.tokenizer_thread.tokenizer, param, add_special_tokens)
            check_prompt(token_ids, self.info.limits, param)
        except ValueError as exc:
            raise invalid_input(exc) from exc
        return token_ids

    def sampling_params(self, request: SamplingRequest, prompt_len: int, max_tokens: int | None,
                        max_tokens_param: str, logprobs: int | None,
                        unset_max_tokens: int | None = None) -> SamplingParams:
        """Engine params, checked as the engine checks them (400 naming the field). An unset
        max_tokens is `unset_max_tokens` where the context leaves that much room, else all
        the room it leaves (chat: all of it, as vLLM and OpenAI)."""
        limits = self.info.limits
        room = limits.max_request_tokens - prompt_len
        try:
            if max_tokens is not None:
                check_max_tokens(prompt_len, max_tokens, limits, max_tokens_param)
            else:
                max_tokens = room if unset_max_tokens is None else min(unset_max_tokens, room)
            params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **request.sampling_kwargs())
            check_params(params, limits, self.info.tokenizer)
            if params.structured_outputs is not None:
                check_structured_outputs(request, params.structured_outputs)
        except ValueError as exc:
            raise invalid_input(exc) from exc
        return params

    @staticmethod
    def choices(requests: list[tuple[list[int], SamplingParams]], n: int) -> list[tuple[list[int], SamplingParams]]:
        """`n` engine requests per prompt (OpenAI's `n`), prompt by prompt, so that choice j
        of prompt i is request (and choice index) i * n + j. Choice j > 0 of a seeded request
        draws with `derive_seed(seed, -j)`: the sampling noise is a function of the seed, so one
        seed would give n identical choices, and the engine derives its unseeded requests'
        seeds from counters >= 0 (with the engine seed, often the same 0 a client sends), so a
        negative counter keeps the choices' streams apart from those. Unseeded choices each
        get the engine's own seed."""
        return [(ids, params if j == 0 or params.seed is None else replace(params, seed=derive_seed(params.seed, -j)))
                for ids, params in requests for j in range(n)]

    # ---- running -----------------------------------------------------------------------
    def check_num_prompts(self, num_prompts: int, n: int = 1) -> None:
        """400 for more sequences (prompts x `n` choices) than one request may bring
        (`--max-prompts-per-request`) or than the server ever admits at once (429 would
        never clear), naming `prompt` when the prompts alone are too many, else `n`."""
        total = num_prompts * n
        param = "prompt" if n == 1 or num_prompts > self.llm.max_prompts_per_request else "n"
        what = f"{num_prompts} prompts in one request" if param == "prompt" else \
            f"{total} sequences in one request ({num_prompts} prompt(s) x n={n} choices)"
        if total > self.llm.max_prompts_per_request:
            raise APIError(f"{param}: {what}; this server takes at most {self.llm.max_prompts_per_request} per "
                           f"request (--max-prompts-per-request)", param=param)
        if total > self.llm.max_in_flight:
            raise APIError(f"{param}: {what}; this server admits at most {self.llm.max_in_flight} requests at once",
                           param=param)

    async def submit(self, request_id: str, requests: list[tuple[list[int], SamplingParams]]) -> Generation:
        """Hand the requests to the engine, mapping refusals to HTTP errors."""
        try:
            return await self.llm.submit(request_id, requests)
        except QueueFull as exc:
            raise APIError(str(exc), status=429, type=RATE_LIMIT, code="rate_limit_exceeded",
                           headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineUnavailable as exc:
            raise APIError(str(exc), status=503, type=SERVER_ERROR, code="engine_unavailable",
                           headers={"Retry-After": RETRY_AFTER_S}) from exc
        except ValueError as exc:
            raise invalid_input(exc) from exc
        except Exception as exc:
            raise APIError(f"the engine could not take the request: {type(exc).__name__}: {exc}", status=500,
                           type=SERVER_ERROR, code="internal_error") from exc

    @staticmethod
    async def collect(generation: Generation, num_requests: int) -> list[RequestOutput]:
        """Wait for every request's final output (a failed request -> 500)."""
        finals: list[RequestOutput] = [None] * num_requests  # type: ignore[list-item]
        try:
            async for index, out in generation:
                if out.finished:
                    finals[index] = out
        except RequestFailed as exc:
            raise APIError(str(exc), status=500, type=SERVER_ERROR, code="internal_error") from exc
        finally:
            generation.close()
        return finals

    @staticmethod
    def stream(generation: Generation, events: AsyncIterator[BaseModel]) -> StreamingResponse:
        """An SSE response of `events`, ending in `data: [DONE]`.

        An error after the stream started (status 200 already sent) becomes an OpenAI
        error event before [DONE]. Closing the generation -- normally, on error, or when
        Starlette cancels the body on client disconnect -- aborts what is unfinished; the
        background task covers a body that never started.
        """

        async def body() -> AsyncIterator[str]:
            try:
                try:
                    async for event in events:
                        yield _sse(event)
                except Exception as exc:  # this request fails alone; the server goes on
                    if not isinstance(exc, RequestFailed):
                        logger.exception("error while streaming a response")
                    yield _sse(APIError(str(exc), status=500, type=SERVER_ERROR, code="internal_error").body())
                yield "data: [DONE]\n\n"
            finally:
                generation.close()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(generation.close))


def check_structured_outputs(request: SamplingRequest, params: StructuredOutputsParams) -> None:
    """A request's grammar compiles (`check_grammar`), else a ParameterError naming the field
    the client sent it in (`SamplingRequest.grammar_field`), and for a forced tool call the
    path inside the tool's parameters."""
    try:
        check_grammar(params)
    except ParameterError as error:
        param = request.grammar_field
        if param is None:
            raise
        message = str(error).replace(error.param, param, 1)
        raise ParameterError(param, user_schema_path(message) if param == "tool_choice" else message) from None

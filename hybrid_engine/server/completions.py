"""POST /v1/completions: text or token-id prompts, `n` choices per prompt."""
import uuid
from typing import AsyncIterator

from starlette.responses import Response

from hybrid_engine.request import RequestOutput
from hybrid_engine.server.async_llm import Generation
from hybrid_engine.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from hybrid_engine.server.serving import EngineInputs, OpenAIServing, logprob_rows, render_off_loop, usage

# Tokens a completion without max_tokens generates (fewer where the context ends first):
# OpenAI's legacy completions and vLLM default to 16.
DEFAULT_MAX_TOKENS = 16


class CompletionsHandler(OpenAIServing[CompletionRequest]):
    """Serves legacy completions, streamed or not, with OpenAI's legacy logprobs format."""

    body_model = CompletionRequest

    async def create(self, raw: bytes, content_type: str | None) -> Response:
        """Validate, run, and answer one completions request (its body's bytes)."""
        request, inputs = await self.prepare(raw, content_type)
        requests = self.choices(inputs, request.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = await self.submit(request_id, requests)
        if request.stream:
            return self.stream(generation, self._chunks(request, request_id, generation))
        finals = await self.collect(generation, len(requests))
        return await render_off_loop(lambda: self._response(request, request_id, finals))

    def engine_inputs(self, request: CompletionRequest) -> EngineInputs:
        """(prompt token ids, params) per prompt, checked (on the tokenizer thread)."""
        self.check_num_prompts(len(request.prompt), request.n)
        prompts = [self.prompt_ids(p, "prompt") for p in request.prompt]
        return [(ids, self.sampling_params(request, len(ids), request.max_tokens, "max_tokens", request.logprobs,
                                           unset_max_tokens=DEFAULT_MAX_TOKENS))
                for ids in prompts]

    def _response(self, request: CompletionRequest, request_id: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=out.text or "", logprobs=self._logprobs(request, out, 0, new_only=False)[0],
                             finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            for i, out in enumerate(finals)
        ]
        return CompletionResponse(id=request_id, model=self.response_model(request), choices=choices,
                                  usage=usage(finals, request.n))

    async def _chunks(self, request: CompletionRequest, request_id: str,
                      generation: Generation) -> AsyncIterator[CompletionResponse]:
        first = CompletionResponse(id=request_id, model=self.response_model(request), choices=[])
        text_offsets = [0] * (len(request.prompt) * request.n)
        finals: list[RequestOutput | None] = [None] * len(text_offsets)  # by choice index
        async for index, out in generation:
            logprobs, text_offsets[index] = self._logprobs(request, out, text_offsets[index], new_only=True)
            if out.finished:
                finals[index] = out
            elif not out.new_text and not (logprobs and logprobs.tokens):
                continue  # nothing to show yet (e.g. text held back mid-character)
            choice = CompletionChoice(index=index, text=out.new_text, logprobs=logprobs,
                                      finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            yield first.model_copy(update={"choices": [choice]})
        if request.include_usage_in_stream and None not in finals:
            yield first.model_copy(update={"usage": usage(finals, request.n)})

    def _logprobs(self, request: CompletionRequest, out: RequestOutput, text_offset: int,
                  new_only: bool) -> tuple[CompletionLogprobs | None, int]:
        """Legacy logprobs of the output's tokens (or of just its new ones), and the next text offset."""
        if request.logprobs is None:
            return None, text_offset
        result = CompletionLogprobs()
        for token, logprob, top in logprob_rows(out, request.logprobs, new_only):
            key, entries = self.texts.legacy_logprobs_entry((token, logprob), top)
            result.tokens.append(key)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(entries)
            result.text_offset.append(text_offset)
            text_offset += len(self.texts.token_text(token))
        return result, text_offset

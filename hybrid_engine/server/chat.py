"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
import uuid
from typing import AsyncIterator

from starlette.responses import Response

from hybrid_engine.request import RequestOutput
from hybrid_engine.server.async_llm import Generation
from hybrid_engine.server.errors import APIError
from hybrid_engine.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                           DeltaMessage, TokenLogprob, TopLogprob)
from hybrid_engine.server.serving import OpenAIServing, logprob_rows, usage


class ChatHandler(OpenAIServing):
    """Serves chat completions (n=1), streamed or not, with the chat logprobs format."""

    async def create(self, request: ChatCompletionRequest) -> Response:
        """Validate, run, and answer one chat completions request."""
        self.check_model(request.model)
        # The template already holds any special tokens (BOS included) it wants.
        prompt = self.prompt_ids(self._render(request.messages), "messages", add_special_tokens=False)
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(request, len(prompt), request.requested_max_tokens, max_param,
                                      request.num_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self.submit(request_id, [(prompt, params)])
        if request.stream:
            return self.stream(generation, self._chunks(request, request_id, generation))
        (out,) = await self.collect(generation, 1)
        choice = ChatChoice(index=0, message=AssistantMessage(content=out.text or ""),
                            logprobs=self._logprobs(request, out, new_only=False), finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason)
        response = ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=[choice],
                                          usage=usage(len(out.prompt_token_ids), len(out.output_token_ids)))
        return Response(response.model_dump_json(), media_type="application/json")

    def _render(self, messages: list[ChatMessage]) -> str:
        """The prompt text: the chat template rendered with the assistant prefix."""
        tokenizer = self.info.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer (and so no chat template): use /v1/completions with token "
                           "ids", param="messages")
        try:
            # Render to text, then encode: transformers 5 returns a BatchEncoding (not ids)
            # from apply_chat_template(tokenize=True).
            return tokenizer.apply_chat_template([m.template_dict() for m in messages], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # no template, or the template rejects these messages
            raise APIError(f"the chat template cannot render these messages: {exc}", param="messages") from exc

    async def _chunks(self, request: ChatCompletionRequest, request_id: str,
                      generation: Generation) -> AsyncIterator[ChatCompletionChunk]:
        chunk = ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=[])
        role = ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        yield chunk.model_copy(update={"choices": [role]})
        final: RequestOutput | None = None
        async for _, out in generation:
            logprobs = self._logprobs(request, out, new_only=True)
            if out.finished:
                final = out
            elif not out.new_text and not (logprobs and logprobs.content):
                continue  # nothing to show yet (e.g. text held back mid-character)
            choice = ChatChunkChoice(index=0, delta=DeltaMessage(content=out.new_text or None), logprobs=logprobs,
                                     finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            yield chunk.model_copy(update={"choices": [choice]})
        if request.include_usage_in_stream and final is not None:
            yield chunk.model_copy(update={"usage": usage(len(final.prompt_token_ids), len(final.output_token_ids))})

    def _logprobs(self, request: ChatCompletionRequest, out: RequestOutput, new_only: bool) -> ChatLogprobs | None:
        if request.num_logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._entry(token, logprob),
                         top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in top])
            for token, logprob, top in logprob_rows(out, request.num_logprobs, new_only)
        ])

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

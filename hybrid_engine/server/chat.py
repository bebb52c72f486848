"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
import functools
import re
import uuid
from typing import AsyncIterator

from starlette.responses import Response

from hybrid_engine.chat_template import ChatPrompt, render_chat_prompt
from hybrid_engine.request import RequestOutput
from hybrid_engine.server.async_llm import Generation
from hybrid_engine.server.errors import APIError, invalid_input
from hybrid_engine.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                           DeltaMessage, TemplateOptions, TokenLogprob, TopLogprob)
from hybrid_engine.server.reasoning import ReasoningSplit
from hybrid_engine.server.serving import EngineInputs, OpenAIServing, logprob_rows, render_off_loop, usage
from hybrid_engine.tokenizer import special_token_pattern


class ChatHandler(OpenAIServing[ChatCompletionRequest]):
    """Serves chat completions (`n` choices), streamed or not, with the chat logprobs format."""

    body_model = ChatCompletionRequest

    def __init__(self, *args, chat_template: str | None = None, reasoning_parser: str | None = None, **kwargs):
        """`chat_template`: the server's `--chat-template` (default: the tokenizer's);
        `reasoning_parser`: its `--reasoning-parser` (None: replies are all content)."""
        super().__init__(*args, **kwargs)
        self.chat_template, self.reasoning_parser = chat_template, reasoning_parser

    async def create(self, raw: bytes, content_type: str | None) -> Response:
        """Validate, run, and answer one chat completions request (its body's bytes)."""
        request, inputs = await self.prepare(raw, content_type)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self.submit(request_id, self.choices(inputs, request.n))
        splits = [ReasoningSplit.for_reply(request._reply_prefix, request.include_reasoning)
                  if self.reasoning_parser else None for _ in range(request.n)]
        if request.stream:
            return self.stream(generation, self._chunks(request, request_id, generation, splits))
        finals = await self.collect(generation, request.n)
        return await render_off_loop(lambda: self._response(request, request_id, finals, splits))

    def engine_inputs(self, request: ChatCompletionRequest) -> EngineInputs:
        """The rendered prompt's token ids and the params, checked (on the tokenizer thread)."""
        self.check_num_prompts(1, request.n)
        rendered = self.encode_messages(request)
        request._reply_prefix = rendered.reply_prefix
        prompt = self.prompt_ids(rendered.token_ids, "messages")
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        return [(prompt, self.sampling_params(request, len(prompt), request.requested_max_tokens, max_param,
                                              request.num_logprobs))]

    def _response(self, request: ChatCompletionRequest, request_id: str, finals: list[RequestOutput],
                  splits: list[ReasoningSplit | None]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, message=_message(out.text or "", split),
                              logprobs=self._logprobs(request, out, new_only=False), finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason)
                   for i, (out, split) in enumerate(zip(finals, splits))]
        return ChatCompletionResponse(id=request_id, model=self.response_model(request), choices=choices,
                                      usage=usage(finals, request.n))

    def encode_messages(self, request: TemplateOptions) -> ChatPrompt:
        """The prompt: the messages through the chat template with the request's template
        options (`hybrid_engine.chat_template.render_chat_prompt`: only the template's own
        markup yields special tokens). 400 naming the field otherwise."""
        tokenizer = self.tokenizer_thread.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer (and so no chat template): use /v1/completions with token "
                           "ids", param="messages")
        try:
            return render_chat_prompt(tokenizer, [message.template_dict() for message in request.messages],
                               self._special_tokens, add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message,
                               template_kwargs=request.template_variables(), chat_template=self.chat_template)
        except ValueError as exc:
            raise invalid_input(exc) from exc

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern[str]:
        return special_token_pattern(self.info.tokenizer)

    async def _chunks(self, request: ChatCompletionRequest, request_id: str, generation: Generation,
                      splits: list[ReasoningSplit | None]) -> AsyncIterator[ChatCompletionChunk]:
        chunk = ChatCompletionChunk(id=request_id, model=self.response_model(request), choices=[])
        for index in range(request.n):  # each choice's first chunk carries the role, as OpenAI's do
            role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield chunk.model_copy(update={"choices": [role]})
        finals: list[RequestOutput | None] = [None] * request.n  # by choice index
        async for index, out in generation:
            logprobs = self._logprobs(request, out, new_only=True)
            split = splits[index]
            reasoning, content = split.feed(out.new_text, out.finished) if split else ("", out.new_text)
            if out.finished:
                finals[index] = out
            elif not reasoning and not content and not (logprobs and logprobs.content):
                continue  # nothing to show yet (e.g. text held back mid-character or mid-tag)
            delta = DeltaMessage(content=content or None, reasoning=reasoning or None)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=out.finish_reason,
                                     stop_reason=out.stop_reason)
            yield chunk.model_copy(update={"choices": [choice]})
        if request.include_usage_in_stream and None not in finals:
            yield chunk.model_copy(update={"usage": usage(finals, request.n)})

    def _logprobs(self, request: ChatCompletionRequest, out: RequestOutput, new_only: bool) -> ChatLogprobs | None:
        if request.num_logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._entry(token, logprob),
                         top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in top])
            for token, logprob, top in logprob_rows(out, request.num_logprobs, new_only)
        ])

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.texts.token_text(token_id), "logprob": logprob,
                "bytes": list(self.texts.token_bytes(token_id))}


def _message(text: str, split: ReasoningSplit | None) -> AssistantMessage:
    """A finished reply as the message of a chat completion: all content, or with a
    reasoning parser its reasoning and content apart (either None when empty, as vLLM's)."""
    if split is None:
        return AssistantMessage(content=text)
    reasoning, content = split.feed(text, final=True)
    return AssistantMessage(content=content or None, reasoning=reasoning or None)

"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
import dataclasses
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
                                           DeltaMessage, DeltaToolCall, FunctionCall, TemplateOptions, TokenLogprob,
                                           TopLogprob)
from hybrid_engine.server.reasoning import TAGS as THINK_TAGS
from hybrid_engine.server.reasoning import ReasoningSplit
from hybrid_engine.server.tool_calls import TOOL_CALL_PARSERS, ForcedCallSplit, ParsedCall, ToolCallSplit
from hybrid_engine.server.serving import EngineInputs, OpenAIServing, logprob_rows, render_off_loop, usage
from hybrid_engine.tokenizer import special_token_pattern


@dataclasses.dataclass
class ReplySplit:
    """One reply's text apart: its reasoning first (a reasoning parser), then the calls out
    of the rest (a tool-call parser), either optional. `feed` takes the reply's pieces."""

    reasoning: ReasoningSplit | None
    calls: ToolCallSplit | ForcedCallSplit | None
    calls_made: int = 0  # calls out so far (the next one's `index` in a stream)

    @property
    def has_parser(self) -> bool:
        """Whether any parser splits the reply (an empty content is then null, as vLLM's)."""
        return self.reasoning is not None or self.calls is not None

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ParsedCall]]:
        """The reasoning, content and calls that `text`, the reply's next piece, adds."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        calls: list[ParsedCall] = []
        if self.calls:
            content, calls = self.calls.feed(content, final)
        self.calls_made += len(calls)
        return reasoning, content, calls

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" for a reply that stopped after calling
        (as OpenAI and vLLM report it), except a call of the function `tool_choice` named
        ("stop", as vLLM reports it)."""
        named = isinstance(self.calls, ForcedCallSplit) and self.calls.name is not None
        return "tool_calls" if finish_reason == "stop" and self.calls_made and not named else finish_reason


class ChatHandler(OpenAIServing[ChatCompletionRequest]):
    """Serves chat completions (`n` choices), streamed or not, with the chat logprobs format."""

    body_model = ChatCompletionRequest

    def __init__(self, *args, chat_template: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, **kwargs):
        """`chat_template`: the server's `--chat-template` (default: the tokenizer's);
        `reasoning_parser`: its `--reasoning-parser` (None: replies are all content);
        `tool_call_parser`: its `--tool-call-parser` with `--enable-auto-tool-choice`
        (None: `tool_choice` "auto" with tools is refused, as vLLM refuses it)."""
        super().__init__(*args, **kwargs)
        self.chat_template, self.reasoning_parser = chat_template, reasoning_parser
        self.tool_call_format = TOOL_CALL_PARSERS[tool_call_parser] if tool_call_parser else None

    async def create(self, raw: bytes, content_type: str | None) -> Response:
        """Validate, run, and answer one chat completions request (its body's bytes)."""
        request, inputs = await self.prepare(raw, content_type)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self.submit(request_id, self.choices(inputs, request.n))
        splits = [self._split(request) for _ in range(request.n)]
        if request.stream:
            return self.stream(generation, self._chunks(request, request_id, generation, splits))
        finals = await self.collect(generation, request.n)
        return await render_off_loop(lambda: self._response(request, request_id, finals, splits))

    def _split(self, request: ChatCompletionRequest) -> ReplySplit:
        """How one of the request's replies is split (`ReplySplit`). A grammar constrains a
        reply from its first token (structured outputs, forced calls), so such a reply has
        no reasoning and no calls to parse out; a forced call's is calls only."""
        if request.forces_calls:
            return ReplySplit(None, ForcedCallSplit(request.forced_function))
        reasoning = ReasoningSplit.for_reply(request._reply_prefix, request.include_reasoning) \
            if self.reasoning_parser and not request.constrains_output else None
        calls = ToolCallSplit(self.tool_call_format, request.template_tools() or []) \
            if self.tool_call_format and request.calls_tools and not request.constrains_output else None
        return ReplySplit(reasoning, calls)

    def engine_inputs(self, request: ChatCompletionRequest) -> EngineInputs:
        """The rendered prompt's token ids and the params, checked (on the tokenizer thread)."""
        self.check_num_prompts(1, request.n)
        if request.calls_tools and self.tool_call_format is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                           '(send tool_choice "none" to show the tools without calls)', param="tool_choice")
        rendered = self.encode_messages(request)
        request._reply_prefix = rendered.reply_prefix
        prompt = self.prompt_ids(rendered.token_ids, "messages")
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(request, len(prompt), request.requested_max_tokens, max_param,
                                      request.num_logprobs)
        if self._parses_special_tags(request):
            params = dataclasses.replace(params, skip_special_tokens=False)
        return [(prompt, params)]

    def _parses_special_tags(self, request: ChatCompletionRequest) -> bool:
        """Whether a parser of this request's reply reads tags that the tokenizer marks
        special ("<think>", "<tool_call>", ...), which must then reach the text."""
        tags = THINK_TAGS if self.reasoning_parser else ()
        if self.tool_call_format is not None and request.calls_tools:
            tags += (self.tool_call_format.open, self.tool_call_format.close)
        return any(self._special_tokens.fullmatch(tag) for tag in tags)

    def _response(self, request: ChatCompletionRequest, request_id: str, finals: list[RequestOutput],
                  splits: list[ReplySplit]) -> ChatCompletionResponse:
        choices = []
        for i, (out, split) in enumerate(zip(finals, splits)):
            reasoning, content, calls = split.feed(out.text or "", final=True)
            message = AssistantMessage(content=(content or None) if split.has_parser else content,
                                       reasoning=reasoning or None, tool_calls=[_call(c) for c in calls] or None)
            choices.append(ChatChoice(index=i, message=message, logprobs=self._logprobs(request, out, new_only=False),
                                      finish_reason=split.finish_reason(out.finish_reason),
                                      stop_reason=out.stop_reason))
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
                                      template_kwargs=request.template_variables(), chat_template=self.chat_template,
                                      tools=request.template_tools())
        except ValueError as exc:
            raise invalid_input(exc) from exc

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern[str]:
        return special_token_pattern(self.info.tokenizer)

    async def _chunks(self, request: ChatCompletionRequest, request_id: str, generation: Generation,
                      splits: list[ReplySplit]) -> AsyncIterator[ChatCompletionChunk]:
        chunk = ChatCompletionChunk(id=request_id, model=self.response_model(request), choices=[])
        for index in range(request.n):  # each choice's first chunk carries the role, as OpenAI's do
            role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield chunk.model_copy(update={"choices": [role]})
        finals: list[RequestOutput | None] = [None] * request.n  # by choice index
        async for index, out in generation:
            logprobs = self._logprobs(request, out, new_only=True)
            split = splits[index]
            reasoning, content, calls = split.feed(out.new_text, out.finished)
            if out.finished:
                finals[index] = out
            elif not reasoning and not content and not calls and not (logprobs and logprobs.content):
                continue  # nothing to show yet (e.g. text held back mid-character or mid-tag)
            delta = DeltaMessage(content=content or None, reasoning=reasoning or None,
                                 tool_calls=[DeltaToolCall(index=split.calls_made - len(calls) + k, **_call(c))
                                             for k, c in enumerate(calls)] or None)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                     finish_reason=split.finish_reason(out.finish_reason), stop_reason=out.stop_reason)
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


def _call(call: ParsedCall) -> dict:
    """A parsed call's fields for the response models."""
    return {"id": call.id, "function": FunctionCall(name=call.name, arguments=call.arguments)}

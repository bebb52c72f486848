"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
import functools
import re
import secrets
import uuid
from typing import AsyncIterator

from starlette.responses import Response

from hybrid_engine.prompts import encode_prompt
from hybrid_engine.request import RequestOutput
from hybrid_engine.server.async_llm import Generation
from hybrid_engine.server.errors import APIError, invalid_input
from hybrid_engine.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                           DeltaMessage, TemplateOptions, TokenLogprob, TopLogprob)
from hybrid_engine.server.serving import EngineInputs, OpenAIServing, logprob_rows, render_off_loop, usage
from hybrid_engine.tokenizer import special_token_pattern

# Message texts stand in the rendered template as "<_MARK>nonce-n<_MARK>": a private-use
# character around a random nonce drawn for each request, so that no client text (a tool
# call's arguments, a name: fields the template writes as they are) can spell a placeholder
# and have another message's text put in its place.
_MARK = "\ue000"


class ChatHandler(OpenAIServing[ChatCompletionRequest]):
    """Serves chat completions (`n` choices), streamed or not, with the chat logprobs format."""

    body_model = ChatCompletionRequest

    async def create(self, raw: bytes, content_type: str | None) -> Response:
        """Validate, run, and answer one chat completions request (its body's bytes)."""
        request, inputs = await self.prepare(raw, content_type)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self.submit(request_id, self.choices(inputs, request.n))
        if request.stream:
            return self.stream(generation, self._chunks(request, request_id, generation))
        finals = await self.collect(generation, request.n)
        return await render_off_loop(lambda: self._response(request, request_id, finals))

    def engine_inputs(self, request: ChatCompletionRequest) -> EngineInputs:
        """The rendered prompt's token ids and the params, checked (on the tokenizer thread)."""
        self.check_num_prompts(1, request.n)
        prompt = self.prompt_ids(self.encode_messages(request), "messages")
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        return [(prompt, self.sampling_params(request, len(prompt), request.requested_max_tokens, max_param,
                                              request.num_logprobs))]

    def _response(self, request: ChatCompletionRequest, request_id: str,
                  finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=out.text or ""),
                              logprobs=self._logprobs(request, out, new_only=False), finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason)
                   for i, out in enumerate(finals)]
        return ChatCompletionResponse(id=request_id, model=self.response_model(request), choices=choices,
                                      usage=usage(finals, request.n))

    def encode_messages(self, request: TemplateOptions) -> list[int]:
        """The prompt's token ids: the chat template rendered with the assistant prefix
        (`add_generation_prompt`), or with the last assistant message left open
        (`continue_final_message`), and the request's `chat_template_kwargs`.

        Only the template's own markup may yield special tokens: message text is tokenized
        as plain text, so a user who writes "<|im_end|>" gets those characters, not the
        end-of-turn token (role injection). Each text is rendered as a unique placeholder,
        and the rendered prompt is tokenized piece by piece around them.
        """
        tokenizer = self.tokenizer_thread.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer (and so no chat template): use /v1/completions with token "
                           "ids", param="messages")
        texts: dict[str, str] = {}
        nonce = secrets.token_hex(8)

        def placeholder(text: str) -> str:
            key = f"{_MARK}{nonce}-{len(texts)}{_MARK}"
            texts[key] = text
            return key

        self._check_template_variables(request.chat_template_kwargs)
        dicts = []
        for i, message in enumerate(request.messages):
            self._check_markup_free(message, i)
            d = message.template_dict()
            if d["content"]:  # (an empty text stays empty: templates test content for truth)
                d["content"] = placeholder(d["content"])
            dicts.append(d)
        try:
            # Render to text, then encode: transformers 5 returns a BatchEncoding (not ids)
            # from apply_chat_template(tokenize=True).
            rendered = tokenizer.apply_chat_template(dicts, tokenize=False,
                                                     add_generation_prompt=request.add_generation_prompt,
                                                     continue_final_message=request.continue_final_message,
                                                     **request.chat_template_kwargs)
        except Exception as exc:  # no template, or the template rejects these messages
            raise APIError(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        ids: list[int] = []
        # The template already holds any special tokens (BOS included) it wants.
        for piece in re.split(f"({_MARK}{nonce}-[0-9]+{_MARK})", rendered):
            if piece in texts:
                ids += self._tokenize(texts[piece], plain_text=True)
            elif piece:
                ids += self._tokenize(piece, plain_text=False)
        return ids

    def _check_markup_free(self, message: ChatMessage, index: int) -> None:
        """400 naming the field if a message's name, tool_call_id, or a tool call's id, name
        or arguments hold a special token's text: templates write those as markup, not as
        placeholder text, so the text would become the token itself (role injection).
        Arguments are checked as written and as the template gets them (every key and value
        of the parsed JSON object), since JSON escapes such as \\u003c spell a token's
        text only once parsed."""
        fields = [("name", message.name), ("tool_call_id", message.tool_call_id)]
        for j, call in enumerate(message.tool_calls or ()):
            fields += [(f"tool_calls.{j}.id", call.id), (f"tool_calls.{j}.function.name", call.function.name),
                       (f"tool_calls.{j}.function.arguments", call.function.arguments)]
            parsed = call.template_dict()["function"]["arguments"]
            fields += [(f"tool_calls.{j}.function.arguments", text) for text in _strings_in(parsed)]
        for field, text in fields:
            found = self._special_tokens.search(text) if text else None
            if found is not None:
                param = f"messages.{index}.{field}"
                raise APIError(f"{param} must not contain the special token {found.group()!r}", param=param,
                               code="invalid_value")

    def _check_template_variables(self, variables: dict[str, object]) -> None:
        """400 naming the variable if a `chat_template_kwargs` string (key or value, at any
        depth) holds a special token's text: the template writes it as markup."""
        for key, value in variables.items():
            for text in _strings_in({key: value}):
                found = self._special_tokens.search(text) if text else None
                if found is not None:
                    param = f"chat_template_kwargs.{key}"
                    raise APIError(f"{param} must not contain the special token {found.group()!r}", param=param,
                                   code="invalid_value")

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern[str]:
        return special_token_pattern(self.info.tokenizer)

    def _tokenize(self, text: str, plain_text: bool) -> list[int]:
        """Token ids of part of a chat prompt (400 naming "messages" if it is not valid text)."""
        try:
            return encode_prompt(text, self.tokenizer_thread.tokenizer, "messages", add_special_tokens=False,
                                 split_special_tokens=plain_text)
        except ValueError as exc:
            raise invalid_input(exc) from exc

    async def _chunks(self, request: ChatCompletionRequest, request_id: str,
                      generation: Generation) -> AsyncIterator[ChatCompletionChunk]:
        chunk = ChatCompletionChunk(id=request_id, model=self.response_model(request), choices=[])
        for index in range(request.n):  # each choice's first chunk carries the role, as OpenAI's do
            role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield chunk.model_copy(update={"choices": [role]})
        finals: list[RequestOutput | None] = [None] * request.n  # by choice index
        async for index, out in generation:
            logprobs = self._logprobs(request, out, new_only=True)
            if out.finished:
                finals[index] = out
            elif not out.new_text and not (logprobs and logprobs.content):
                continue  # nothing to show yet (e.g. text held back mid-character)
            choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=out.new_text or None),
                                     logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason)
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


def _strings_in(value: object) -> list[str]:
    """Every string in a parsed JSON value, keys included (iteratively: nesting is as deep as
    the parser allowed)."""
    strings, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            strings += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return strings

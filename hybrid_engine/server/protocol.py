"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly: JSON types must match exactly (no "5" for 5, no true
for 1), numbers must be finite, unknown fields are refused (OpenAI answers
"Unrecognized request argument" too), and `null` means "use the default". The ranges of
the sampling fields are `hybrid_engine.sampling_params.RANGES`, the ones `SamplingParams`
enforces, so the schema (and the OpenAPI docs) accept exactly what the library does.
What needs the model to check (vocabulary, context length, the model name) is checked by
the serving layer, which knows the engine.
"""
import time
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo,
                      PrivateAttr, field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from hybrid_engine.sampling_params import MAX_STOP_STRINGS, RANGES, check_unicode, is_int
from hybrid_engine.server.errors import clipped
from hybrid_engine.server.tool_calls import forced_call_schema

# The most choices per prompt (`n`) a request may ask for: OpenAI's limit.
MAX_CHOICES = 128


def ranged(default: Any, name: str, lo: int | None = None) -> Any:
    """A Field constrained to `SamplingParams`' range for field `name` (`RANGES[name]`);
    `lo` lowers the minimum for a request-only spelling that maps onto a library value."""
    valid = RANGES[name]
    bounds: dict[str, Any] = {}
    if lo is not None:
        bounds["ge"] = lo
    elif valid.lo is not None:
        bounds["gt" if valid.lo_open else "ge"] = valid.lo
    if valid.hi is not None:
        bounds["le"] = valid.hi
    return Field(default, **bounds)


def only_neutral(name: str, value: Any, neutral: Any) -> Any:
    """Accept a standard OpenAI field only at the value that asks for nothing we don't do
    (clients send these by default); any other value is a 400 `not_implemented`."""
    if value != neutral:
        raise PydanticCustomError("not_implemented",
                                  f"{name}={clipped(repr(value))} is not implemented; only {neutral!r} is accepted")
    return value


def _unicode_text(value: str, info: ValidationInfo) -> str:
    check_unicode(value, info.field_name)
    return value


# A string field whose text must be valid Unicode (JSON can escape a lone surrogate).
UnicodeStr = Annotated[str, AfterValidator(_unicode_text)]


class StrictModel(BaseModel):
    """Base of request bodies: exact JSON types, finite numbers, no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI clients send explicit nulls for "unset"; dropping them lets every field
        # keep a single, non-optional default instead of None checks everywhere.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(StrictModel):
    """`stream_options`: only `include_usage` (a final chunk carrying usage) is supported."""

    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema` (OpenAI's): a named JSON schema the reply must follow
    (without `schema`, any JSON object). `strict` is accepted either way: the reply always
    follows the schema exactly."""

    name: UnicodeStr
    description: UnicodeStr | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format`: plain text (the default), any JSON object (`json_object`), or a
    JSON value following a schema (`json_schema`); the last two are structured outputs."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "response_format.json_schema is required with type "
                                      "'json_schema', and only then")
        return self

    def structured_outputs(self) -> dict[str, Any] | None:
        """What it asks of the output, as `StructuredOutputsParams` fields (None: text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return {"json_object": True} if schema is None else {"json": schema}
        return None


class SamplingRequest(StrictModel):
    """Fields both endpoints share: model, streaming, and the sampling parameters.

    Beyond OpenAI's fields this accepts vLLM's extensions (top_k, min_p,
    repetition_penalty, ignore_eos, stop_token_ids, ...). `top_k` -1 (vLLM) or 0 means off.
    """

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt
    user: UnicodeStr | None = None  # accepted for compatibility; not used
    logit_bias: dict[str, float] = Field(default_factory=dict)  # only {} (see `only_neutral`)
    max_tokens: int | None = ranged(None, "max_tokens")
    temperature: float = ranged(1.0, "temperature")
    top_p: float = ranged(1.0, "top_p")
    top_k: int = ranged(0, "top_k")
    min_p: float = ranged(0.0, "min_p")
    presence_penalty: float = ranged(0.0, "presence_penalty")
    frequency_penalty: float = ranged(0.0, "frequency_penalty")
    repetition_penalty: float = ranged(1.0, "repetition_penalty")
    seed: int | None = ranged(None, "seed")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"json_object": true}, and
    # "disable_any_whitespace" (`StructuredOutputsParams` checks it, naming the field).
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise ValueError("stop must be a string or a list of strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float]) -> dict[str, float]:
        return only_neutral("logit_bias", value, {})

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingRequest":
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise PydanticCustomError("invalid_value", "set response_format or structured_outputs, not both",
                                      {"param": "structured_outputs"})
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_value", "stream_options can only be set when stream is true",
                                      {"param": "stream_options"})
        return self

    @property
    def constrains_output(self) -> bool:
        """Whether a grammar constrains the whole output (`response_format` other than
        text, or `structured_outputs`)."""
        return self.structured_outputs is not None or (self.response_format is not None
                                                       and self.response_format.type != "text")

    @property
    def grammar_field(self) -> str | None:
        """The field a grammar error names when the grammar did not come from
        `structured_outputs` (whose errors name its own keys)."""
        return "response_format.json_schema" if self.structured_outputs is None and self.constrains_output else None

    @property
    def include_usage_in_stream(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields these request fields map to (max_tokens and logprobs aside)."""
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop or None,
            stop_token_ids=self.stop_token_ids or None, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs if self.response_format is None
            else self.response_format.structured_outputs() or self.structured_outputs,
        )


# A prompt is text or token ids; `prompt` holds one or several of them.
Prompt = str | list[int]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. Several prompts give several choices (by index)."""

    prompt: list[Prompt]
    logprobs: int | None = ranged(None, "logprobs")
    echo: bool = False  # only false: the prompt is not repeated in the output
    best_of: int = 1  # only 1: no server-side best-of selection (n choices are all returned)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return only_neutral("echo", value, False)

    @field_validator("best_of")
    @classmethod
    def _one_of_one(cls, value: int) -> int:
        return only_neutral("best_of", value, 1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        # Normalize the four accepted shapes to a list of prompts, with one clear message
        # instead of pydantic's per-union-member complaints.
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(is_int(t) for t in value):
                return [value]
            if all(isinstance(p, list) and all(is_int(t) for t in p) for p in value):
                if not all(value):
                    raise ValueError("prompt must not be empty")
                return value
        if value == []:
            raise ValueError("prompt must not be empty")
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
                         "token ids")


class TextPart(StrictModel):
    """A `{"type": "text", "text": ...}` content part (the only kind supported)."""

    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    """The function an assistant's tool call named, with its arguments as the model wrote
    them (a JSON string)."""

    name: UnicodeStr
    arguments: str


class ToolCall(StrictModel):
    """One tool call of an earlier assistant message (OpenAI's `tool_calls` entries;
    `index`, which clients that assemble streamed deltas keep, is accepted and unused)."""

    id: UnicodeStr
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None

    def template_dict(self) -> dict[str, Any]:
        """The call as OpenAI sends it (`render_chat` parses JSON-object arguments)."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class ChatMessage(StrictModel):
    """One input message; content is a string or a list of text parts. Conversation history
    with tools: an assistant message may carry `tool_calls` (its content then usually
    null), a tool message the `tool_call_id` it answers (the request's `tools` define the
    functions)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = ""
    name: UnicodeStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: UnicodeStr | None = None
    # An earlier reply's thinking, as a reasoning parser returned it (vLLM's `reasoning`,
    # DeepSeek's `reasoning_content`): clients send the message back whole.
    reasoning: UnicodeStr | None = None
    reasoning_content: UnicodeStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got {clipped(repr(kind))} (part {i})")
            unknown = sorted(set(part) - set(TextPart.model_fields))
            if unknown:
                raise ValueError(f"content part {i} has unrecognized keys {clipped(repr(unknown))}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a 'text' string")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _answer_of_a_tool(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return value

    @field_validator("reasoning", "reasoning_content")
    @classmethod
    def _thinking_of_the_assistant(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError(f"only assistant messages carry {info.field_name}")
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (plain dicts). Text parts are joined
        into one string (with newlines, as vLLM joins them): many templates write
        `message.content` out as it is, which would print a list's repr."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        for key in ("reasoning", "reasoning_content"):  # (`render_chat` takes either, and refuses two that differ)
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out




class FunctionDefinition(StrictModel):
    """A function the model may call: its name, what it does, its parameters' JSON Schema."""

    name: UnicodeStr
    description: UnicodeStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    """One of `tools` (OpenAI's: functions only)."""

    type: Literal["function"]
    function: FunctionDefinition


class TemplateOptions(StrictModel):
    """vLLM's chat template options (chat completions and /tokenize): the assistant prefix
    at the end (or, instead, the last assistant message left open for the model to
    continue), and extra template variables such as {"enable_thinking": false}. What they
    need (of the messages, and of the variables' names) is checked where they are rendered
    (`render_chat`)."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolDefinition] = Field(default_factory=list)  # (the template writes them, as markup)

    def template_variables(self) -> dict[str, Any]:
        """The extra variables the chat template gets."""
        return self.chat_template_kwargs

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions as chat templates take them (None when there are none)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] or None


class ChatCompletionRequest(SamplingRequest, TemplateOptions):
    """POST /v1/chat/completions (`max_completion_tokens` wins over the older `max_tokens`).

    `store` is accepted as false only (nothing is stored); `metadata` is accepted and not
    used (it only matters to stored completions)."""

    messages: list[ChatMessage] = Field(min_length=1)  # (required here)
    max_completion_tokens: int | None = ranged(None, "max_tokens")
    # OpenAI's; as vLLM does, handed to the chat template as a variable of that name (templates
    # that read it set how long the model thinks).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: false leaves a reasoning parser's `reasoning` out of the response.
    include_reasoning: bool = True
    logprobs: bool = False
    top_logprobs: int | None = ranged(None, "logprobs")
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    # OpenAI's: with `tools`, "auto" (the default then) lets the model call them (calls are
    # parsed out of the reply with --enable-auto-tool-choice); "none" only shows them to it;
    # "required" or {"type": "function", "function": {"name": ...}} forces calls (structured
    # outputs: `forced_call_schema`). `parallel_tool_calls` is accepted and not enforced.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Set when the prompt is rendered, not by clients: the text the reply continues
    # (`ChatPrompt.reply_prefix`), which says whether it starts inside its thinking.
    _reply_prefix: str = PrivateAttr(default="")

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool) -> bool:
        return only_neutral("store", value, False)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (isinstance(value, dict) and set(value) == {"type", "function"} and value["type"] == "function"
                and isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str)):
            return value
        raise PydanticCustomError("invalid_value", "tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")

    @model_validator(mode="after")
    def _forced_calls_of_given_tools(self) -> "ChatCompletionRequest":
        if not self.forces_calls:
            return self
        names = [tool.function.name for tool in self.tools]
        if not names:
            raise PydanticCustomError("invalid_value", "tool_choice forces a call but no tools are given",
                                      {"param": "tool_choice"})
        if self.forced_function is not None and self.forced_function not in names:
            raise PydanticCustomError("invalid_value", f"tool_choice names function "
                                      f"{clipped(repr(self.forced_function))}, which is not among the tools",
                                      {"param": "tool_choice"})
        if self.constrains_output:
            raise PydanticCustomError("invalid_value", "a forced tool call is structured output itself: set "
                                      "tool_choice or response_format / structured_outputs, not both",
                                      {"param": "tool_choice"})
        return self

    @property
    def grammar_field(self) -> str | None:
        """As `SamplingRequest.grammar_field`; a forced call's grammar is `tool_choice`'s."""
        return "tool_choice" if self.forces_calls else super().grammar_field

    @property
    def forces_calls(self) -> bool:
        """Whether `tool_choice` forces the reply to be calls ("required" or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @property
    def forced_function(self) -> str | None:
        """The function a named `tool_choice` forces (None otherwise)."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def sampling_kwargs(self) -> dict[str, Any]:
        """As `SamplingRequest.sampling_kwargs`; a forced call's schema as the grammar."""
        kwargs = super().sampling_kwargs()
        if self.forces_calls:
            kwargs["structured_outputs"] = {"json": forced_call_schema(self.template_tools(), self.forced_function)}
        return kwargs

    def template_variables(self) -> dict[str, Any]:
        """`chat_template_kwargs`, with `reasoning_effort` where given and not set there."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **self.chat_template_kwargs}

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may call the tools (they are given, and `tool_choice` is
        "auto", OpenAI's default once tools are given)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs requires logprobs to be true",
                                      {"param": "top_logprobs"})
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """The output length limit the client asked for, if any."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ---------------------------------------------------------------------------
def now() -> int:
    """The `created` timestamp (seconds)."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`, as OpenAI reports it."""

    cached_tokens: int  # prompt tokens resumed from the prefix cache rather than computed


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (also a streamed chunk's choice, with a text delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of one (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """A token with its logprob and UTF-8 bytes (chat logprobs format)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token's logprob plus the most likely alternatives at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    """The function a generated tool call calls, with its arguments as a JSON string."""

    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    """A tool call of a generated message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(AssistantToolCall):
    """A tool call in a chat chunk: `index` is its place among the choice's calls (each is
    streamed whole, in one chunk)."""

    index: int


class AssistantMessage(BaseModel):
    """The generated message of a chat completion (`reasoning`: its thinking, with a
    `--reasoning-parser`; `tool_calls`, with a `--tool-call-parser`; each key is left out
    when there is none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None
    tool_calls: list[AssistantToolCall] | None = None

    @model_serializer(mode="wrap")
    def _extras_only_if_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_extras(handler(self))


class ChatChoice(BaseModel):
    """The choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a chat chunk adds: the role (first chunk only), content and/or, with a
    reasoning or tool-call parser, reasoning and tool calls (each key left out when there
    is none)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _extras_only_if_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_extras(handler(self))


def _without_null_extras(fields: dict[str, Any]) -> dict[str, Any]:
    """A message's fields without a null `reasoning` or `tool_calls`: servers with no
    parser keep the shape they always had."""
    for key in ("reasoning", "tool_calls"):
        if fields.get(key, "") is None:
            del fields[key]
    return fields


class ChatChunkChoice(BaseModel):
    """The choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk (the last one carries usage when asked for)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hybrid-engine"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]

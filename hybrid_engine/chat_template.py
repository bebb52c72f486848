"""Chat prompts: messages rendered with the tokenizer's chat template into token ids, where
only the template's own markup yields special tokens (`LLM.chat`, and the server's
/v1/chat/completions and /tokenize).

The template sees the real message texts, so templates that act on them work as in
transformers and vLLM: NVIDIA's Nemotron templates turn reasoning off for "/no_think" in
a system or user message and strip the switch from the text, others trim texts or drop
old reasoning. The prompt is transformers' rendering; what differs is where special tokens
may come from. A user who writes "<|im_end|>" gets those characters, not the end-of-turn
token (role injection), even where a template's rewrite of the text forms one: how the
markup is told from the texts, and where a text reaches the template as an opaque
placeholder instead, is hybrid_engine/chat_markup.py's. A message's texts are its content
and, for an assistant's reply sent back, its reasoning (`reasoning`, `reasoning_content` or
`thinking`: the template gets it under each of those names).

Every other string a template writes as it is -- a message's name, tool call ids, names
and arguments, template variables -- must not hold a special token's text or one of the
markers' reserved characters: that is a ParameterError naming the field.
"""
import dataclasses
import inspect
import json
import re
from typing import Any

from hybrid_engine.chat_markup import RESERVED_CHARACTERS, encode, prompt_pieces
from hybrid_engine.prompts import check_unicode
from hybrid_engine.sampling_params import ParameterError
from hybrid_engine.tokenizer import special_token_starts

# The names an assistant message's reasoning goes by (vLLM's `reasoning`, DeepSeek's and
# HF templates' `reasoning_content`, gpt-oss templates' `thinking`): text of the message's
# own, rendered as its content is.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# How deep a field's name goes: strings inside a tool call's arguments are reported as the
# arguments ("messages.1.tool_calls.0.function.arguments"), those inside a template variable
# as the variable ("chat_template_kwargs.name").
_MESSAGE_PARAM_DEPTH, _VARIABLE_PARAM_DEPTH, _TOOL_PARAM_DEPTH = 6, 2, 4  # (tools.0.function.name)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its token ids, and the text at its end that the reply
    continues (the template's generation prompt, e.g. "<|im_start|>assistant\n<think>\n",
    or a continued final message's text and what follows it; "" if none)."""
    token_ids: list[int]
    reply_prefix: str


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], special_tokens: re.Pattern[str],
                **options: Any) -> list[int]:
    """The prompt's token ids (`render_chat_prompt`, which takes the same options)."""
    return render_chat_prompt(tokenizer, messages, special_tokens, **options).token_ids


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], special_tokens: re.Pattern[str], *,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                       tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
    """The prompt: `messages` (OpenAI-style dicts; content a string, None, or
    text parts; an assistant's reasoning under any of REASONING_FIELDS, a string) through
    `chat_template` (a Jinja template; default: the tokenizer's), with the assistant prefix
    (`add_generation_prompt`) or the last assistant message left open
    (`continue_final_message`), `template_kwargs` as extra template variables, and `tools`
    (OpenAI-style tool definitions, which the template writes as markup).
    `special_tokens`: `hybrid_engine.tokenizer.special_token_pattern(tokenizer)`. ParameterError naming
    the field for a special token's text or a reserved character outside the texts, a
    content that is no text, messages the template cannot render, or a template that cuts a
    placeholder (hybrid_engine/chat_markup.py)."""
    if continue_final_message and add_generation_prompt:
        raise ParameterError("continue_final_message", "continue_final_message needs add_generation_prompt false: "
                                                       "the last message is continued, so no new assistant turn starts")
    template_kwargs = template_kwargs or {}
    taken = sorted(set(template_kwargs) & _renderer_arguments(tokenizer))
    if taken:
        raise ParameterError("chat_template_kwargs", f"chat_template_kwargs must not set {taken}: those are the "
                                                     "renderer's own arguments (the request's fields set some)")
    _check_markup_free(special_tokens, template_kwargs, ["chat_template_kwargs"], _VARIABLE_PARAM_DEPTH,
                       also_keys=True)
    _check_markup_free(special_tokens, tools or [], ["tools"], _TOOL_PARAM_DEPTH, also_keys=True)
    dicts, contents, fields = [], [], []  # fields: (message index, field) of each content
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ParameterError("messages", f"messages.{i} must be a dict with a role and a content")
        message = _with_parsed_arguments(message)
        markup = {k: v for k, v in message.items() if k != "content" and k not in REASONING_FIELDS}
        _check_markup_free(special_tokens, markup, ["messages", i], _MESSAGE_PARAM_DEPTH)
        contents.append(_content_text(message.get("content"), i))
        fields.append((i, "content"))
        reasoning = _reasoning_text(message, i)
        if reasoning is not None:
            contents.append(reasoning)
            fields.append((i, "reasoning"))
        dicts.append(markup)

    def render(texts: list[str]) -> str:
        filled = [dict(message) for message in dicts]
        for (i, field), text in zip(fields, texts):
            if field == "content":
                filled[i]["content"] = text
            else:  # under each of its names: templates read one or another
                filled[i].update(dict.fromkeys(REASONING_FIELDS, text))
        try:
            # Render to text, then encode: transformers 5 returns a BatchEncoding (not ids)
            # from apply_chat_template(tokenize=True).
            return tokenizer.apply_chat_template(
                filled, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template, tools=tools, **template_kwargs)
        except Exception as exc:  # no template, or the template rejects these messages
            raise ParameterError("messages", f"messages: the chat template cannot render these messages: "
                                             f"{exc}") from exc

    for (i, field), text in zip(fields, contents):
        check_unicode(text, f"messages.{i}.{field}")
    pieces = prompt_pieces(render, contents, special_tokens, special_token_starts(tokenizer))
    # What the reply continues: the markup after the last message text (the generation
    # prompt), or, continuing a final message that has text, that text on.
    last = max((j for j, piece in enumerate(pieces) if piece.from_text), default=-1)
    final_text = dict(zip(fields, contents)).get((len(messages) - 1, "content"), "")
    start = last if continue_final_message and final_text.strip() else last + 1
    return ChatPrompt(encode(pieces, tokenizer, special_tokens), "".join(piece.text for piece in pieces[start:]))


def load_chat_template(value: Any, param: str = "chat_template") -> str:
    """A chat template given as vLLM's `--chat-template` and `LLM.chat(chat_template=...)`
    take it: the Jinja text itself (anything with a Jinja delimiter in it), else the path of
    a file holding it. ParameterError naming `param` for anything else, a file that cannot
    be read, or an empty template."""
    if not isinstance(value, str):
        raise ParameterError(param, f"{param} must be a Jinja template or the path of a file holding one")
    if "{{" not in value and "{%" not in value:
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ParameterError(param, f"{param}: {exc}") from exc
    if not value.strip():
        raise ParameterError(param, f"{param}: the template is empty")
    return value


def _renderer_arguments(tokenizer: Any) -> set[str]:
    """The named parameters of the tokenizer's `apply_chat_template` (they vary with the
    transformers version): template variables must not take their place."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    # ("messages" is what the template calls the conversation.)
    return {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | {"messages"}


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message with each tool call's `arguments` as templates are written for: most HF
    templates render them with `tojson`, expecting a mapping, so a JSON object string is
    parsed (as vLLM does); anything else stays as it is."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        parsed_calls.append(call)
    return {**message, "tool_calls": parsed_calls}


def _reasoning_text(message: dict[str, Any], index: int) -> str | None:
    """An assistant's reasoning sent back, under any of REASONING_FIELDS (None if none);
    ParameterError naming the field for one that is no string, on another role's message,
    or for two that differ."""
    given = {key: message[key] for key in REASONING_FIELDS if message.get(key) is not None}
    for key, value in given.items():
        param = f"messages.{index}.{key}"
        if not isinstance(value, str):
            raise ParameterError(param, f"{param} must be a string")
        if message.get("role") != "assistant":
            raise ParameterError(param, f"{param}: only assistant messages carry {key}")
    if len(set(given.values())) > 1:
        param = f"messages.{index}.{next(iter(given))}"
        raise ParameterError(param, f"messages.{index}: {' and '.join(given)} differ; send the reasoning once")
    return next(iter(given.values()), None)


def _content_text(content: Any, index: int) -> str:
    """A message's content as one text: text parts are joined with newlines (as vLLM joins
    them: many templates write `message.content` out as it is, which would print a list)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ParameterError("messages", f"messages.{index}.content must be a string or a list of text parts")


def _check_markup_free(special_tokens: re.Pattern[str], value: Any, path: list, depth: int,
                       also_keys: bool = False) -> None:
    """ParameterError naming the field (the first `depth` parts of a string's path) if a
    string in `value` (at any depth, dict keys included) holds a special token's text or a
    reserved character (`chat_markup.RESERVED_CHARACTERS`).
    Iterative: nesting is as deep as a JSON parser allowed."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            found = special_tokens.search(item)
            if found is not None:
                param = ".".join(map(str, where[:depth]))
                raise ParameterError(param, f"{param} must not contain the special token {found.group()!r}")
            reserved = RESERVED_CHARACTERS.search(item)
            if reserved is not None:
                param = ".".join(map(str, where[:depth]))
                raise ParameterError(param, f"{param} must not contain {reserved.group()!r} (U+E000-U+E004 mark "
                                            "message texts in chat rendering)")
        elif isinstance(item, dict):
            # Keys too, except a message's own field names ("name", "tool_calls").
            stack += [(k, where) for k in item if also_keys or len(where) > 2]
            stack += [(v, where + [k]) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(v, where + [j]) for j, v in enumerate(item)]

"""Chat prompts: messages rendered with the tokenizer's chat template into token ids, where
only the template's own markup yields special tokens (`LLM.chat`, and the server's
/v1/chat/completions and /tokenize).

Message contents go through the template as placeholders and are tokenized as plain text,
so a user who writes "<|im_end|>" gets those characters, not the end-of-turn token (role
injection). Every other string a template may write as it is -- a message's name, tool
call ids, names and arguments, template variables -- must not hold a special token's text:
that is a ParameterError naming the field.
"""
import inspect
import json
import re
import secrets
from typing import Any

from hybrid_engine.prompts import encode_prompt
from hybrid_engine.sampling_params import ParameterError

# Message texts stand in the rendered template as "<_MARK>nonce-n<_MARK>": a private-use
# character around a random nonce drawn for each rendering, so that no client text (a tool
# call's arguments, a name: fields the template writes as they are) can spell a placeholder
# and have another message's text put in its place.
_MARK = "\ue000"
# How deep a field's name goes: strings inside a tool call's arguments are reported as the
# arguments ("messages.1.tool_calls.0.function.arguments"), those inside a template variable
# as the variable ("chat_template_kwargs.name").
_MESSAGE_PARAM_DEPTH, _VARIABLE_PARAM_DEPTH = 6, 2


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], special_tokens: re.Pattern[str], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's token ids: `messages` (OpenAI-style dicts; content a string, None, or
    text parts) through the tokenizer's chat template, with the assistant prefix
    (`add_generation_prompt`) or the last assistant message left open
    (`continue_final_message`), and `template_kwargs` as extra template variables.
    `special_tokens`: `hybrid_engine.tokenizer.special_token_pattern(tokenizer)`. ParameterError naming
    the field for a special token's text outside the contents, a content that is no text,
    or messages the template cannot render."""
    if continue_final_message and add_generation_prompt:
        raise ParameterError("continue_final_message", "continue_final_message needs add_generation_prompt false: "
                                                       "the last message is continued, so no new assistant turn starts")
    if continue_final_message and not (messages and isinstance(messages[-1], dict)
                                       and messages[-1].get("role") == "assistant"):
        raise ParameterError("continue_final_message", "continue_final_message needs an assistant message last")
    template_kwargs = template_kwargs or {}
    taken = sorted(set(template_kwargs) & _renderer_arguments(tokenizer))
    if taken:
        raise ParameterError("chat_template_kwargs", f"chat_template_kwargs must not set {taken}: those are the "
                                                     "renderer's own arguments (the request's fields set some)")
    _check_markup_free(special_tokens, template_kwargs, ["chat_template_kwargs"], _VARIABLE_PARAM_DEPTH,
                       also_keys=True)
    texts: dict[str, str] = {}
    nonce = secrets.token_hex(8)
    dicts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ParameterError("messages", f"messages.{i} must be a dict with a role and a content")
        message = _with_parsed_arguments(message)
        _check_markup_free(special_tokens, {k: v for k, v in message.items() if k != "content"}, ["messages", i],
                           _MESSAGE_PARAM_DEPTH)
        content = _content_text(message.get("content"), i)
        if content:  # (an empty text stays empty: templates test content for truth)
            key = f"{_MARK}{nonce}-{len(texts)}{_MARK}"
            texts[key] = content
            content = key
        dicts.append({**message, "content": content})
    try:
        # Render to text, then encode: transformers 5 returns a BatchEncoding (not ids)
        # from apply_chat_template(tokenize=True).
        rendered = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **template_kwargs)
    except Exception as exc:  # no template, or the template rejects these messages
        raise ParameterError("messages", f"messages: the chat template cannot render these messages: {exc}") from exc
    ids: list[int] = []
    # The template already holds any special tokens (BOS included) it wants.
    for piece in re.split(f"({_MARK}{nonce}-[0-9]+{_MARK})", rendered):
        if piece in texts:
            ids += encode_prompt(texts[piece], tokenizer, "messages", add_special_tokens=False,
                                 split_special_tokens=True)
        elif piece:
            ids += encode_prompt(piece, tokenizer, "messages", add_special_tokens=False)
    return ids


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
    string in `value` (at any depth, dict keys included) holds a special token's text.
    Iterative: nesting is as deep as a JSON parser allowed."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            found = special_tokens.search(item)
            if found is not None:
                param = ".".join(map(str, where[:depth]))
                raise ParameterError(param, f"{param} must not contain the special token {found.group()!r}")
        elif isinstance(item, dict):
            # Keys too, except a message's own field names ("name", "tool_calls").
            stack += [(k, where) for k in item if also_keys or len(where) > 2]
            stack += [(v, where + [k]) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(v, where + [j]) for j, v in enumerate(item)]

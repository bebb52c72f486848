"""Chat prompts: messages rendered with the tokenizer's chat template into token ids, where
only the template's own markup yields special tokens (`LLM.chat`, and the server's
/v1/chat/completions and /tokenize).

The template sees the real message contents, so templates that act on them work as in
transformers and vLLM: NVIDIA's Nemotron templates turn reasoning off for "/no_think" in
a system or user message and strip the switch from the text, others trim contents or drop
old reasoning. The prompt text is transformers' rendering; what differs is where special
tokens may come from. A user who writes "<|im_end|>" gets those characters, not the
end-of-turn token (role injection), even where a template's rewrite of the text forms one
(Nemotron's templates delete "/think", which turns "<SPECIAL_/think11>" into "<SPECIAL_11>").

How the template's markup is told from the contents: a second rendering wraps each content
in markers ("<open>content<close>", private-use characters around a random nonce). Its text
outside the markers is the template's own; the real rendering must be that markup with
each marked content in place (stripped of outer whitespace if the template trims it), and
only special tokens wholly inside markup are parsed as such. Contents go through the
template as opaque placeholders instead (tokenized as plain text, so templates do not act
on them) where that cannot be told safely:
- a content that holds a special token's text itself (a template could write a piece of
  it on its own, with no marker around it);
- a content whose markers the template breaks, unless the part it keeps is a head or a
  tail of the text: a template that keeps what follows "</think>" (old reasoning dropped)
  is then given that tail, which must render the same;
- a content that the marked rendering leaves out (a template that writes only pieces from
  inside it would write them with no marker);
- every content, where the marked rendering takes another branch than the real one (a
  template that tests `content.startswith(...)`).
What this does not see: a template that writes a content whole and, apart from it, a piece
from inside it that it rewrites into a special token's text. No known template does.

An assistant message's reasoning sent back (`reasoning`, `reasoning_content` or
`thinking`) is message text too: the template gets it under each of those names, marked
and tokenized as a content is.

Every other string a template writes as it is -- a message's name, tool call ids, names
and arguments, template variables -- must not hold a special token's text: that is a
ParameterError naming the field.
"""
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
import secrets
from collections.abc import Callable
from typing import Any

from hybrid_engine.prompts import encode_prompt
from hybrid_engine.sampling_params import ParameterError

logger = logging.getLogger(__name__)

# A content stands in a rendering as "<kind>nonce-n<_END>": kind _OPEN / _CLOSE around its
# text in the marked rendering, _PLACEHOLDER for the whole text where it must not reach the
# template. Private-use characters and a random decimal nonce drawn for each conversation
# (digits: a template that upper-cases a text keeps them), so that no client text (a tool
# call's arguments, a name: fields the template writes as they are) can spell a marker.
_PLACEHOLDER, _OPEN, _CLOSE, _END = "\ue000", "\ue001", "\ue002", "\ue003"
# The names an assistant message's reasoning goes by (vLLM's `reasoning`, DeepSeek's and
# HF templates' `reasoning_content`, gpt-oss templates' `thinking`): text of the message's
# own, rendered as its content is.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# How deep a field's name goes: strings inside a tool call's arguments are reported as the
# arguments ("messages.1.tool_calls.0.function.arguments"), those inside a template variable
# as the variable ("chat_template_kwargs.name").
_MESSAGE_PARAM_DEPTH, _VARIABLE_PARAM_DEPTH = 6, 2


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A stretch of the rendered prompt: the template's markup, or (`content`) text that
    came from a message's content."""
    text: str
    content: bool


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], special_tokens: re.Pattern[str], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None) -> list[int]:
    """The prompt's token ids: `messages` (OpenAI-style dicts; content a string, None, or
    text parts; an assistant's reasoning under any of REASONING_FIELDS, a string) through
    `chat_template` (a Jinja template; default: the tokenizer's), with the assistant prefix
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
    dicts, contents, fields = [], [], []  # fields: (message index, field) of each content
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ParameterError("messages", f"messages.{i} must be a dict with a role and a content")
        message = _with_parsed_arguments(message)
        markup = {k: v for k, v in message.items() if k != "content" and k not in REASONING_FIELDS}
        _check_markup_free(special_tokens, markup, ["messages", i], _MESSAGE_PARAM_DEPTH)
        contents.append(_content_text(message.get("content"), i))
        fields.append((i, "content"))
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ParameterError("messages", f"messages.{i}.reasoning_content must be a string")
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
                chat_template=chat_template, **template_kwargs)
        except Exception as exc:  # no template, or the template rejects these messages
            raise ParameterError("messages", f"messages: the chat template cannot render these messages: "
                                             f"{exc}") from exc

    return _encode(_rendered_pieces(render, contents, special_tokens), tokenizer, special_tokens)


def _rendered_pieces(render: Callable[[list[str]], str], contents: list[str],
                     special_tokens: re.Pattern[str]) -> list[_Piece]:
    """The real rendering of `contents`, cut into markup and content pieces (module
    docstring). A content that holds a special token's text reaches the template as a
    placeholder (a template could write a piece of it apart, with no marker); so does one
    whose markers the template breaks, unless the part it keeps is the content's head or
    tail, which then stands in for it; and all of them do if the marked rendering cannot be
    laid over the real one."""
    nonce = str(secrets.randbelow(10 ** 18))
    opaque = {i for i, text in enumerate(contents) if special_tokens.search(text)}
    for cuts in (True, False):  # (a kept head or tail can change the template's branches: then without)
        items, opaque = _marked_items(render, contents, opaque, nonce, cuts)
        pieces = _align(items, render(_stand_ins(contents, opaque, nonce)))
        if pieces is not None:
            return _with_placeholders_filled(pieces, contents, nonce)
    _warn_once("the chat template takes another branch for marked message contents: every content of such a "
               "conversation reaches it as a placeholder (docs/server.md)")
    everything = set(range(len(contents)))
    return _with_placeholders_filled([_Piece(render(_stand_ins(contents, everything, nonce)), False)], contents, nonce)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Log `message` the first time only: a template's way with contents repeats with every
    request."""
    logger.warning(message)


def _tag(kind: str, nonce: str, index: int) -> str:
    """A content's marker or placeholder in a rendering."""
    return f"{kind}{nonce}-{index}{_END}"


def _stand_ins(texts: list[str], opaque: set[int], nonce: str) -> list[str]:
    """What the template gets for each content: its text, or its placeholder if it is
    opaque. (An empty content stays empty in every rendering: templates test content for
    truth.)"""
    return [_tag(_PLACEHOLDER, nonce, i) if text and i in opaque else text for i, text in enumerate(texts)]


def _marked_items(render: Callable[[list[str]], str], contents: list[str], opaque: set[int], nonce: str,
                  cuts: bool) -> tuple[list[_Piece], set[int]]:
    """The marked rendering's pieces, once every content's markers pair up, and the contents
    that had to become opaque for that. With `cuts`, a content of which the template keeps
    only a head or tail (it cut the marker off the other end) is rendered as that part
    instead, once."""
    opaque, texts, cut = set(opaque), list(contents), set()
    while True:
        marked = render([_tag(_OPEN, nonce, i) + text + _tag(_CLOSE, nonce, i) if text and i not in opaque else stand_in
                         for i, (text, stand_in) in enumerate(zip(texts, _stand_ins(texts, opaque, nonce)))])
        items, broken = _parse_marked(marked, nonce, texts)
        # A content with no marker in the rendering: either the template leaves it out (then
        # its placeholder is left out too) or it writes only pieces from inside it.
        written = set(map(int, re.findall(f"[{_OPEN}{_CLOSE}]{nonce}-([0-9]+){_END}", marked)))
        missing = {i for i, text in enumerate(texts) if text and i not in opaque and i not in written}
        if not broken and not missing:
            return items, opaque
        opaque |= missing
        for i, kept in broken.items():
            if cuts and kept and i not in cut:
                texts[i] = kept
                cut.add(i)
            else:
                opaque.add(i)
                _warn_once("the chat template cuts or rewrites a message's content so that its markers break: "
                           "such a content reaches it as a placeholder (docs/server.md)")


def _parse_marked(marked: str, nonce: str, texts: list[str]) -> tuple[list[_Piece], dict[int, str]]:
    """The marked rendering as markup and content pieces (a content piece: the text between
    a content's open and close markers), and the contents whose markers do not pair up, each
    with the head or tail of its text that the rendering seems to keep ("" if none)."""
    items: list[_Piece] = []
    broken: dict[int, str] = {}
    inside, start, at = None, 0, 0

    def lone_open(index: int, end: int) -> None:  # the text after the marker is the content's head
        broken.setdefault(index, _strict_part(os.path.commonprefix([marked[start:end], texts[index]]), texts[index]))

    for marker in re.finditer(f"([{_OPEN}{_CLOSE}]){nonce}-([0-9]+){_END}", marked):
        kind, index = marker.group(1), int(marker.group(2))
        if kind == _CLOSE and inside == index:
            items.append(_Piece(marked[start:marker.start()], True))
            inside = None
        elif kind == _OPEN:
            if inside is None:
                items.append(_Piece(marked[at:marker.start()], False))
            else:
                lone_open(inside, marker.start())
            inside, start = index, marker.end()
        else:  # a close marker alone: the text before it is the content's tail
            if inside is not None:
                lone_open(inside, marker.start())
                inside = None
            before, text = marked[at:marker.start()][::-1], texts[index][::-1]
            broken.setdefault(index, _strict_part(os.path.commonprefix([before, text])[::-1], texts[index]))
        at = marker.end()
    if inside is not None:
        lone_open(inside, len(marked))
    items.append(_Piece(marked[at:], False))
    return [item for item in items if item.text or item.content], broken


def _strict_part(part: str, text: str) -> str:
    """`part` if it is a non-empty part of `text` shorter than it, else "" (no cut found)."""
    return part if 0 < len(part) < len(text) else ""


def _align(items: list[_Piece], real: str) -> list[_Piece] | None:
    """`real` cut into the marked rendering's pieces, each content piece as it is or with its
    outer whitespace stripped on either or both sides (a template that trims contents);
    None if the markup does not match (the marked rendering took another branch). A depth-
    first search over the strip choices, each (piece, position) tried once."""
    choices = [[item.text] if not item.content else list(dict.fromkeys(
        [item.text, item.text.strip(), item.text.lstrip(), item.text.rstrip()])) for item in items]
    chosen: list[str] = []
    starts, tried = [0], [0]
    dead: set[tuple[int, int]] = set()
    while starts:
        i, at = len(chosen), starts[-1]
        if i == len(items) and at == len(real):
            return [_Piece(text, item.content) for text, item in zip(chosen, items)]
        if i < len(items) and tried[-1] < len(choices[i]):
            text = choices[i][tried[-1]]
            tried[-1] += 1
            if real.startswith(text, at) and (i + 1, at + len(text)) not in dead:
                chosen.append(text)
                starts.append(at + len(text))
                tried.append(0)
            continue
        dead.add((i, at))
        starts.pop()
        tried.pop()
        if chosen:
            chosen.pop()
    return None


def _with_placeholders_filled(pieces: list[_Piece], contents: list[str], nonce: str) -> list[_Piece]:
    """The pieces with each placeholder in the markup replaced by its content's text, as a
    content piece. ParameterError if a placeholder came out of the template cut or changed:
    the content's text cannot be put back, and a piece of a placeholder must not reach the
    model."""
    filled = []
    for piece in pieces:
        if piece.content:
            filled.append(piece)
            continue
        for j, part in enumerate(re.split(f"{_PLACEHOLDER}{nonce}-([0-9]+){_END}", piece.text)):
            if j % 2:
                filled.append(_Piece(contents[int(part)], True))
            elif nonce in part:  # (the markers' characters alone could be a tool name's)
                raise ParameterError("messages", "messages: the chat template cuts or rewrites a message's content in "
                                                 "a way that leaves its text and the template's markup apart from "
                                                 "each other unknown; send the prompt to /v1/completions rendered "
                                                 "instead")
            elif part:
                filled.append(_Piece(part, False))
    return filled


def _encode(pieces: list[_Piece], tokenizer: Any, special_tokens: re.Pattern[str]) -> list[int]:
    """The token ids of the pieces' text. When no special token's text overlaps a content
    piece, that is the whole text encoded at once, as transformers encodes a rendered chat;
    otherwise each special token wholly inside markup is its token and all other text is
    encoded as plain text (a content's "<|im_end|>" stays characters)."""
    text = "".join(piece.text for piece in pieces)
    markup_spans, at = [], 0
    for piece in pieces:
        if not piece.content:
            markup_spans.append((at, at + len(piece.text)))
        at += len(piece.text)
    # Every occurrence, overlapping ones included: a tokenizer's other added tokens could
    # make it split the text elsewhere than one left-to-right scan does.
    overlapping = re.compile(f"(?=({special_tokens.pattern}))")
    span = iter(markup_spans)
    current = next(span, None)
    in_markup = True
    for found in overlapping.finditer(text):
        start, end = found.start(1), found.end(1)
        while current is not None and current[1] <= start:
            current = next(span, None)
        if current is None or not (current[0] <= start and end <= current[1]):
            in_markup = False
            break
    if in_markup:
        return encode_prompt(text, tokenizer, "messages", add_special_tokens=False)
    ids: list[int] = []
    plain = ""  # text waiting to be encoded as plain text, up to the next markup special token
    for piece in pieces:
        if piece.content:
            plain += piece.text
            continue
        at = 0
        for special in special_tokens.finditer(piece.text):
            plain += piece.text[at:special.start()]
            ids += _plain_ids(plain, tokenizer) + [tokenizer.convert_tokens_to_ids(special.group())]
            plain, at = "", special.end()
        plain += piece.text[at:]
    return ids + _plain_ids(plain, tokenizer)


def _plain_ids(text: str, tokenizer: Any) -> list[int]:
    """`text` encoded with special-token strings as plain text."""
    return encode_prompt(text, tokenizer, "messages", add_special_tokens=False, split_special_tokens=True) \
        if text else []


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: the Jinja text itself
    (anything with a Jinja delimiter in it), else the path of a file holding it. OSError for
    a file that cannot be read."""
    if "{{" in value or "{%" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


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

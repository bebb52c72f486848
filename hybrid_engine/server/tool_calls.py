"""Tool-call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`): the calls a chat
reply writes between tags become `message.tool_calls` (streamed as `delta.tool_calls`), the
rest stays content, as vLLM's parsers of the same names answer.

- `hermes` (Hermes, Qwen2.5 / Qwen3, Granite-4.0): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `nemotron_json` (Nemotron-Nano-v2): the calls are one JSON list,
  `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.
- `qwen3_coder` (Nemotron-3-Nano, Qwen3-Coder): each call is
  `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, a
  value's text read as its parameter's JSON Schema type in the request's tools says
  (`_typed`).

In JSON, `arguments` must be an object (written out with `json.dumps`, as vLLM's parsers do:
OpenAI's clients read a JSON string) or a string (kept). As vLLM's parsers: `nemotron_json` also
takes a single object for its list, and skips the items of a list that are no calls; a
block the reply leaves open (a token limit, or a stop string at its close tag) is still
parsed. A block that holds no call stays in the content as written. White space right
before a call, and at the end of a reply that called something, is not content (so a
reply of calls alone has `content` null, as OpenAI's have); all other text outside the
blocks is.

A stream and the whole reply split the same way: the stream holds back a block until its
close tag, text that could still begin an open tag, and white space (above); the whole
reply is the same parser fed once. A call is streamed whole, in one delta (id, name and
arguments), which OpenAI's clients assemble as they do pieces.
"""
import dataclasses
import json
import math
import re
import uuid
from typing import Any, Literal

from hybrid_engine.server.tags import tag_prefix_length


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes its calls: between `open` and `close`, a `body` of one call's JSON
    object ("object"), a JSON list of calls ("list"), or qwen3_coder's XML ("xml")."""
    open: str
    close: str
    body: Literal["object", "list", "xml"]


TOOL_CALL_PARSERS = {
    "hermes": ToolCallFormat("<tool_call>", "</tool_call>", "object"),
    "nemotron_json": ToolCallFormat("<TOOLCALL>", "</TOOLCALL>", "list"),
    "qwen3_coder": ToolCallFormat("<tool_call>", "</tool_call>", "xml"),
}


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One call out of a reply: the function's name and its arguments as a JSON string."""
    id: str
    name: str
    arguments: str


@dataclasses.dataclass
class ToolCallSplit:
    """One reply's text, split as it arrives into content and calls (`feed`)."""

    format: ToolCallFormat
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the request's (qwen3_coder's types)
    block: str | None = None  # the open block's text so far (None: outside a block)
    held: str = ""  # outside a block: text that could still begin the open tag
    white: str = ""  # outside a block: white space that goes out only if content follows
    called: bool = False  # a call was parsed (trailing white space is then not content)

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that `text`, the reply's next piece, adds (`final`:
        the reply ends with it, so nothing is held back)."""
        opening, closing = self.format.open, self.format.close
        text, self.held = self.held + text, ""
        content, calls = "", []
        while text:
            if self.block is None:
                start = text.find(opening)
                if start < 0:
                    keep = 0 if final else tag_prefix_length(text, opening)
                    content += self._outside(text[:len(text) - keep])
                    self.held, text = text[len(text) - keep:], ""
                else:
                    content += self._outside(text[:start])
                    self.block, text = "", text[start + len(opening):]
                continue
            searched_from = max(0, len(self.block) - len(closing) + 1)  # (a close tag cut between pieces)
            self.block += text
            end = self.block.find(closing, searched_from)
            if end < 0:
                break
            block, text = self.block[:end], self.block[end + len(closing):]
            self.block = None
            content += self._parsed(block, closing, calls)
        if final:
            if self.block is not None:  # left open (a token limit, a stop string): parsed all the same
                block, self.block = self.block, None
                content += self._parsed(block, "", calls)
            if not self.called:
                content += self.white
            self.white = ""
        return content, calls

    def _parsed(self, block: str, closing: str, calls: list[ParsedCall]) -> str:
        """Adds a block's calls to `calls`; returns the content it adds instead if it holds
        none (the block as written, its close tag `closing` included)."""
        parsed = _xml_calls(block, self.tools) if self.format.body == "xml" else _calls(block, self.format.body)
        if not parsed:
            return self._outside(self.format.open + block + closing)
        calls += parsed
        self.called = True
        self.white = ""  # (white space right before a call is not content)
        return ""

    def _outside(self, text: str) -> str:
        """What of `text` (outside any block) goes out now: white space at its end waits
        for content to follow."""
        text = self.white + text
        stripped = text.rstrip()
        self.white = text[len(stripped):]
        return stripped


@dataclasses.dataclass
class ForcedCallSplit:
    """A reply that `tool_choice` forced into calls (structured outputs, as vLLM forces
    them): for a named function the reply is its arguments, a JSON object; for "required"
    it is a JSON list of `{"name": ..., "parameters": {...}}` (`forced_call_schema`). The
    reply is held until it ends, then read whole: its calls, no content. A reply cut short
    (max_tokens) that does not parse is content, as written."""

    name: str | None  # the named function; None for "required"
    text: str = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """As `ToolCallSplit.feed`: nothing until the reply's last piece."""
        self.text += text
        if not final:
            return "", []
        try:
            value = json.loads(self.text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return self.text, []
        if self.name is not None:  # (the arguments as the model wrote them, as vLLM keeps them)
            calls = [ParsedCall(_call_id(), self.name, self.text)] if isinstance(value, dict) else []
        else:
            calls = [_call(item["name"], item.get("parameters", {})) for item in value
                     if isinstance(item, dict) and isinstance(item.get("name"), str)] \
                if isinstance(value, list) else []
            calls = [call for call in calls if call is not None]
        return ("", calls) if calls else (self.text, [])


def forced_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema a forced reply follows (`ForcedCallSplit`): the named function's
    parameters, or for "required" a non-empty list of calls of any of `tools` (vLLM's
    shape). A function without parameters takes any object. In the list, each function's
    parameters sit under the list's own `$defs` (`tool0`, its definitions `tool0.NAME`), so
    that their `$ref`s ("#", "#/$defs/NAME") still point into their own schema."""
    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object"}

    if name is not None:
        return parameters(next(tool for tool in tools if tool["function"]["name"] == name))
    definitions: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        params = parameters(tool)
        own = {key: params[key] for key in ("$defs", "definitions") if isinstance(params.get(key), dict)}
        for kind, named in own.items():
            for def_name, schema in named.items():
                definitions[f"tool{i}.{kind}.{def_name}"] = _rebased(schema, i)
        definitions[f"tool{i}"] = _rebased({k: v for k, v in params.items() if k not in own}, i)
    return {"type": "array", "minItems": 1, "$defs": definitions, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": [tool["function"]["name"]]},
                                          "parameters": {"$ref": f"#/$defs/tool{i}"}},
         "required": ["name", "parameters"]} for i, tool in enumerate(tools)]}}


def user_schema_path(message: str) -> str:
    """A grammar error's message about `forced_call_schema`'s list schema, with its paths
    ("$.$defs.tool0.properties.n") as the request spells them
    ("tools[0].function.parameters.properties.n")."""
    return re.sub(r"\$\.\$defs\.tool(\d+)(?:\.(\$defs|definitions)\.)?",
                  lambda m: f"tools[{m.group(1)}].function.parameters" + (f".{m.group(2)}." if m.group(2) else ""),
                  message)


def _rebased(schema: Any, tool: int) -> Any:
    """`schema` (part of tool `tool`'s parameters) with its `$ref`s into the parameters
    ("#", "#/$defs/NAME", "#/definitions/NAME") pointing where `forced_call_schema` puts them."""
    if isinstance(schema, list):
        return [_rebased(item, tool) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, tool) for key, value in schema.items()}
    ref = schema.get("$ref")
    if ref == "#":
        out["$ref"] = f"#/$defs/tool{tool}"
    elif isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
        kind, _, def_name = ref[2:].partition("/")
        out["$ref"] = f"#/$defs/tool{tool}.{kind}.{def_name}"
    return out


def _calls(block: str, body: str) -> list[ParsedCall]:
    """The calls a JSON block's text holds, as vLLM's parsers read them (module docstring)."""
    try:
        value = json.loads(block, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return []
    items = value if body == "list" and isinstance(value, list) else [value]
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            call = _call(item["name"], item.get("arguments", {}))
            calls += [call] if call else []
    return calls


def _call(name: str, arguments: Any) -> ParsedCall | None:
    """A call of `name` with `arguments` (an object, written out as JSON, or a JSON string,
    kept); None for other arguments or numbers JSON cannot write (infinite ones)."""
    if isinstance(arguments, dict):
        try:
            arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, str):
        return None
    return ParsedCall(_call_id(), name, arguments)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _no_constant(name: str) -> None:
    """`json.loads` meets NaN or Infinity, which JSON does not have: no call."""
    raise ValueError(f"{name} is not JSON")


def _xml_calls(block: str, tools: list[dict[str, Any]]) -> list[ParsedCall]:
    """qwen3_coder's calls: each `<function=NAME>` up to its `</function>` (or the next
    function, or the block's end: a reply cut off is read as far as it goes), holding
    `<parameter=KEY>value</parameter>`s, each value read as its parameter's JSON Schema type
    says (`_typed`). One pass over the text (`_xml_sections`)."""
    calls = []
    for function in _xml_sections(block, "<function=", "</function>"):
        name, bracket, body = function.partition(">")
        if not bracket or "\n" in name:
            continue
        name = name.strip()
        properties = next((tool["function"].get("parameters") or {} for tool in tools
                           if tool["function"]["name"] == name), {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {}
        for parameter in _xml_sections(body, "<parameter=", "</parameter>"):
            key, bracket, value = parameter.partition(">")
            if bracket and "\n" not in key:
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                arguments[key.strip()] = _typed(value, properties.get(key.strip()))
        call = _call(name, arguments)
        calls += [call] if call else []
    return calls


def _xml_sections(text: str, opening: str, closing: str) -> list[str]:
    """What follows each `opening` in `text`, up to its `closing`, or else to the next
    `opening` or the end: each stretch of the text is searched once."""
    starts = [found.end() for found in re.finditer(re.escape(opening), text)]
    sections = []
    for start, stop in zip(starts, [begin - len(opening) for begin in starts[1:]] + [len(text)]):
        section = text[start:stop]
        end = section.find(closing)
        sections.append(section if end < 0 else section[:end])
    return sections


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type says, as vLLM's parser reads it:
    "null" is null; an integer, a number (an integral one as an int) or an object or array
    parsed; anything else (a string, an unknown parameter) kept as text. Unlike vLLM, text
    that is not its type stays text: a boolean other than true or false (vLLM: false), an
    infinite number (no JSON for it), Python-literal objects (vLLM tries them)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    text = value.strip()
    if text.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            return json.loads(value, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        pass
    return value

"""JSON schema -> regex, for structured outputs (`response_format: {"type": "json_schema"}`).

`json_schema_regex(schema)` returns a regex whose full matches are exactly the JSON texts
this module lets a model write for `schema`; `structured.regex` compiles it to a byte
automaton. It uses only the dialect shared with Python's `re` (same meaning under
`re.ASCII`). Those texts are a documented subset of what the schema allows (a regex cannot
count brackets, and a bounded layout keeps a model from wandering):

Layout: between tokens (around `{ } [ ] , :`) a run of at most `MAX_WHITESPACE` characters
  of `[ \t\n\r]`, none with `any_whitespace=False`; never before or after the value. Keys
  and `enum`/`const` values appear only as `json.dumps(v, separators=(",", ":"),
  ensure_ascii=False)` writes them (no whitespace inside an object or array constant).
Objects: listed properties come in the order of `properties` (enforced); every `required`
  one appears, every other one may be left out. `additionalProperties` absent or false: no
  other keys (as OpenAI's strict mode); true or a schema: any number of further pairs after
  the listed ones, keyed by any JSON string (listed keys are not excluded, so a key may
  repeat), and a `required` key missing from `properties` is listed after them with that
  schema. `{"type": "object"}` with neither keyword: any object.
Any value: `{}` and `true` admit any JSON value with at most `MAX_ANY_DEPTH` levels of
  nested objects/arrays. An object or array type whose members are unconstrained (no
  `properties`/`prefixItems`; `additionalProperties`/`items` absent, true or `{}`) is the
  first of those levels.
Strings: any Unicode except `"`, `\\` and U+0000..U+001F, or the escapes `\\" \\\\ \\/ \\b
  \\f \\n \\r \\t \\uXXXX` (hex digits of any case). A `\\u` escape of a surrogate comes
  only as a pair, `\\uD800`-`\\uDBFF` then at once `\\uDC00`-`\\uDFFF`: a lone one is not
  Unicode, and strict readers (pydantic's jiter) refuse it although Python's json reads
  it. `minLength`/`maxLength` count code points, as JSON Schema does: one per character,
  one per escape, one per surrogate pair of escapes. `pattern` (one leading `^` and
  trailing `$` stripped) is matched against the raw characters between the quotes,
  escapes undecoded: a pattern that admits `"`, `\\` or a control character admits invalid
  JSON. `format`: date-time, date, time, uuid, email, ipv4, each exactly as
  `structured.string_formats` states (RFC 3339 with the offset required, real calendar
  dates, no leap second; what pydantic and Python's parsers accept). `pattern`, `format`
  and length bounds do not combine.
Numbers: "integer" is `-?(0|[1-9][0-9]*)` (no `1.0`, no exponent, no `-0`); "number" is
  any JSON number; both within the digit caps of `structured.number_range`, which states
  them for every grammar: `MAX_INTEGER_DIGITS` (20) digits before the point,
  `MAX_FRACTION_DIGITS` (20) after it, `MAX_EXPONENT_DIGITS` (2) in the exponent, so that
  each number parses to a finite double (`1e400` would be `inf`) and a readable int, and a
  model cannot write digits forever. An unbounded "integer" is `0|-?[1-9][0-9]{0,19}`;
  |value| < 10^20 bounds the side a range leaves open (`minimum: 0` is 0..10^20 - 1) and
  clips a bound beyond it. Bounds (`minimum`/`maximum`/`exclusiveMinimum`/
  `exclusiveMaximum`) are exact for both: exactly the texts within the caps whose value is
  within them match; a bound with more fraction digits than the cap is never crossed (the
  values nearest it are the ones lost). A bounded "number" is written without an exponent,
  as `-?(0|[1-9][0-9]*)(\\.[0-9]+)?` (trailing fraction zeros allowed: `0.50`), and a zero
  value without a `-` (no `-0`, no `-0.0`). A bound is the decimal its shortest repr spells
  (`0.1` is 1/10, not the nearest binary float; `1e-3` is 1/1000); a minimum and an
  exclusiveMinimum together: the tighter applies (likewise the maximums); bounds that leave
  no value within the caps (also 1e-30..2e-30 for a "number", a minimum of 1e30) raise
  ValueError. `enum`/`const` numbers are written as the schema's values are, caps aside.
  A bounded number's regex is at most a few thousand NFA states (`structured.number_range`).
Arrays: all `prefixItems` are present, in order; then items of `items`, if given (else a
  tuple is closed, as objects are). `{"type": "array"}` with neither: any array.
  `minItems`/`maxItems` become counted repeats that the regex compiler expands, so a large
  `maxItems` over a complex item schema makes a large automaton.
Combinators: `anyOf`; `oneOf` as anyOf (a value matching two branches is not excluded);
  `allOf` with one subschema. A `type` list gives alternatives, each keyword applying to its
  own type only; without `type`, the types whose keywords occur (else any value).
  `enum`/`const`: literal alternatives, filtered by a `type` beside them; other keywords
  beside them are not applied. `nullable` (OpenAPI) is refused: use `"type": [..., "null"]`.
References: `$ref` to `#`, `#/$defs/NAME` or `#/definitions/NAME`, resolved in the root. A
  `$ref` is followed at most `MAX_REF_DEPTH` times inside its own expansion; the next one,
  like a `false` subschema, is left out where the schema allows (optional property, anyOf
  branch, items beyond `minItems`, additional properties), else ValueError.
Errors: annotations (title, description, $schema, $id, $comment, default, examples,
  deprecated, readOnly, writeOnly, discriminator, contentEncoding, contentMediaType, and
  any `x-` keyword) are ignored, as are the formats "password" and "binary" (any string). Any other keyword (multipleOf, uniqueItems,
  not, if, patternProperties, minProperties, contains, ...), a keyword beside `$ref`/
  `anyOf`/`oneOf`/`allOf`, a property name or `enum`/`const` string holding a lone
  surrogate, or a malformed value raises ValueError("json_schema: ...") naming
  the keyword and the JSON path of its subschema, e.g. `$.properties.tags.items`.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from decimal import Decimal
from functools import partial

from hybrid_engine.structured.number_range import (
    ANY_INTEGER,
    ANY_NUMBER,
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    Bound,
    decimal_range,
    integer_range,
)
from hybrid_engine.structured.string_formats import FORMATS

# Greedy decoding can repeat a whitespace token forever; a bounded run stops that, and 16
# is enough for pretty-printed output a few levels deep.
MAX_WHITESPACE = 16
# A regex cannot match brackets, so free-form nesting is unrolled level by level, and each
# level holds the one below 4 times (an object's first and further values, an array's).
# Measured for `{}`: depth 3 is 32k characters (35k NFA states in `structured.regex`, the
# digit-capped numbers' counted repeats expanded), depth 4 is 127k (143k states, over two
# thirds of its 200k budget for a single free-form field).
MAX_ANY_DEPTH = 3
MAX_REF_DEPTH = 3  # expansions of one $ref inside itself before recursion is cut off

# Keywords that constrain nothing (OpenAPI's `discriminator` too: the `oneOf` branches it
# sits beside already decide), and `x-` extension keywords (pydantic's `json_schema_extra`).
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default",
                          "examples", "deprecated", "readOnly", "writeOnly", "discriminator",
                          "contentEncoding", "contentMediaType"})
# `format`s that name what a string is for without restricting it (pydantic's SecretStr, bytes).
_FREE_FORMATS = frozenset({"password", "binary"})


def _is_annotation(key: str) -> bool:
    return key in _ANNOTATIONS or key.startswith("x-")
_TYPE_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset(),  # bounds are inferred as "number"
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "boolean": frozenset(), "null": frozenset(),
}
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_KEYWORDS = frozenset().union(*_TYPE_KEYWORDS.values(), _COMBINATORS,
                              {"type", "enum", "const", "$defs", "definitions"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# A \u escape of a code point outside the surrogates, or of a surrogate pair (D800-DBFF
# then DC00-DFFF) as one character: a lone surrogate is not Unicode, and jiter (pydantic)
# refuses it although Python's json reads it.
_U_ESCAPE = (r"\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}"
             r"|[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_STRING_CHAR = rf'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|{_U_ESCAPE})'
_STRING = f'"{_STRING_CHAR}*"'
_METACHARACTERS = frozenset("\\.^$*+?()[]{}|")


def json_schema_regex(schema: dict | bool, *, any_whitespace: bool = True) -> str:
    """The regex whose full matches are the JSON texts allowed for `schema` under the
    rules of this module's docstring; ValueError("json_schema: ...") if it is unsupported."""
    builder = _Builder(schema, f"[ \\t\\n\\r]{{0,{MAX_WHITESPACE}}}" if any_whitespace else "")
    try:
        return builder.value(schema, "$")
    except _Omit as omit:
        raise _fail(str(omit)) from None


class _Omit(Exception):
    """A subschema that can produce nothing (`false`, or a `$ref` past `MAX_REF_DEPTH`);
    the nearest place that may leave it out catches this and does."""


def _attempt(make: Callable[[], str]) -> str | None:
    """`make()`, or None where what it makes produces nothing (it raised `_Omit`)."""
    try:
        return make()
    except _Omit:
        return None


def _fail(message: str) -> ValueError:
    return ValueError(f"json_schema: {message}")


def _alt(alternatives: list[str]) -> str:
    """Alternatives as one regex that is safe to concatenate."""
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def _repeat(atom: str, lo: int, hi: int | None) -> str:
    """`atom` (a single regex atom) repeated lo..hi times (hi None: unbounded)."""
    if hi == 0:
        return ""
    if hi is None:
        return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if lo == hi:
        return atom if lo == 1 else f"{atom}{{{lo}}}"
    return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}")


def _literal(text: str) -> str:
    """A regex matching exactly `text` (JSON text, so without raw control characters)."""
    return "".join("\\" + c if c in _METACHARACTERS else c for c in text)


def _unconstrained(schema: object) -> bool:
    """Whether `schema` admits every value (`true`, or nothing but annotations)."""
    return schema is True or (isinstance(schema, dict) and all(_is_annotation(key) for key in schema))


def _check_unicode(texts: list[str], what: str, path: str) -> None:
    """ValueError if a key or literal holds a lone surrogate (it has no valid spelling)."""
    if any(0xD800 <= ord(c) <= 0xDFFF for text in texts for c in text):
        raise _fail(f"{what} at {path} holds a lone surrogate, which is not Unicode")


def _json_types(value: object) -> set[str]:
    """The JSON types of an `enum`/`const` value (an integral number is both numbers)."""
    for kind, name in ((bool, "boolean"), (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return {name}
    if isinstance(value, (int, float)):
        return {"integer", "number"} if isinstance(value, int) or value.is_integer() else {"number"}
    return {"null"}


class _Builder:
    """Turns one root schema into a regex; holds what the whole walk shares."""

    def __init__(self, root: dict | bool, ws: str) -> None:
        self.root, self.ws = root, ws
        self.sep = f"{ws},{ws}"
        self.open_refs: dict[str, int] = {}  # $ref -> expansions open on the current path
        self.any_cache: dict[int, str] = {}

    def value(self, schema: object, path: str) -> str:
        """The regex of the JSON texts for `schema` found at JSON path `path`."""
        if schema is True:
            return self.any_value(MAX_ANY_DEPTH)
        if schema is False:
            raise _Omit(f"the schema at {path} is false: no value matches it")
        if not isinstance(schema, dict):
            raise _fail(f"the schema at {path} must be a JSON object or a boolean")
        for key in schema:
            if key not in _KEYWORDS and not _is_annotation(key):
                raise _fail(f"{key!r} at {path} is not supported")
        constraints = {key for key in schema if not _is_annotation(key)} - {"$defs", "definitions"}
        for combinator in _COMBINATORS:
            if combinator in schema:
                others = sorted(constraints - {combinator})
                if others:
                    raise _fail(f"{others[0]!r} beside {combinator!r} at {path} is not supported")
                return self.combinator(combinator, schema[combinator], path)
        if "enum" in schema or "const" in schema:
            return self.literals(schema, path)
        types = self.types(schema, path)
        if not types:
            return self.any_value(MAX_ANY_DEPTH)
        builders = {"object": self.object, "array": self.array, "string": self.string,
                    "integer": self.integer, "number": self.number,
                    "boolean": lambda s, p: "(?:true|false)", "null": lambda s, p: "null"}
        return self.alternatives([lambda t=t: builders[t](schema, path) for t in types], path)

    def alternatives(self, branches: list[Callable[[], str]], path: str) -> str:
        """The branches' alternation, leaving out those that produce nothing."""
        regexes = [regex for regex in map(_attempt, branches) if regex is not None]
        if not regexes:
            raise _Omit(f"no alternative at {path} can produce a value (each is false or "
                        f"recurses past MAX_REF_DEPTH={MAX_REF_DEPTH})")
        return _alt(regexes)

    def types(self, schema: dict, path: str) -> list[str]:
        """The schema's `type`s as a list, or those whose keywords occur in it."""
        if "type" not in schema:
            return [t for t, words in _TYPE_KEYWORDS.items() if words & schema.keys()]
        types = schema["type"]
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or not all(t in _TYPE_KEYWORDS for t in types):
            raise _fail(f"'type' at {path} must be a JSON type name or a non-empty list of them")
        return list(dict.fromkeys(types))

    def combinator(self, keyword: str, argument: object, path: str) -> str:
        """`$ref`, `anyOf`, `oneOf` or `allOf`."""
        if keyword == "$ref":
            return self.ref(argument, path)
        if not isinstance(argument, list) or not argument:
            raise _fail(f"{keyword!r} at {path} must be a non-empty list of schemas")
        if keyword == "allOf" and len(argument) != 1:
            raise _fail(f"'allOf' at {path} is supported with exactly one subschema only")
        return self.alternatives([lambda i=i, s=s: self.value(s, f"{path}.{keyword}[{i}]")
                                  for i, s in enumerate(argument)], path)

    def ref(self, ref: object, path: str) -> str:
        """A `$ref`, expanded in place; past `MAX_REF_DEPTH` open expansions it is omitted."""
        match = re.fullmatch(r"#(?:/(\$defs|definitions)/([^/]+))?", ref) if isinstance(ref, str) else None
        if match is None:
            raise _fail(f"'$ref' {ref!r} at {path} is not supported (only '#', "
                        "'#/$defs/NAME' and '#/definitions/NAME')")
        target, target_path = self.root, "$"
        if match.group(1):
            name = match.group(2).replace("~1", "/").replace("~0", "~")
            container = self.root.get(match.group(1)) if isinstance(self.root, dict) else None
            if not isinstance(container, dict) or name not in container:
                raise _fail(f"'$ref' {ref!r} at {path} points to nothing")
            target, target_path = container[name], f"$.{match.group(1)}.{name}"
        depth = self.open_refs.get(ref, 0)
        if depth >= MAX_REF_DEPTH:
            raise _Omit(f"'$ref' {ref!r} at {path} recurses more than MAX_REF_DEPTH="
                        f"{MAX_REF_DEPTH} times where it cannot be left out")
        self.open_refs[ref] = depth + 1
        try:
            return self.value(target, target_path)
        finally:
            self.open_refs[ref] = depth

    def literals(self, schema: dict, path: str) -> str:
        """`enum`/`const` as alternatives of compact JSON literals."""
        enum = schema.get("enum", [schema.get("const")])
        if not isinstance(enum, list) or not enum:
            raise _fail(f"'enum' at {path} must be a non-empty list")
        types = set(self.types(schema, path)) if "type" in schema else set(_TYPE_KEYWORDS)
        values = [v for v in ([schema["const"]] if "const" in schema else enum)
                  if v in enum and _json_types(v) & types]
        if not values:
            raise _fail(f"no 'enum'/'const' value at {path} agrees with 'enum', 'const' and 'type'")
        try:
            texts = [json.dumps(v, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
                     for v in values]
        except (TypeError, ValueError):
            raise _fail(f"an 'enum'/'const' value at {path} is not JSON") from None
        _check_unicode(texts, "an 'enum'/'const' value", path)
        return _alt([_literal(text) for text in dict.fromkeys(texts)])

    def any_value(self, depth: int) -> str:
        """Any JSON value with at most `depth` levels of nested objects/arrays."""
        if depth not in self.any_cache:
            kinds = [_STRING, ANY_NUMBER, "true", "false", "null"]
            if depth > 0:
                inner = partial(self.any_value, depth - 1)
                kinds += [self.object_regex([], inner), self.array_regex([], inner(), 0, None)]
            self.any_cache[depth] = _alt(kinds)
        return self.any_cache[depth]

    def object(self, schema: dict, path: str) -> str:
        """An object schema: listed properties in order, then any additional ones."""
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise _fail(f"'properties' at {path} must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise _fail(f"'required' at {path} must be a list of strings")
        members = [(key, lambda k=key, s=sub: self.value(s, f"{path}.properties.{k}"), key in required)
                   for key, sub in properties.items()]
        missing = [key for key in required if key not in properties]
        _check_unicode([*properties, *missing], "a property name", path)
        extra = schema.get("additionalProperties", False)
        extra_value = None
        if "properties" not in schema and _unconstrained(schema.get("additionalProperties", True)):
            extra_value = partial(self.any_value, MAX_ANY_DEPTH - 1)
        elif extra is not False:
            extra_value = partial(self.value, extra, f"{path}.additionalProperties")
        elif missing:
            raise _fail(f"'required' {missing[0]!r} at {path} is not in 'properties' "
                        "and 'additionalProperties' is false")
        if extra_value is not None:
            members += [(key, extra_value, True) for key in missing]
        return self.object_regex(members, extra_value)

    def object_regex(self, members: list[tuple[str, Callable[[], str], bool]],
                     extra_value: Callable[[], str] | None) -> str:
        """An object of `members` (key, value regex maker, required) in order, then any
        number of `extra_value` pairs. Built left to right as `written`, the regex of the
        non-empty prefixes so far, and `may_be_empty`: each member appears once, so the
        size is linear in the number of members."""
        ws, sep = self.ws, self.sep
        written, may_be_empty = None, True
        for key, make_value, is_required in members:
            value = make_value() if is_required else _attempt(make_value)
            if value is None:
                continue
            member = f"{_literal(json.dumps(key, ensure_ascii=False))}{ws}:{ws}{value}"
            if written is None:
                written = member
            elif is_required:
                written = f"(?:{written}{sep})?{member}" if may_be_empty else f"{written}{sep}{member}"
            elif may_be_empty:
                written = f"(?:{written}(?:{sep}{member})?|{member})"
            else:
                written = f"{written}(?:{sep}{member})?"
            may_be_empty = may_be_empty and not is_required
        value = None if extra_value is None else _attempt(extra_value)
        if value is not None:
            pair = f"{_STRING}{ws}:{ws}{value}"
            more = f"(?:{sep}{pair})*"
            written = (pair + more if written is None else
                       f"(?:{written}|{pair}){more}" if may_be_empty else written + more)
        if written is None:
            return rf"\{{{ws}\}}"
        return rf"\{{{ws}(?:{written}{ws})?\}}" if may_be_empty else rf"\{{{ws}{written}{ws}\}}"

    def array(self, schema: dict, path: str) -> str:
        """An array schema: the `prefixItems` in order, then `minItems`..`maxItems` in all
        of `items`."""
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise _fail(f"'prefixItems' at {path} must be a list of schemas")
        lo, hi = self.count(schema, "minItems", path), self.count(schema, "maxItems", path)
        if hi is not None and hi < max(lo, len(prefix)):
            raise _fail(f"'maxItems' at {path} is below 'minItems' or the 'prefixItems'")
        if isinstance(schema.get("items"), list):
            raise _fail(f"'items' at {path} must be a schema (a tuple is 'prefixItems')")
        heads = [self.value(s, f"{path}.prefixItems[{i}]") for i, s in enumerate(prefix)]
        lo, hi = max(lo - len(prefix), 0), None if hi is None else hi - len(prefix)
        item = None
        if "prefixItems" not in schema and _unconstrained(schema.get("items", True)):
            item = self.any_value(MAX_ANY_DEPTH - 1)
        elif "items" in schema:
            item = _attempt(partial(self.value, schema["items"], f"{path}.items"))
        if item is None and lo > 0:
            raise _Omit(f"'minItems' at {path} asks for more items than the schema can produce")
        return self.array_regex(heads, item, lo, 0 if item is None else hi)

    def array_regex(self, heads: list[str], item: str | None, lo: int, hi: int | None) -> str:
        """An array of the `heads` regexes in order, then lo..hi matches of `item`."""
        ws, sep = self.ws, self.sep
        if heads:
            body = sep.join(heads) + ("" if item is None else _repeat(f"(?:{sep}{item})", lo, hi))
            return rf"\[{ws}{body}{ws}\]"
        if item is None or hi == 0:
            return rf"\[{ws}\]"
        body = item + _repeat(f"(?:{sep}{item})", max(lo - 1, 0), None if hi is None else hi - 1)
        return rf"\[{ws}(?:{body}{ws})?\]" if lo == 0 else rf"\[{ws}{body}{ws}\]"

    def string(self, schema: dict, path: str) -> str:
        """A string schema: `format`, `pattern`, or length bounds."""
        if schema.get("format") in _FREE_FORMATS:
            schema = {k: v for k, v in schema.items() if k != "format"}
        shaped = [k for k in ("format", "pattern") if k in schema]
        sized = [k for k in ("minLength", "maxLength") if k in schema]
        if len(shaped) + bool(sized) > 1:
            raise _fail(f"{(shaped + sized)[1]!r} with {shaped[0]!r} at {path} is not supported")
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise _fail(f"'format' {schema['format']!r} at {path} is not supported")
            return f'"{FORMATS[schema["format"]]}"'
        if "pattern" in schema:
            pattern = schema["pattern"]
            try:
                re.compile(pattern)
            except (TypeError, re.error):
                raise _fail(f"'pattern' at {path} is not a regex") from None
            if not isinstance(pattern, str):
                raise _fail(f"'pattern' at {path} must be a string")
            pattern = pattern[1:] if pattern.startswith("^") else pattern
            trailing_backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
            if pattern.endswith("$") and trailing_backslashes % 2 == 0:
                pattern = pattern[:-1]
            return f'"(?:{pattern})"'
        lo, hi = self.count(schema, "minLength", path), self.count(schema, "maxLength", path)
        if hi is not None and hi < lo:
            raise _fail(f"'maxLength' at {path} is below 'minLength'")
        return f'"{_repeat(_STRING_CHAR, lo, hi)}"'

    def bounds(self, schema: dict, path: str) -> tuple[Bound | None, Bound | None]:
        """The tightest lower and upper bounds among `minimum`, `exclusiveMinimum`, `maximum`
        and `exclusiveMaximum` (None: unbounded), as exact decimals of their shortest repr."""
        lower = upper = None
        for keyword in [k for k in _BOUNDS if k in schema]:
            value = schema[keyword]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    isinstance(value, float) and not math.isfinite(value)):
                raise _fail(f"{keyword!r} at {path} must be a finite number")
            bound = Bound(Decimal(repr(value)), keyword.startswith("exclusive"))
            if keyword in ("minimum", "exclusiveMinimum"):  # at one value, exclusive is tighter
                if lower is None or (bound.value, bound.exclusive) > (lower.value, lower.exclusive):
                    lower = bound
            elif upper is None or (bound.value, not bound.exclusive) < (upper.value, not upper.exclusive):
                upper = bound
        return lower, upper

    def integer(self, schema: dict, path: str) -> str:
        """An integer within the digit cap, and within its bounds if it has any."""
        lower, upper = self.bounds(schema, path)
        if lower is None and upper is None:
            return ANY_INTEGER
        lo = None if lower is None else math.floor(lower.value) + 1 if lower.exclusive else math.ceil(lower.value)
        hi = None if upper is None else math.ceil(upper.value) - 1 if upper.exclusive else math.floor(upper.value)
        regex = integer_range(lo, hi)
        if regex is None:
            raise _fail(f"the bounds at {path} leave no integer of at most {MAX_INTEGER_DIGITS} digits")
        return regex

    def number(self, schema: dict, path: str) -> str:
        """Any JSON number within the digit caps, or one without exponent within its bounds
        if it has any."""
        lower, upper = self.bounds(schema, path)
        if lower is None and upper is None:
            return ANY_NUMBER
        regex = decimal_range(lower, upper)
        if regex is None:
            raise _fail(f"the bounds at {path} leave no number of at most {MAX_INTEGER_DIGITS} integer "
                        f"and {MAX_FRACTION_DIGITS} fraction digits")
        return regex

    def count(self, schema: dict, keyword: str, path: str) -> int | None:
        """A non-negative integer keyword (`minItems`, `maxLength`, ...): minimums default
        to 0, maximums to None."""
        value = schema.get(keyword, 0 if keyword.startswith("min") else None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _fail(f"{keyword!r} at {path} must be a non-negative integer")
        return value

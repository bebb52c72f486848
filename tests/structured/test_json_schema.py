"""Tests for `hybrid_engine.structured.json_schema`: the regex of a schema, checked with
Python's `re.fullmatch` (same dialect under `re.ASCII`) against JSON texts written several
ways, plus the engine's own regex compiler for the dialect."""
import datetime
import decimal
import importlib.util
import ipaddress
import itertools
import json
import random
import re
import uuid
from decimal import Decimal
from typing import Any, Literal, Optional

import pydantic
import pydantic_core
import pytest

from hybrid_engine.structured import json_schema
from hybrid_engine.structured.json_schema import (
    MAX_ANY_DEPTH,
    MAX_REF_DEPTH,
    MAX_WHITESPACE,
    json_schema_regex,
)
from hybrid_engine.structured.number_range import MAX_EXPONENT_DIGITS, MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS
from hybrid_engine.structured.regex import compile_regex
from tests.structured.test_number_range import AT_THE_CAPS, check_number, greedy_walks, numbers_in, parts
from tests.structured.test_string_formats import random_texts


def matches(schema: object, text: str, **options: bool) -> bool:
    return re.fullmatch(json_schema_regex(schema, **options), text, re.ASCII) is not None


def layouts(value: object) -> list[str]:
    """`value` serialised compactly, with json's default spacing, indented (every whitespace
    run of these shallow test values fits MAX_WHITESPACE) and with ASCII escapes or not."""
    texts = []
    for ensure_ascii in (True, False):
        texts += [json.dumps(value, separators=(",", ":"), ensure_ascii=ensure_ascii),
                  json.dumps(value, ensure_ascii=ensure_ascii),
                  json.dumps(value, indent=2, ensure_ascii=ensure_ascii),
                  json.dumps(value, indent="\t", separators=(" ,", " :"), ensure_ascii=ensure_ascii)]
    return texts


WEATHER = {
    "type": "object",
    "description": "Get the current weather",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
        "filters": {
            "type": "object",
            "properties": {"site": {"type": "string"}, "after": {"type": "string", "format": "date"}},
            "additionalProperties": False,
        },
        "safe": {"type": "boolean"},
    },
    "required": ["query"],
}
ORDER = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
        },
    },
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "address": {"$ref": "#/$defs/Address"}},
            "required": ["name", "address"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "format": "uuid"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
    },
    "required": ["id", "customer", "lines", "note"],
}
SKU = "123e4567-e89b-12d3-a456-426614174000"
LINE = {"sku": SKU, "qty": 2}
CUSTOMER = {"name": "Zoë \"Z\" Ünal", "address": {"street": "1 Main St\nFlat 2", "zip": "02139"}}
TREE = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {"name": {"type": "string"},
                           "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            "required": ["name"],
        },
    },
    "$ref": "#/$defs/Node",
}
# The root is not reached through a $ref, so a chain holds MAX_REF_DEPTH + 1 nodes.
LINKED = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
}


def tree(levels: int) -> dict:
    """A node with `levels` levels of nodes (itself included)."""
    node = {"name": f"leaf {levels}"}
    for level in range(levels - 1):
        node = {"name": f"n{level} \\ é", "children": [node, {"name": "x", "children": []}]}
    return node


def chain(nodes: int) -> dict:
    value = None
    for i in range(nodes):
        value = {"v": -i, "next": value}
    return value


# (schema, values that must match in every layout, texts that must not match)
CASES = {
    "function_call_weather": (
        WEATHER,
        [{"location": "Paris, France", "unit": "celsius"},
         {"location": "Zürich \"old\"\n\t\\ 😀 \x01", "unit": "fahrenheit"}],
        ['{"location":"Paris"}', '{"location":1,"unit":"celsius"}', '{"location":"P","unit":"kelvin"}',
         '{"location":"P","unit":"celsius","x":1}', '{"location":"P","unit":"celsius",}',
         ' {"location":"P","unit":"celsius"}', '{"location":"P","unit":"celsius"}\n',
         '{"location":"P","unit":"celsius"', '{"location":"P","unit":"celsius"}}',
         '{"location":"a\nb","unit":"celsius"}', '{"location":"a\\x","unit":"celsius"}', 'null'],
    ),
    "optional_parameters_nested_object_date": (
        SEARCH,
        [{"query": "q"}, {"query": "cats", "max_results": 50, "safe": False}, {"query": "x", "filters": {}},
         {"query": "x", "max_results": 1, "filters": {"site": "a.com", "after": "2024-02-29"}, "safe": True}],
        ['{"query":""}', '{"query":"x","max_results":0}', '{"query":"x","max_results":51}',
         '{"query":"x","max_results":5.0}', '{"query":"x","filters":{"after":"2024-13-01"}}',
         '{"max_results":3}', '{"query":"x","safe":"yes"}', '{"query":"x","filters":{"x":1}}', '{}'],
    ),
    "nested_defs_array_of_objects_uuid_pattern": (
        ORDER,
        [{"id": 7, "customer": CUSTOMER, "lines": [LINE], "note": None},
         {"id": -70, "customer": CUSTOMER, "lines": [LINE, {"sku": SKU.upper(), "qty": 999}], "note": "ok"}],
        [json.dumps({"id": 7, "customer": CUSTOMER, "lines": [], "note": None}),
         json.dumps({"id": 7, "customer": CUSTOMER, "lines": [LINE] * 4, "note": None}),
         json.dumps({"id": 7, "customer": CUSTOMER, "lines": [{"sku": SKU, "qty": 1000}], "note": None}),
         json.dumps({"id": 7, "customer": CUSTOMER, "lines": [{"sku": SKU[:-1], "qty": 1}], "note": None}),
         json.dumps({"id": 7, "customer": {"name": "n", "address": {"street": "s", "zip": "1234"}},
                     "lines": [LINE], "note": None}),
         json.dumps({"id": 7, "customer": {"name": "n" * 21, "address": CUSTOMER["address"]},
                     "lines": [LINE], "note": None}),
         json.dumps({"id": 7, "customer": CUSTOMER, "lines": [LINE]})],
    ),
    "anyOf_of_types": (
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": -5, "maximum": 5},
                   {"type": "null"}]},
        ["", "a\"\\", -5, 0, 5, None],
        ['"abcd"', "6", "-6", "true", "1.5", "-0"],
    ),
    "type_list_keywords_apply_per_type": (
        {"type": ["string", "integer", "null"], "maxLength": 2, "minimum": 0},
        ["ab", "\u00e9\n", 0, 123456789, None],
        ['"abc"', "-1", "false", "[]"],
    ),
    "enum_of_mixed_values": (
        {"enum": ["red", 1, -2.5, None, True, [1, "a"], {"k": None}, "tab\there"]},
        ["red", 1, -2.5, None, True, "tab\there"],
        ['"blue"', "2", "false", "[1]", '{"k":0}', '"tab here"'],
    ),
    "tuple_is_closed_without_items": (
        {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}, {"enum": ["m", "km"]}]},
        [[1.5, -2e10, "km"], [0, 1e-07, "m"]],
        ["[1,2]", '[1,2,"m",3]', '["1",2,"m"]', "[]"],
    ),
    "tuple_then_items_up_to_maxItems": (
        {"type": "array", "prefixItems": [{"const": "cmd"}], "items": {"type": "integer"}, "maxItems": 3},
        [["cmd"], ["cmd", 1, -2]],
        ['["cmd",1,2,3]', "[1]", "[]", '["cmd","x"]'],
    ),
    "map_of_integers": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1, "b": -2, "a b\n": 3}],
        ['{"a":"x"}', '{"a":1,}', '{,}', "[]", '{"a":1"b":2}', '{"a":1,,"b":2}', '{"a"1}'],
    ),
    "required_key_outside_properties_with_additional": (
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id", "kind"],
         "additionalProperties": True},
        [{"id": 1, "kind": "x"}, {"id": 1, "kind": [1, {"a": None}], "extra": {"x": [1]}, "more": "s"}],
        ['{"id":1}', '{"kind":1,"id":1}', '{"id":1,"extra":1,"kind":1}'],
    ),
    "free_object_and_array": (
        {"anyOf": [{"type": "object"}, {"type": "array", "minItems": 2}]},
        [{}, {"a": [1, {"b": "c"}], "d": None}, [1, "a"], [[], {}]],
        ["[1]", '{"a"}', '{"a":1,}', "1", '"s"'],
    ),
    "recursive_tree_defs": (
        TREE,
        [tree(1), tree(MAX_REF_DEPTH)],
        [json.dumps(tree(MAX_REF_DEPTH + 1)), '{"children":[]}'],
    ),
    "recursive_linked_list_root_ref": (
        LINKED,
        [chain(1), chain(MAX_REF_DEPTH + 1)],
        [json.dumps(chain(MAX_REF_DEPTH + 2)), '{"v":1}', '{"next":null,"v":1}'],
    ),
    "tool_call_bounded_numbers": (
        {"type": "object",
         "properties": {"price": {"type": "number", "minimum": 0},
                        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                        "celsius": {"type": "number", "exclusiveMinimum": -273.15, "maximum": 100.5}},
         "required": ["price"]},
        [{"price": 0}, {"price": 19.99, "ratio": 0.5}, {"price": 1234567.25, "ratio": 1, "celsius": -273.149},
         {"price": 0.0, "ratio": 0.0, "celsius": 100.5}, {"price": 3, "celsius": -0.5}],
        ['{"price":-0.01}', '{"price":-1}', '{"price":1e2}', '{"price":5,"ratio":1.0001}', '{"price":5,"ratio":2}',
         '{"price":5,"ratio":-0.0}', '{"price":1,"celsius":-273.15}', '{"price":1,"celsius":-273.150}',
         '{"price":1,"celsius":100.51}', '{"ratio":0.5}', '{"price":"1"}', '{"price":01}', '{"price":.5}'],
    ),
    "string_formats": (
        {"type": "object",
         "properties": {"at": {"type": "string", "format": "date-time"}, "t": {"type": "string", "format": "time"},
                        "ip": {"type": "string", "format": "ipv4"}, "mail": {"type": "string", "format": "email"}},
         "required": ["at", "t", "ip", "mail"]},
        [{"at": "2024-06-30T23:59:59.25+05:30", "t": "00:00:00Z", "ip": "255.0.10.9",
          "mail": "a.b+c@mail.example.org"},
         {"at": "2000-02-29T00:00:00-23:59", "t": "23:59:59.999999+00:00", "ip": "0.0.0.0", "mail": "x@y.zw"}],
        ['{"at":"2024-06-30 23:59:59Z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:60Z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"1900-02-29T23:59:59Z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00.1234567Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00Z","ip":"01.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a..b@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"24:00:00Z","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00","ip":"1.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00Z","ip":"256.1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00Z","ip":"1.1.1","mail":"a@b.co"}',
         '{"at":"2024-06-30T23:59:59Z","t":"00:00:00Z","ip":"1.1.1.1","mail":"a@b"}'],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_valid_instances_match_in_every_layout(name: str) -> None:
    schema, values, _ = CASES[name]
    for value in values:
        for text in layouts(value):
            assert matches(schema, text), (name, text)
        compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        assert matches(schema, compact, any_whitespace=False)


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_texts_do_not_match(name: str) -> None:
    schema, _, texts = CASES[name]
    for text in texts:
        assert not matches(schema, text), (name, text)


@pytest.mark.parametrize("name", list(CASES))
def test_the_engine_regex_compiler_accepts_the_regex(name: str) -> None:
    schema, values, texts = CASES[name]
    automaton = compile_regex(json_schema_regex(schema))

    def accepts(text: str) -> bool:
        return automaton.is_accepting(automaton.walk(automaton.start, text.encode()))

    assert all(accepts(json.dumps(value, indent=2, ensure_ascii=False)) for value in values)
    assert not any(accepts(text) for text in texts)


def test_enum_and_keys_match_only_in_their_compact_spelling() -> None:
    schema = {"type": "object", "properties": {"é": {"enum": ["grün", [1, 2]]}}, "required": ["é"]}
    assert matches(schema, '{"é":"grün"}') and matches(schema, '{"é": [1,2]}')
    assert not matches(schema, '{"\\u00e9":"grün"}')
    assert not matches(schema, '{"é":"gr\\u00fcn"}')
    assert not matches(schema, '{"é":[1, 2]}')


@pytest.mark.parametrize("required", [(), ("c",), ("a", "e"), ("b", "c", "d")])
def test_optional_properties_in_every_subset_and_listed_order_is_enforced(required: tuple[str, ...]) -> None:
    keys = ["a", "b", "c", "d", "e"]
    types = {"a": "integer", "b": "string", "c": "boolean", "d": "null", "e": "number"}
    samples = {"a": -3, "b": "s,\"}", "c": True, "d": None, "e": 0.5}
    schema = {"type": "object", "properties": {k: {"type": types[k]} for k in keys}, "required": list(required)}
    for size in range(len(keys) + 1):
        for subset in itertools.combinations(keys, size):
            value = {k: samples[k] for k in subset}
            valid = set(required) <= set(subset)
            for text in layouts(value):
                assert matches(schema, text) == valid, (subset, text)
            if len(subset) >= 2:  # order is enforced by design: the listed order only
                swapped = {k: samples[k] for k in (subset[1], subset[0], *subset[2:])}
                assert not matches(schema, json.dumps(swapped)), swapped
    assert not matches(schema, json.dumps({k: samples[k] for k in keys}).replace(",", ",,", 1))


def nested(depth: int, kind: str) -> object:
    """A value with `depth` levels of containers, alternating arrays and objects."""
    value: object = "leaf"
    for level in range(depth):
        value = [1, value] if (level % 2 == 0) == (kind == "array") else {"k": value, "n": None}
    return value


@pytest.mark.parametrize("schema", [{}, True, {"description": "anything"}])
@pytest.mark.parametrize("kind", ["array", "object"])
def test_any_value_nesting_is_bounded(schema: object, kind: str) -> None:
    for depth in range(MAX_ANY_DEPTH + 1):
        for text in layouts(nested(depth, kind)):
            assert matches(schema, text), text
    assert not matches(schema, json.dumps(nested(MAX_ANY_DEPTH + 1, kind)))
    # An object or array of unconstrained members is the first level.
    for free_object in ({"type": "object"}, {"type": "object", "additionalProperties": True},
                        {"type": "object", "additionalProperties": {"title": "anything"}}):
        assert matches(free_object, json.dumps({"a": nested(MAX_ANY_DEPTH - 1, kind)}))
        assert not matches(free_object, json.dumps({"a": nested(MAX_ANY_DEPTH, kind)}))
    for free_array in ({"type": "array"}, {"type": "array", "items": {}}, {"type": "array", "items": True}):
        assert matches(free_array, json.dumps([nested(MAX_ANY_DEPTH - 1, kind)]))
        assert not matches(free_array, json.dumps([nested(MAX_ANY_DEPTH, kind)]))
    with_property = {"type": "object", "properties": {"p": {}}, "additionalProperties": True}
    assert matches(with_property, json.dumps({"p": nested(MAX_ANY_DEPTH, kind), "q": nested(MAX_ANY_DEPTH, kind)}))


def test_whitespace_is_bounded_and_never_outside_the_value() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    for run in (" " * MAX_WHITESPACE, "\t\n\r ", ""):
        text = f"{{{run}\"a\"{run}:{run}[{run}1{run},{run}2{run}]{run}}}"
        assert matches(schema, text), text
        assert matches(schema, f"{{{run}}}")
    too_long = " " * (MAX_WHITESPACE + 1)
    assert not matches(schema, f'{{"a":[1,{too_long}2]}}')
    assert not matches(schema, f"{{{too_long}}}")
    for text in (' {"a":[]}', '{"a":[]} ', '\n{"a":[]}', '{"a":[1 2]}', '{"a":[1]\f}'):
        assert not matches(schema, text), text
    assert not matches(schema, '{"a": []}', any_whitespace=False)
    assert matches({"type": "string"}, '" a  b "', any_whitespace=False)


def test_string_length_counts_characters_and_escapes_as_one() -> None:
    """Code points, as JSON Schema and pydantic count them: a character, an escape and a
    surrogate pair of escapes are one each."""
    schema = {"type": "string", "minLength": 2, "maxLength": 4}
    for content in ("ab", "é\n\"\\", "\u4e2d\u6587", "a\u0001", "😀𝄞", "😀😀😀😀", "a\U0010ffff"):
        for text in (json.dumps(content), json.dumps(content, ensure_ascii=False)):
            assert matches(schema, text), text
            assert 2 <= len(json.loads(text)) <= 4
    assert matches(schema, '"\\/\\b"') and matches(schema, '"\\uABCD\\u00e9"')
    assert matches(schema, '"\\ud83d\\ude00\\uD834\\uDD1E\\uDBFF\\uDFFF\\ud800\\udc00"')  # four pairs
    for text in ('"a"', '"abcde"', '"\\u00e9\\n\\t\\"\\\\"', '"\\x"', '"\\u12"', '"a\tb"', '"\\ud83d\\ude00"',
                 json.dumps("😀" * 5), json.dumps("😀" * 5, ensure_ascii=False)):
        assert not matches(schema, text), text


def test_surrogate_escapes_only_as_pairs() -> None:
    """Every `\\uXXXX` alone (both cases of hex letters) matches exactly when it is no
    surrogate, and after a high surrogate escape exactly a low one does: in Python's re and
    in the engine's automaton; lone ones are what jiter refuses and json.loads reads."""
    single = re.compile(json_schema_regex({"type": "string", "maxLength": 1}), re.ASCII)
    string = json_schema_regex({"type": "string"})
    any_string = compile_regex(string)
    units = range(0x10000)
    for spell in ("\\u%04x", "\\u%04X"):
        assert [single.fullmatch(f'"{spell % u}"') is not None for u in units] == [
            not 0xD800 <= u <= 0xDFFF for u in units]
        for high in (0xD800, 0xDA12, 0xDBFF):
            assert [single.fullmatch(f'"{spell % high}{spell % u}"') is not None for u in units] == [
                0xDC00 <= u <= 0xDFFF for u in units]
    rng = random.Random(8)
    for _ in range(500):
        text = '"' + "".join(rng.choice(["a", "\\ud83d", "\\ude00", "\\uDBFF", "\\udfff", "\\u0041", "\\n", "é"])
                             for _ in range(rng.randint(1, 5))) + '"'
        try:
            pydantic_core.from_json(text)
            strict = True
        except ValueError:
            strict = False
        lone = any(0xD800 <= ord(c) <= 0xDFFF for c in json.loads(text))
        assert lone != strict, text  # (json.loads reads a lone one, jiter refuses exactly those)
        assert (re.fullmatch(string, text, re.ASCII) is not None) == strict, text
        assert any_string.is_accepting(any_string.walk(any_string.start, text.encode())) == strict, text
    for schema in ({"type": "object", "additionalProperties": True}, {}):  # keys and free values too
        assert matches(schema, '{"\\ud83d\\ude00":"\\uD800\\uDC00"}')
        assert not matches(schema, '{"\\ud83d":1}') and not matches(schema, '{"a":["\\ude00"]}')


class Address(pydantic.BaseModel):
    street: str
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")
    country: Optional[str] = None


class Event(pydantic.BaseModel):
    """A pydantic model of the kinds a user's schema has: formats, bounds, lengths, a
    nested model by `$ref`, optional fields (anyOf with null), a map, a literal."""
    id: uuid.UUID
    title: str = pydantic.Field(min_length=1, max_length=8)
    starts: datetime.datetime
    day: datetime.date
    at: datetime.time
    host: ipaddress.IPv4Address
    tags: list[str] = pydantic.Field(max_length=3)
    seats: int = pydantic.Field(ge=0, le=1000)
    price: float = pydantic.Field(gt=0, le=99.5)
    score: float
    public: bool
    note: Optional[str] = None
    address: Address
    extra: dict[str, int] = {}
    kind: Literal["talk", "workshop"]


def test_random_texts_of_pydantic_schemas_validate_with_pydantic() -> None:
    """Thousands of texts from seeded random walks through the engine's automaton of a
    pydantic model's own JSON schema: `model_validate_json` accepts each one (lax and
    strict), and EmailStr too where email-validator is installed."""
    models: list[type[pydantic.BaseModel]] = [Event, Address]
    if importlib.util.find_spec("email_validator") is not None:  # (EmailStr needs it)
        models.append(pydantic.create_model("Contact", email=(pydantic.EmailStr, ...), alt=(list[pydantic.EmailStr], [])))
    pairs = 0
    for seed, model in enumerate(models):
        automaton = compile_regex(json_schema_regex(model.model_json_schema()))
        for text in random_texts(automaton, seed=seed, count=1500, stop=0.5, max_bytes=2000):
            for strict in (False, True):
                model.model_validate_json(text, strict=strict)
            pairs += re.search(r"\\u[dD][89abAB]", text) is not None
    assert pairs > 20  # (the walks do write surrogate pairs)


def test_lone_surrogates_in_keys_and_literals_are_refused() -> None:
    """A schema string (read from JSON with a lone surrogate escape) has no valid spelling."""
    for schema in ({"enum": ["ok", "\ud800"]}, {"const": "a\udc00"},
                   {"type": "object", "properties": {"\udbff": {}}},
                   {"type": "object", "required": ["\udfff"], "additionalProperties": True}):
        with pytest.raises(ValueError, match="json_schema: .*lone surrogate"):
            json_schema_regex(schema)
    assert matches({"enum": ["😀"]}, '"😀"') and not matches({"enum": ["😀"]}, '"\\ud83d\\ude00"')


def test_pattern_is_matched_against_the_raw_characters() -> None:
    schema = {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"}
    assert matches(schema, '"ABC-12"')
    for text in ('"ABC-123"', '"abc-12"', '"xABC-12"', "ABC-12"):
        assert not matches(schema, text), text
    literal_dollar = {"type": "string", "pattern": "a|b\\$"}  # an escaped `$` is kept
    assert matches(literal_dollar, '"b$"') and matches(literal_dollar, '"a"')
    assert not matches(literal_dollar, '"b"')


@pytest.mark.parametrize("lo, hi", [(-15, 7), (95, 1005), (-1000, -10), (0, 0), (-1, -1), (8, 12)])
def test_integer_ranges_crossing_signs_and_digit_counts(lo: int, hi: int) -> None:
    schema = {"type": "integer", "minimum": lo, "maximum": hi}
    for n in range(lo - 120, hi + 121):
        assert matches(schema, str(n)) == (lo <= n <= hi), n
    for text in ("-0", f"0{max(lo, 1)}", f"{lo}.0", "1e1"):
        assert not matches(schema, text), text


def test_exclusive_and_fractional_integer_bounds() -> None:
    schema = {"type": "integer", "exclusiveMinimum": -2.5, "maximum": 9.9, "exclusiveMaximum": 9}
    assert [n for n in range(-10, 20) if matches(schema, str(n))] == list(range(-2, 9))
    tighter = {"type": "integer", "minimum": 3, "exclusiveMinimum": 3}
    assert [n for n in range(-10, 20) if matches(tighter, str(n))] == list(range(4, 20))


def test_random_integer_ranges_property() -> None:
    rng = random.Random(1234)
    for _ in range(250):
        scale = 10 ** rng.randint(0, 6)
        lo, hi = sorted(rng.randint(-scale, scale) for _ in range(2))
        shape = rng.choice(["both", "min", "max"])
        schema = {"type": "integer"}
        if shape != "max":
            schema["minimum"] = lo
        if shape != "min":
            schema["maximum"] = hi
        regex = re.compile(json_schema_regex(schema), re.ASCII)
        points = set(range(lo - 25, lo + 25)) | set(range(hi - 25, hi + 25))
        points |= {rng.randint(-10 * scale - 10, 10 * scale + 10) for _ in range(60)}
        points |= {10**k + d for k in range(8) for d in (-1, 0)} | {-(10**k) - d for k in range(8) for d in (-1, 0)}
        points |= {s * (10**MAX_INTEGER_DIGITS + d) for s in (1, -1) for d in (-2, -1, 0, 1)}  # the cap
        for n in points:
            inside = (shape == "max" or n >= lo) and (shape == "min" or n <= hi) and abs(n) < 10**MAX_INTEGER_DIGITS
            assert (regex.fullmatch(str(n)) is not None) == inside, (schema, n)


# ---- bounded numbers ---------------------------------------------------------------------
# The documented form of a bounded "number": no exponent, no leading zeros, the digit caps.
BOUNDED_FORM = re.compile(rf"-?(?:0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})(?:\.[0-9]{{1,{MAX_FRACTION_DIGITS}}})?")
LOWER, UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")


def within(text: str, bounds: dict[str, str]) -> bool:
    """The oracle: `text` is in the bounded form within the digit caps, is not a `-` before
    a zero value, and its exact value meets every bound (given as the decimal text of the
    JSON number)."""
    if BOUNDED_FORM.fullmatch(text) is None:
        return False
    value = Decimal(text)
    if text.startswith("-") and value == 0:
        return False
    meets = {"minimum": value.__ge__, "exclusiveMinimum": value.__gt__,
             "maximum": value.__le__, "exclusiveMaximum": value.__lt__}
    return all(meets[keyword](Decimal(bound)) for keyword, bound in bounds.items())


def no_value_within(bounds: dict[str, str]) -> bool:
    """Whether some lower bound is above some upper bound (or equal, one excluding it)."""
    return any(Decimal(bounds[low]) > Decimal(bounds[high]) or Decimal(bounds[low]) == Decimal(bounds[high])
               and "exclusive" in low + high
               for low in LOWER if low in bounds for high in UPPER if high in bounds)


def bounded(bounds: dict[str, str], **schema: object) -> dict:
    """A "number" schema with the bounds as a client sends them: JSON numbers, parsed."""
    return {"type": "number", **schema, **{k: json.loads(v) for k, v in bounds.items()}}


def random_decimal_text(rng: random.Random) -> str:
    """A JSON number text without exponent: integral, with a fraction, small, a classic, or
    a float's full 17 digits (written out, past the fraction cap when it is small)."""
    sign = rng.choice(["", "-"])
    kind = rng.choice(["integer", "fraction", "small", "classic", "integer", "fraction", "small", "classic", "long"])
    if kind == "long":  # (the shortest repr of a float, so the bound a client sends)
        return sign + format(Decimal(repr(rng.random() * 10.0 ** rng.randint(-7, 3))), "f")
    if kind == "integer":
        return sign + str(rng.randint(0, 10 ** rng.randint(0, 4)))
    if kind == "fraction":
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))
        return f"{sign}{rng.randint(0, 10 ** rng.randint(0, 3))}.{digits}"
    if kind == "small":
        return f"{sign}0.{'0' * rng.randint(0, 5)}{rng.randint(1, 999)}"
    return sign + rng.choice(["0", "0.0", "1", "9", "10", "0.5", "0.1", "0.9", "99.99", "100.5", "273.15"])


def spellings(value: Decimal) -> list[str]:
    """`value` written out plainly, with extra trailing zeros, and with a `-` if it is zero."""
    text = format(value, "f")
    texts = [text, text + ("0" if "." in text else ".0"), text + ("000" if "." in text else ".000")]
    return texts + ["-" + t for t in texts if value == 0 and not t.startswith("-")]


PRECISE = decimal.Context(prec=100)
TOP = 10**MAX_INTEGER_DIGITS
AT_THE_CAP = {text for magnitude in (str(TOP - 1), str(TOP), f"{TOP - 1}.{'9' * MAX_FRACTION_DIGITS}", f"{TOP}.0",
                                     f"0.{'0' * (MAX_FRACTION_DIGITS - 1)}1", f"0.{'0' * MAX_FRACTION_DIGITS}1",
                                     f"0.{'0' * MAX_FRACTION_DIGITS}", f"1.{'0' * MAX_FRACTION_DIGITS}")
              for text in (magnitude, "-" + magnitude)}
ALWAYS_TRIED = ["0", "-0", "0.0", "-0.0", "0.000", "-0.000", "1", "-1", "0.001", "-0.001", "0.5", "-0.5",
                # exponents: never in the bounded form
                "1e2", "1E-1", "0e0", "-1.5e0", "1e+0", "5E0", "0.0e0",
                # leading zeros, and texts that are no JSON number
                "00", "01", "-01.5", "00.5", "007", "-00", "1.", ".5", "+1", "", "-", "1.2.3", " 1", "1 "]


def candidates(rng: random.Random, bounds: dict[str, str]) -> set[str]:
    """Texts at, just beside and far from the bounds, plus the fixed tricky ones."""
    texts = set(ALWAYS_TRIED) | AT_THE_CAP
    ulp = Decimal(10) ** -MAX_FRACTION_DIGITS  # the finest step a text within the caps takes
    for bound in bounds.values():
        value = Decimal(bound)
        texts.add(bound)
        texts.add(f"{bound}e0")
        for step in (0, 1, Decimal("0.1"), Decimal("0.01"), Decimal("0.001"), Decimal("1e-7"), ulp, ulp / 10):
            for near in (value - step, value + step):
                texts.update(spellings(near))
        truncated = value.quantize(ulp, rounding=decimal.ROUND_DOWN, context=PRECISE)  # at the fraction cap
        for near in (truncated - ulp, truncated, truncated + ulp):
            texts.update(spellings(near))
        texts.update(spellings(value.to_integral_value()))
        texts.update(spellings(value.to_integral_value() + 1))
    for _ in range(25):
        text = random_decimal_text(rng)
        texts.update((text, text + ("0" * rng.randint(1, 3) if "." in text else ".0")))
    return texts


def test_random_number_bounds_property() -> None:
    rng = random.Random(20240611)
    tried = empty = 0
    for _ in range(400):
        lower = rng.choice([(), ("minimum",), ("exclusiveMinimum",), LOWER])
        upper = rng.choice([(), ("maximum",), ("exclusiveMaximum",), UPPER])
        bounds = {keyword: random_decimal_text(rng) for keyword in lower + upper}
        if not bounds:
            continue
        if rng.random() < 0.15 and lower and upper:  # a single point, at times excluded
            bounds[upper[0]] = bounds[lower[0]]
        for pair in (lower, upper):  # an inclusive and an exclusive bound at one value
            if len(pair) == 2 and rng.random() < 0.3:
                bounds[pair[1]] = bounds[pair[0]]
        schema = bounded(bounds)
        if no_value_within(bounds):
            empty += 1
            with pytest.raises(ValueError, match=r"^json_schema: the bounds at \$ leave no number"):
                json_schema_regex(schema)
            continue
        regex = re.compile(json_schema_regex(schema), re.ASCII)
        for text in candidates(rng, bounds):
            tried += 1
            assert (regex.fullmatch(text) is not None) == within(text, bounds), (bounds, text)
    assert tried > 30_000 and empty > 10, (tried, empty)


def test_bounded_number_examples() -> None:
    examples = [  # (bounds, texts that match, texts that do not)
        ({"exclusiveMinimum": 0}, ["0.001", "1", "0.0000001", "12.50", "1000000"],
         ["0", "0.0", "0.000", "-0", "-0.0", "-0.001", "1e-3", "1E2", "01"]),
        ({"minimum": 0, "maximum": 1}, ["0", "0.0", "1", "1.000", "0.999999", "0.5"],
         ["-0", "-0.0", "1.0001", "1.0000001", "2", "10", "-0.5", ".5", "1e0"]),
        ({"maximum": 100.5}, ["100.5", "100.50", "-1000000", "100.49999", "99.99", "-0.5", "0"],
         ["100.51", "100.500001", "101", "1000", "1e2", "-0"]),
        # 0.1 is 1/10 (the float is above it), 1e-3 is 1/1000
        ({"minimum": 0.1}, ["0.1", "0.10", "0.10000000000000000001", "7"],
         ["0.09999999999999999999", "0.09", "0.1000000000000000000001"]),  # (the last past the fraction cap)
        ({"exclusiveMaximum": 1e-3}, ["0.000999", "0.0009999999999", "-5", "0"], ["0.001", "0.0010", "0.0011"]),
        ({"minimum": -2.5, "exclusiveMinimum": -2.5}, ["-2.49", "0"], ["-2.5", "-2.50", "-3"]),  # the tighter
        ({"minimum": 3, "exclusiveMinimum": 2}, ["3", "3.0", "4"], ["2.5", "2.999"]),
        ({"maximum": 7.25, "exclusiveMaximum": 7.25}, ["7.249", "-7.25"], ["7.25", "7.250"]),
        ({"maximum": 7, "exclusiveMaximum": 8}, ["7", "7.0"], ["7.5", "7.001"]),
        ({"minimum": 5, "maximum": 5}, ["5", "5.0", "5.000"], ["5.001", "4.999", "5e0", "50"]),
        ({"minimum": -0.0, "maximum": 0}, ["0", "0.00"], ["-0", "-0.0", "0.001", "-0.001"]),
        ({"exclusiveMinimum": -1, "exclusiveMaximum": 0}, ["-0.5", "-0.999", "-0.0001"], ["0", "-0", "-1", "-1.0"]),
    ]
    for bounds, good, bad in examples:
        schema = {"type": "number", **bounds}
        for text in good:
            assert matches(schema, text), (bounds, text)
        for text in bad:
            assert not matches(schema, text), (bounds, text)
    assert matches({"minimum": 0}, "1.5") and not matches({"minimum": 0}, "-1.5")  # "number" inferred
    for text in ("1e2", "-0", "-0.0", "1.5E-3"):  # no bound: any JSON number within the caps
        assert matches({"type": "number"}, text), text


def test_empty_number_range_names_its_path() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}}}
    with pytest.raises(ValueError, match=r"^json_schema: the bounds at \$\.properties\.x leave no number"):
        json_schema_regex(schema)


@pytest.mark.parametrize("bounds", [
    {"minimum": "0"}, {"exclusiveMinimum": "0"}, {"minimum": "0", "maximum": "1"}, {"maximum": "100.5"},
    {"exclusiveMinimum": "-273.15", "exclusiveMaximum": "10000"}, {"minimum": "0.1", "maximum": "0.30000000000000004"},
    {"minimum": "-0.001", "exclusiveMaximum": "0"}, {"minimum": "12.345", "maximum": "12.35"},
])
def test_bounded_number_regex_compiles_for_the_engine(bounds: dict[str, str]) -> None:
    automaton = compile_regex(json_schema_regex(bounded(bounds)))
    for text in candidates(random.Random(7), bounds):
        accepted = automaton.is_accepting(automaton.walk(automaton.start, text.encode()))
        assert accepted == within(text, bounds), (bounds, text)


def test_bounded_number_regex_size_is_bounded_by_the_caps() -> None:
    def size(low: object, high: object) -> int:
        regex = json_schema_regex({"type": "number", "minimum": low, "maximum": high})
        compile_regex(regex)  # within the engine's state and nesting budgets
        return len(regex)

    # Bounds are clipped to the integer cap and truncated to the fraction cap first, so no
    # bound, however many digits it has, makes a regex larger than the caps do.
    floats = [size(-1.2345678901234567 * 10.0**e, 9.876543210987654 * 10.0**e) for e in range(-300, 301, 25)]
    integers = [size(int("7" * digits), int("8" * digits) + 7) for digits in (5, 10, MAX_INTEGER_DIGITS - 1)]
    huge = [size(-int("7" * digits), int("8" * digits)) for digits in (30, 300, 4000)]
    assert max(floats + integers + huge) < 2_000, (floats, integers, huge)
    assert all(later < 2.2 * earlier for earlier, later in zip(integers, integers[1:])), integers  # linear
    assert len(set(huge)) == 1  # (all clipped to the same range)


# ---- digit caps ----------------------------------------------------------------------------
def in_place(schema: dict, where: str, text: str) -> tuple[dict, str]:
    """`schema` as a value alone, as array items, or as an object's property."""
    if where == "alone":
        return schema, text
    if where == "items":
        return {"type": "array", "items": schema}, f"[{text}, {text}]"
    return {"type": "object", "properties": {"n": schema}, "required": ["n"]}, f'{{"n": {text}}}'


@pytest.mark.parametrize("where", ["alone", "items", "property"])
def test_unbounded_numbers_stay_within_the_digit_caps(where: str) -> None:
    """Texts at each cap match, one digit past it does not (`1e400` and `9e99999999`, which
    json.loads makes inf, among them): for "number", for any value (`{}` and free
    containers), and for "integer" without and with a half-open range."""
    free = {"alone": {}, "items": {"type": "array"}, "property": {"type": "object"}}[where]
    numbers = [{"type": "number"}, {"type": ["number", "null"]}, {"anyOf": [{"type": "number"}, {"type": "string"}]}]
    for text, capped in AT_THE_CAPS:
        for schema in numbers:
            assert matches(*in_place(schema, where, text)) == capped, (schema, text)
        free_text = {"alone": text, "items": f"[{text}]", "property": f'{{"n": {text}}}'}[where]
        assert matches(free, free_text) == capped, free_text
        is_integer = capped and "." not in text and "e" not in text.lower() and text != "-0"
        assert matches(*in_place({"type": "integer"}, where, text)) == is_integer, text
        half_open = {"type": "integer", "minimum": 0}
        assert matches(*in_place(half_open, where, text)) == (is_integer and not text.startswith("-")), text
        half_open = {"type": "number", "maximum": 0}
        assert matches(*in_place(half_open, where, text)) == within(text, {"maximum": "0"}), text


def test_integer_bounds_past_the_cap_are_clipped() -> None:
    top = 10**MAX_INTEGER_DIGITS - 1
    for schema, inside, outside in [
        ({"minimum": 0}, [0, 1, top], [-1, top + 1, 10**30]),
        ({"exclusiveMaximum": -7}, [-8, -top], [-7, 0, -top - 1]),
        ({"minimum": -1e30, "maximum": 1e30}, [top, -top, 0], [top + 1, -top - 1]),
        ({"minimum": top - 1, "maximum": 10**400}, [top - 1, top], [top - 2, top + 1]),
        ({"maximum": 1.5e300}, [top, -top], [top + 1, -top - 1]),
    ]:
        schema = {"type": "integer", **schema}
        for n in inside:
            assert matches(schema, str(n)), (schema, n)
        for n in outside:
            assert not matches(schema, str(n)), (schema, n)
    for schema in ({"type": "integer", "minimum": top + 1}, {"type": "integer", "maximum": -1e20},
                   {"type": "integer", "exclusiveMinimum": top}):
        with pytest.raises(ValueError, match=rf"^json_schema: the bounds at \$ leave no integer of at most "
                                             rf"{MAX_INTEGER_DIGITS} digits"):
            json_schema_regex(schema)


def test_number_bounds_past_the_caps() -> None:
    """Bounds past the integer cap clip the range; bounds with more fraction digits than the
    cap are never crossed; a range that no text within the caps reaches raises."""
    top = 10**MAX_INTEGER_DIGITS
    assert matches({"type": "number", "minimum": -1e300}, f"-{top - 1}.{'9' * MAX_FRACTION_DIGITS}")
    assert not matches({"type": "number", "minimum": -1e300}, f"-{top}")
    assert not matches({"type": "number", "maximum": 1e300}, f"{top}.0")
    tiny = {"type": "number", "exclusiveMinimum": 1.2345678901234567e-05}  # 0.000012345678901234567: 21 digits
    assert matches(tiny, "0.00001234567890123457") and matches(tiny, "1")
    assert not matches(tiny, "0.00001234567890123456") and not matches(tiny, "0.000012345678901234567")
    for schema in ({"type": "number", "minimum": 1e-30, "maximum": 2e-30}, {"type": "number", "minimum": 1e20},
                   {"type": "number", "exclusiveMaximum": -1e25}, {"minimum": 1.2345678901234567e-05,
                                                                   "maximum": 1.2345678901234568e-05}):
        with pytest.raises(ValueError, match=r"^json_schema: the bounds at \$ leave no number of at most "):
            json_schema_regex(schema)


class Reading(pydantic.BaseModel):
    """Numbers as tool arguments have them: free, bounded, half-open, integral, nested."""
    model_config = pydantic.ConfigDict(allow_inf_nan=False)
    value: float
    finite: pydantic.FiniteFloat
    count: int
    positive: pydantic.PositiveFloat
    ratio: float = pydantic.Field(ge=0, le=1)
    kelvin: float = pydantic.Field(gt=-273.15)
    seats: pydantic.NonNegativeInt
    samples: list[float] = pydantic.Field(max_length=3)
    extra: dict[str, Any]


NUMBER_SCHEMAS = [
    {"type": "number"}, {"type": "integer"}, {"type": "integer", "minimum": 0}, {"type": "integer", "exclusiveMaximum": -3},
    {"type": "number", "minimum": 0}, {"type": "number", "exclusiveMinimum": 0}, {"type": "number", "maximum": -273.15},
    {"type": "number", "exclusiveMinimum": 1.2345678901234567e-05}, {"type": "number", "minimum": -1e300, "maximum": 1e300},
    {"type": "number", "exclusiveMinimum": 0.1, "maximum": 0.30000000000000004}, {},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3}, Reading.model_json_schema(),
]


@pytest.mark.parametrize("index", range(len(NUMBER_SCHEMAS)))
def test_greedy_walks_write_only_numbers_consumers_read_exactly(index: int) -> None:
    """Random walks through the engine's automaton that favour digits, as greedy decoding
    may: every number they write is within the caps, a finite float to json.loads, jiter and
    pydantic (an integer exact), and within the schema's bounds; the walks reach the caps."""
    schema = NUMBER_SCHEMAS[index]
    automaton = compile_regex(json_schema_regex(schema))
    bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema}
    longest = {"whole": 0, "fraction": 0, "exponent": 0}
    for text in greedy_walks(automaton, seed=index, count=300, max_bytes=400):
        for number in numbers_in(text):
            check_number(number)
            longest = {part: max(longest[part], len(digits)) for part, digits in zip(longest, parts(number))}
        if bounds:
            assert within(text, {k: repr(v) for k, v in bounds.items()}), (schema, text)
        if schema is NUMBER_SCHEMAS[-1]:
            Reading.model_validate_json(text, strict=True)
    if len(bounds) < 2 or max(abs(v) for v in bounds.values()) >= 10**MAX_INTEGER_DIGITS:  # (a side open)
        assert longest["whole"] == MAX_INTEGER_DIGITS, longest
    if "number" in json.dumps(schema) or not schema:
        assert longest["fraction"] == MAX_FRACTION_DIGITS, longest
    if not bounds and schema.get("type") != "integer":
        assert longest["exponent"] == MAX_EXPONENT_DIGITS, longest


def test_regex_sizes_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(json_schema_regex({})) < 33_000  # (32k: strings spell surrogate pairs, numbers their caps)
    sizes = []
    for depth in range(MAX_ANY_DEPTH + 1):
        monkeypatch.setattr(json_schema, "MAX_ANY_DEPTH", depth)
        sizes.append(len(json_schema_regex({})))
    # Each level holds the one below four times (an object's first and further values, and
    # an array's), plus a fixed frame.
    assert all(later <= 4 * earlier + 1_000 for earlier, later in zip(sizes, sizes[1:])), sizes

    def optional_properties(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    thirty, sixty = len(json_schema_regex(optional_properties(30))), len(json_schema_regex(optional_properties(60)))
    assert thirty < 6_000 and sixty < 2.1 * thirty, (thirty, sixty)  # linear in the properties
    every_subset = json.dumps({f"p{i}": i for i in range(0, 30, 3)})
    assert matches(optional_properties(30), every_subset)


@pytest.mark.parametrize("schema, keyword, path", [
    ({"type": "integer", "multipleOf": 3}, "multipleOf", "$"),
    ({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}, "multipleOf",
     "$.properties.age"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems", "$"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties", "$"),
    ({"not": {"type": "null"}}, "not", "$"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if", "$"),
    ({"type": "object", "properties": {"a": {"type": "object", "minProperties": 1}}}, "minProperties",
     "$.properties.a"),
    ({"type": "array", "items": {"type": "array", "contains": {}}}, "contains", "$.items"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "$"),
    ({"anyOf": [{"type": "string"}, {"type": "number", "minimum": 0, "multipleOf": 0.5}]}, "multipleOf",
     "$.anyOf[1]"),
    ({"type": "string", "format": "hostname"}, "format", "$"),
    ({"type": "string", "nullable": True}, "nullable", "$"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf", "$"),
    ({"$ref": "https://example.com/schema"}, "$ref", "$"),
    ({"properties": {"a": {"$ref": "#/$defs/A", "description": "d", "minimum": 1}}, "$defs": {"A": {}}},
     "minimum", "$.properties.a"),
    ({"$defs": {"A": {"type": "integer", "exclusiveMinimum": True}}, "$ref": "#/$defs/A"}, "exclusiveMinimum",
     "$.$defs.A"),
    ({"type": "array", "prefixItems": [{}, {"oneOf": [{"type": "string", "pattern": "a", "maxLength": 2}]}]},
     "maxLength", "$.prefixItems[1].oneOf[0]"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength", "$"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "b", "$"),
])
def test_unsupported_keywords_name_keyword_and_path(schema: dict, keyword: str, path: str) -> None:
    with pytest.raises(ValueError) as error:
        json_schema_regex(schema)
    message = str(error.value)
    assert message.startswith("json_schema: ") and repr(keyword) in message, message
    assert re.search(rf"at {re.escape(path)}( |$)", message), message


@pytest.mark.parametrize("schema", [
    None, [], "string", 1, False, {"type": "foo"}, {"type": []}, {"enum": []}, {"enum": "a"},
    {"required": "a", "properties": {"a": {}}}, {"properties": {"a": {}}, "required": [1]},
    {"properties": []}, {"type": "string", "minLength": -1}, {"type": "array", "maxItems": 1.5},
    {"type": "integer", "minimum": 5, "maximum": 4}, {"type": "integer", "maximum": float("inf")},
    {"type": "number", "minimum": 0.5, "maximum": 0.25}, {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
    {"type": "number", "minimum": float("nan")}, {"type": "number", "maximum": "1"}, {"minimum": None},
    {"type": "string", "pattern": "(unclosed"}, {"$ref": "#/$defs/Missing"}, {"items": [{}]},
    {"type": "array", "prefixItems": [{}, {}], "maxItems": 1}, {"type": "array", "prefixItems": [{}], "minItems": 2},
    {"type": "string", "enum": [1, 2]}, {"enum": [1, 2], "const": 3}, {"const": float("nan")},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
])
def test_malformed_or_unsatisfiable_schemas_raise(schema: object) -> None:
    with pytest.raises(ValueError, match=r"^json_schema: "):
        json_schema_regex(schema)


def test_false_subschemas_and_cut_recursion_are_left_out_where_optional() -> None:
    schema = {"type": "object", "properties": {"a": False, "b": {"type": "integer"}},
              "additionalProperties": False, "$comment": "a can never appear"}
    assert matches(schema, '{"b":1}') and matches(schema, "{}")
    assert not matches(schema, '{"a":1,"b":1}')
    no_items = {"type": "array", "items": False}
    assert matches(no_items, "[ ]") and not matches(no_items, "[1]")
    unsatisfiable = {"type": "object", "properties": {"a": {"type": "array", "items": False, "minItems": 1}}}
    assert matches(unsatisfiable, "{}") and not matches(unsatisfiable, '{"a":[]}')
    either = {"anyOf": [False, {"type": "null"}]}
    assert matches(either, "null") and not matches(either, "1")


def test_what_only_annotates_is_ignored():
    """pydantic's discriminated unions, `json_schema_extra` keys, SecretStr and bytes: the
    same texts as without those keywords."""
    pet = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                     {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]}
    cases = [
        (dict(pet, discriminator={"propertyName": "kind", "mapping": {"cat": "#/a", "dog": "#/b"}}), pet),
        ({"type": "integer", "x-unit": "kg", "x-order": 3}, {"type": "integer"}),
        ({"type": "string", "format": "password", "writeOnly": True, "maxLength": 5},
         {"type": "string", "maxLength": 5}),
        ({"type": "string", "format": "binary", "contentMediaType": "image/png"}, {"type": "string"}),
    ]
    for annotated, plain in cases:
        assert json_schema_regex(annotated) == json_schema_regex(plain)
    assert re.fullmatch(json_schema_regex(cases[0][0]), '{"kind": "dog"}')
    with pytest.raises(ValueError, match="'y-unit' at \\$ is not supported"):
        json_schema_regex({"type": "integer", "y-unit": "kg"})  # (only `x-` keys are extensions)

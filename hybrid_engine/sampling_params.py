"""User-facing sampling parameters (vLLM-compatible names and defaults) and the one table
of their valid ranges.

`RANGES` is the only definition of what a numeric sampling field accepts: `SamplingParams`
checks it, and the HTTP server builds its request schema from it, so the library and the
server accept exactly the same values.
"""
import dataclasses
import json
import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

MAX_LOGPROBS = 20  # top alternatives per generated token (OpenAI's top_logprobs limit)
MAX_STOP_STRINGS = 16  # every stop string is searched for in each step's new text
TOP_K_OFF = -1  # vLLM's "no top-k" beside 0; SamplingParams keeps 0
# Seeds fill an int64 tensor (vLLM's range); the sampler's RNG is keyed by all 64 bits.
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1
# The sampler computes in float32: anything larger would turn into inf there.
FLOAT32_MAX = 3.4028234663852886e38


class ParameterError(ValueError):
    """Invalid request input: a ValueError that also names the field it is about (`param`),
    so the HTTP server can answer a 400 naming it. The message starts with the field name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        # Pickled with both arguments (an exception pickles only its message by default): the
        # server's engine process sends validation errors to the HTTP side.
        return type(self), (self.param, str(self))


def check_unicode(text: str, field: str) -> None:
    """ParameterError(field) if `text` is no valid Unicode text: a lone surrogate ("\ud800"),
    which JSON can escape, has no UTF-8 form, so no tokenizer or detokenized output can
    hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParameterError(field, f"{field} is not valid Unicode text: {exc.reason} at index {exc.start}") from None


@dataclass(frozen=True)
class Range:
    """The values of one numeric field: a `kind` (int or float) in [lo, hi], or (lo, hi]
    when `lo_open`; None means unbounded on that side. Floats must also be finite."""

    kind: type
    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False

    def __contains__(self, value: int | float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else str(self.lo)
        hi = "inf" if self.hi is None else str(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi is None else ']'}"


# field -> valid values. vLLM's ranges, plus the float32 and int64 limits the sampler has.
RANGES: dict[str, Range] = {
    "max_tokens": Range(int, lo=1),
    "temperature": Range(float, lo=0.0, hi=FLOAT32_MAX),
    "top_k": Range(int, lo=TOP_K_OFF),
    "top_p": Range(float, lo=0.0, hi=1.0, lo_open=True),
    "min_p": Range(float, lo=0.0, hi=1.0),
    "repetition_penalty": Range(float, lo=0.0, hi=FLOAT32_MAX, lo_open=True),
    "presence_penalty": Range(float, lo=-2.0, hi=2.0),
    "frequency_penalty": Range(float, lo=-2.0, hi=2.0),
    "seed": Range(int, lo=MIN_SEED, hi=MAX_SEED),
    "logprobs": Range(int, lo=0, hi=MAX_LOGPROBS),
}
# Ranged fields where None is a value of its own: no seed (derived), no logprobs.
_NULLABLE = frozenset({"seed", "logprobs"})


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's `StructuredOutputsParams`; set exactly one
    of `json`, `regex`, `choice`, `json_object`): the sampler only ever draws tokens that
    keep the output a prefix of a text the grammar accepts, and the request stops
    (finish_reason "stop") once the text is complete and nothing can follow it.

    - `json`: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
      against it (what is supported: `hybrid_engine/structured/json_schema.py`).
    - `regex`: the whole output matches it (`hybrid_engine/structured/regex.py`).
    - `choice`: the output is one of these strings.
    - `json_object`: the output is one JSON object, any content.
    - `disable_any_whitespace`: no whitespace between JSON tokens (json and json_object).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        field = "structured_outputs"
        kinds = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        if len(kinds) != 1:
            raise ParameterError(field, f"{field}: set exactly one of json, regex, choice, json_object "
                                        f"(got {', '.join(kinds) or 'none'})")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as error:
                raise ParameterError(f"{field}.json", f"{field}.json is not valid JSON: {error}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ParameterError(f"{field}.json", f"{field}.json must be a JSON schema (an object), "
                                                  f"got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ParameterError(f"{field}.regex", f"{field}.regex must be a string, got {self.regex!r}")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ParameterError(f"{field}.choice", f"{field}.choice must be a non-empty list of non-empty "
                                                        f"strings, got {self.choice!r}")
            self.choice = list(self.choice)
            for text in self.choice:
                check_unicode(text, f"{field}.choice")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ParameterError(f"{field}.{name}", f"{field}.{name} must be a bool, got {value!r}")

    @property
    def kind(self) -> str:
        """Which grammar is set: "json", "regex", "choice" or "json_object"."""
        if self.json_object is True:
            return "json_object"
        return next(name for name in ("json", "regex", "choice") if getattr(self, name) is not None)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StructuredOutputsParams":
        """Build from a dict (a request body's `structured_outputs`), rejecting unknown keys
        with a ParameterError naming them."""
        if not isinstance(values, dict):
            raise ParameterError("structured_outputs", f"structured_outputs must be an object, got {values!r}")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ParameterError(f"structured_outputs.{unknown[0]}",
                                 f"structured_outputs: unknown or unsupported field(s): {', '.join(unknown)}")
        return cls(**values)


@dataclass
class SamplingParams:
    """How to decode one request. Invalid values raise `ParameterError` (a ValueError)
    naming the field; numeric ranges are those of `RANGES`.

    temperature 0 is greedy; top_k 0 (or -1, as vLLM; kept as 0) / top_p 1 / min_p 0 /
    penalties 1, 0, 0 are "off".
    `seed` makes sampling reproducible per request: the noise for output token i is a pure
    function of (seed, i). `logprobs=n` returns the sampled token's logprob plus the top n.
    `structured_outputs` constrains the output to a grammar (`StructuredOutputsParams`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ParameterError("structured_outputs", "structured_outputs must be StructuredOutputsParams or a "
                                                           f"dict, got {type(self.structured_outputs).__name__}")
            self.structured_outputs = dataclasses.replace(self.structured_outputs)  # re-validated, a copy
        for name, valid in RANGES.items():
            value = getattr(self, name)
            if not (value is None and name in _NULLABLE):
                setattr(self, name, check_value(name, value, valid))
        if self.top_k == TOP_K_OFF:
            self.top_k = 0
        # Lists (or tuples) are copied: a caller's later edits of its own list never reach a request.
        if isinstance(self.stop, (str, list, tuple)):
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop is not None:
            if not (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)):
                raise ParameterError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ParameterError("stop", f"stop must have at most {MAX_STOP_STRINGS} strings, "
                                             f"got {len(self.stop)}")
            for text in self.stop:  # (one that is not text could never match the output)
                check_unicode(text, "stop")
            if "" in self.stop:  # (it would match before every token: vLLM refuses it too)
                raise ParameterError("stop", "stop cannot contain an empty string")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, (list, tuple))
            and all(is_integral(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be a list of non-negative ints, "
                                                   f"got {self.stop_token_ids!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a dict, rejecting unknown keys with a ParameterError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ParameterError(unknown[0], f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (what `from_dict` takes back)."""
        return asdict(self)


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value: Any) -> bool:
    """A Python or NumPy integer that is not a bool (a library caller's values may come
    from NumPy; JSON's never do, see `is_int`)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_value(name: str, value: Any, valid: Range) -> int | float:
    """`value` as field `name` stores it (a Python int for an integer field, a float for a
    number field; NumPy scalars are taken and converted), or a ParameterError naming `name`
    if it has the wrong type, is not finite, or is out of `valid`."""
    if valid.kind is int:
        if not is_integral(value):
            raise ParameterError(name, f"{name} must be an integer, got {value!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(name, f"{name} must be a number, got {value!r}")
    elif not isinstance(value, numbers.Integral) and not math.isfinite(value):
        raise ParameterError(name, f"{name} must be a finite number, got {value!r}")
    # Compared before any float() conversion: a huge int must fail here, not overflow.
    if value not in valid:
        raise ParameterError(name, f"{name} must be in {valid}, got {value!r}")
    return float(value) if valid.kind is float else value

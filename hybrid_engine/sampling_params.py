"""User-facing sampling parameters (vLLM-compatible names and defaults)."""
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class SamplingParams:
    """How to decode one request. Invalid values raise ValueError naming the field.

    temperature 0 is greedy; top_k 0 / top_p 1 / min_p 0 / penalties 1, 0, 0 are "off".
    `seed` makes sampling reproducible per request: the noise for output token i is a pure
    function of (seed, i). `logprobs=n` returns the sampled token's logprob plus the top n.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int(self, "max_tokens", lo=1)
        _check_float(self, "temperature", lo=0.0)
        _check_int(self, "top_k", lo=0)
        _check_float(self, "top_p", lo=0.0, lo_open=True, hi=1.0)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        _check_float(self, "repetition_penalty", lo=0.0, lo_open=True)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int(self, "seed", lo=0)
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0, hi=20)
        if self.stop is not None and not (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a dict, rejecting unknown keys with a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(p: SamplingParams, name: str, lo: int | None = None, hi: int | None = None) -> None:
    v = getattr(p, name)
    if not _is_int(v):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")


def _check_float(p: SamplingParams, name: str, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ValueError(f"{name} must be a number, got {v!r}")
    setattr(p, name, float(v))
    too_low = lo is not None and (v <= lo if lo_open else v < lo)
    if too_low or (hi is not None and v > hi):
        interval = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{name} must be in {interval}, got {v}")

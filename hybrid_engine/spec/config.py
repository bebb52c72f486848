"""`SpeculativeConfig`: the `speculative_config` argument of `LLM` / `--speculative-config`."""
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "proposer")
# Drafts per verify row: each costs a Mamba state copy per request and a verified position.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults when neither prompt-lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed. `method`:

    - "ngram": prompt lookup -- the tokens that followed the latest earlier occurrence of
      the context's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`);
    - "proposer": `proposer.propose(request_id, token_ids, num_tokens) -> list[int]`, any
      object of the caller's.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    proposer: Any = None

    @staticmethod
    def from_dict(value: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """Validate a `speculative_config` dict (ValueError naming the field)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "proposer", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        method = value.get("method")
        if method == "draft_model":
            raise ValueError("speculative_config.method 'draft_model' is not supported yet; use 'ngram' or 'proposer'")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        proposer = value.get("proposer")
        if method == "ngram":
            if proposer is not None:
                raise ValueError("speculative_config.proposer is only for method 'proposer'")
            lo, hi = (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP) if lo is None and hi is None else (lo or hi, hi or lo)
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(n) or n < 1:
                    raise ValueError(f"speculative_config.{name} must be a positive integer, got {n!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        else:
            if lo is not None or hi is not None:
                raise ValueError("speculative_config.prompt_lookup_min/max are only for method 'ngram'")
            if not callable(getattr(proposer, "propose", None)):
                raise ValueError("speculative_config.proposer must be an object with a propose(request_id, "
                                 "token_ids, num_tokens) method")
        return SpeculativeConfig(method, k, lo, hi, proposer)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""`SpeculativeConfig`: the `speculative_config` argument of `LLM` / `--speculative-config`."""
from dataclasses import dataclass
from typing import Any

from hybrid_engine.sampling_params import is_int

METHODS = ("ngram", "draft_model", "proposer")
# Drafts per verify row: each costs a Mamba state copy per request and a verified position.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults when neither prompt-lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed. `method`:

    - "ngram": prompt lookup -- the tokens that followed the latest earlier occurrence of
      the context's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`);
    - "draft_model": a second model (`model`: a checkpoint directory or "preset:NAME", with
      the target's vocabulary) samples the drafts with each request's own sampling
      parameters and noise (spec/draft_model.py);
    - "proposer": `proposer.propose(request_id, token_ids, num_tokens) -> list[int]`, any
      object of the caller's.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    proposer: Any = None
    model: str | None = None

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
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        proposer, model = value.get("proposer"), value.get("model")
        if model is not None and method != "draft_model":
            raise ValueError("speculative_config.model is only for method 'draft_model'")
        if proposer is not None and method != "proposer":
            raise ValueError("speculative_config.proposer is only for method 'proposer'")
        if method != "ngram" and (lo is not None or hi is not None):
            raise ValueError("speculative_config.prompt_lookup_min/max are only for method 'ngram'")
        if method == "ngram":
            # The values as given are checked before one bound defaults to the other, so the
            # error names the field that holds the bad value (and shows it, 0 included).
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if n is not None and (not is_int(n) or n < 1):
                    raise ValueError(f"speculative_config.{name} must be a positive integer, got {n!r}")
            # One bound given: the other takes its value; neither: vLLM's default for both.
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        elif method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config.model must be a checkpoint directory or 'preset:NAME', "
                                 f"got {model!r}")
        elif not callable(getattr(proposer, "propose", None)):
            raise ValueError("speculative_config.proposer must be an object with a propose(request_id, "
                             "token_ids, num_tokens) method")
        return SpeculativeConfig(method, k, lo, hi, proposer, model)

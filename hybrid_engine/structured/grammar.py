"""Structured outputs for the engine: compiled grammars (shared, cached) and each
request's place in its grammar.

A request's `StructuredOutputsParams` compile to a `ByteAutomaton` once per distinct
grammar (`GrammarCompiler`, least recently used dropped); the automaton keeps the token
mask of every state it has reached, so requests with the same schema share both the
states and the masks. A request holds a `GrammarState`: the automaton state its output
has reached, advanced token by token as the scheduler retires them.

Where the engine uses it: the scheduler keeps a constrained request out of launch-ahead
steps while its previous token is still on the device (its next mask depends on that
token), the runner copies the request's mask into the step buffer, and the sampler sets
every other token's logit to -inf (`hybrid_engine/sampling.py`, `apply_token_masks`).
"""
import json
from collections import OrderedDict

import numpy as np

from hybrid_engine.sampling_params import ParameterError, StructuredOutputsParams
from hybrid_engine.structured.automaton import DEAD, ByteAutomaton, GrammarTooLarge
from hybrid_engine.structured.json_any import JsonAutomaton
from hybrid_engine.structured.json_schema import json_schema_regex
from hybrid_engine.structured.regex import compile_regex
from hybrid_engine.structured.vocabulary import TokenVocabulary

# Distinct grammars kept compiled, and the masks each keeps (vocab_size / 8 bytes each). A
# grammar's transition table holds at most `MAX_STATES` rows of 1 KiB, so the worst case
# is ~100 MiB per grammar at a 128k vocabulary; typical schemas reach a few hundred states.
MAX_GRAMMARS = 16
MAX_MASKS_PER_GRAMMAR = 2048
_REGEX_SPECIAL = set("\\.^$*+?{}[]()|-/")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (each taken literally)."""
    return "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice) for choice in choices)


class CompiledGrammar:
    """One grammar's automaton over the vocabulary, with the token masks of the states
    reached so far (packed bits, token id t at bit t % 8 of byte t // 8)."""

    def __init__(self, automaton: ByteAutomaton, vocabulary: TokenVocabulary):
        self.automaton, self.vocabulary = automaton, vocabulary
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        # Set once the automaton ran out of states: the compiler then starts new requests on
        # a fresh copy (the requests that reached the limit have failed; others go on).
        self.exhausted = False

    def mask(self, state: int) -> np.ndarray:
        """The tokens (EOS aside) that keep the output alive from `state`, packed."""
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        vocab = self.vocabulary
        try:
            ends = self.automaton.walk_tokens(state, vocab.token_bytes, vocab.lengths)
        except GrammarTooLarge:
            self.exhausted = True
            raise
        allowed = np.zeros(vocab.mask_bytes * 8, dtype=bool)
        allowed[vocab.token_ids[ends != DEAD]] = True
        mask = np.packbits(allowed, bitorder="little")
        self._masks[state] = mask
        if len(self._masks) > MAX_MASKS_PER_GRAMMAR:
            self._masks.popitem(last=False)
        return mask


class GrammarState:
    """Where one request's output stands in its grammar."""

    def __init__(self, grammar: CompiledGrammar, eos_token_ids: frozenset[int]):
        self.grammar = grammar
        self.state = grammar.automaton.start
        self._eos = sorted(t for t in eos_token_ids if t < grammar.vocabulary.vocab_size)
        self._check_continuable()

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a whole text of the grammar."""
        return self.grammar.automaton.is_accepting(self.state)

    @property
    def terminated(self) -> bool:
        """Whether the output is whole and nothing may follow it: the request is done."""
        return self.accepting and not self.grammar.automaton.can_continue(self.state)

    def write_mask(self, out: np.ndarray) -> None:
        """The tokens the next sample may take, packed into `out` (uint8, vocab_size / 8):
        the grammar's, plus EOS where the output is whole."""
        out[:] = self.grammar.mask(self.state)
        if self._eos and self.accepting:
            for token in self._eos:
                out[token >> 3] |= np.uint8(1 << (token & 7))

    def advance(self, token_id: int) -> None:
        """Take a sampled token (not a stop token). Raises ValueError if the grammar cannot
        go on from the new state with any token (no mask would allow a sample)."""
        data = self.grammar.vocabulary.bytes_of.get(token_id)
        nxt = DEAD if data is None else self.grammar.automaton.walk(self.state, data)
        if nxt == DEAD:
            raise ValueError(f"structured output: token {token_id} is not allowed by the grammar here")
        self.state = nxt
        self._check_continuable()

    def _check_continuable(self) -> None:
        # The mask is made here, in the scheduler's handling of this one request, and never
        # first in the runner: making it can grow the automaton past its limit, which must
        # fail this request alone, not the step.
        mask = self.grammar.mask(self.state)
        if not (self.terminated or (self._eos and self.accepting) or mask.any()):
            raise ValueError("structured output: no token of the vocabulary can continue the grammar here")


_CHECKED: OrderedDict[str, None] = OrderedDict()  # grammars `check_grammar` has compiled (keys)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ParameterError naming the field if `params`' grammar cannot be compiled (an
    unsupported schema keyword, a malformed regex); no vocabulary needed. For a front end
    that answers such errors before handing the request on (the HTTP server)."""
    key, _ = _key(params)
    if key in _CHECKED:
        return
    _compile(params)
    _CHECKED[key] = None
    if len(_CHECKED) > MAX_GRAMMARS:
        _CHECKED.popitem(last=False)


class GrammarCompiler:
    """Compiles requests' structured-output params against one model's vocabulary,
    keeping the last `MAX_GRAMMARS` distinct grammars (a repeated schema compiles once)."""

    def __init__(self, vocabulary: TokenVocabulary):
        self.vocabulary = vocabulary
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def start(self, params: StructuredOutputsParams, eos_token_ids: frozenset[int]) -> GrammarState:
        """A request's grammar state at its first output token. Raises ParameterError
        naming the field for a grammar that cannot be compiled or that no token of the
        vocabulary can start."""
        key, field = _key(params)
        grammar = self._grammars.get(key)
        if grammar is None or grammar.exhausted:
            grammar = CompiledGrammar(_compile(params), self.vocabulary)
            self._grammars[key] = grammar
            if len(self._grammars) > MAX_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        try:
            return GrammarState(grammar, eos_token_ids)
        except ValueError as error:
            raise ParameterError(field, f"{field}: {error}") from None


def _key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(cache key, the field a compile error names) of a request's grammar."""
    field = f"structured_outputs.{params.kind}"
    # (Not sorted: the order of a schema's properties is the order its output follows.)
    return json.dumps([field, getattr(params, params.kind), params.disable_any_whitespace]), field


def _compile(params: StructuredOutputsParams) -> ByteAutomaton:
    """The grammar's automaton; ParameterError naming the field if it cannot be compiled or
    accepts only the empty output (a request samples at least one token)."""
    field = f"structured_outputs.{params.kind}"
    try:
        automaton = _automaton(params)
    except ValueError as error:
        raise ParameterError(field, f"{field}: {error}") from None
    start = automaton.start
    if automaton.is_accepting(start) and not automaton.can_continue(start):
        raise ParameterError(field, f"{field}: the grammar accepts only the empty output")
    return automaton


def _automaton(params: StructuredOutputsParams) -> ByteAutomaton:
    any_whitespace = not params.disable_any_whitespace
    if params.json_object:
        return JsonAutomaton(top_level_object=True, any_whitespace=any_whitespace)
    if params.json is not None:
        return compile_regex(json_schema_regex(params.json, any_whitespace=any_whitespace))
    if params.regex is not None:
        return compile_regex(params.regex)
    return compile_regex(choice_regex(params.choice))

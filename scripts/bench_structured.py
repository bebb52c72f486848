"""Host cost of structured outputs: how long the grammar compiler and the token masks take
(docs/structured_outputs.md, "Cost"). CPU only; no model is run.

For each grammar (a function-calling JSON schema, any JSON object, a regex) it times the
compile, then one request's output walked token by token through a fresh compiled grammar
(every state's automaton rows and token mask made for the first time), then a second
request with the same output (everything cached). The vocabulary is a checkpoint's
tokenizer (`--tokenizer DIR`) or, by default, a synthetic one: the 256 bytes plus random
byte strings of JSON-like text, `--vocab-size` tokens in all.

    python scripts/bench_structured.py                       # synthetic 131,072 tokens
    python scripts/bench_structured.py --tokenizer path/to/checkpoint
"""
import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

from hybrid_engine.sampling_params import StructuredOutputsParams
from hybrid_engine.structured.grammar import GrammarCompiler
from hybrid_engine.structured.vocabulary import TokenVocabulary
from hybrid_engine.tokenizer import load_tokenizer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "hourly": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}, "required": ["city", "days"]}
OUTPUT = {"city": "San Francisco, CA", "unit": "celsius", "days": 3, "tags": ["fog", "wind speed"]}
GRAMMARS = {
    "json schema (function call)": (StructuredOutputsParams(json=WEATHER), json.dumps(OUTPUT, indent=2)),
    "json_object": (StructuredOutputsParams(json_object=True), json.dumps(OUTPUT)),
    "regex (date time)": (StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2} [0-2]\d:[0-5]\d"), "2026-11-30 04:25"),
}
TEXT_CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,._-\n\t"


@dataclass
class Timing:
    """One grammar's times (ms)."""

    compile_ms: float
    tokens: int
    first_ms: float  # the output walked through a fresh grammar: states and masks made
    second_ms: float  # the same output again: all cached
    slowest_mask_ms: float  # the slowest single step of the first walk


class SyntheticTokenizer:
    """A stand-in tokenizer over a synthetic vocabulary: ids are byte strings (the 256 bytes
    first), and text is encoded greedily, longest known piece first."""

    def __init__(self, vocab_size: int, seed: int = 0):
        rng = random.Random(seed)
        pieces = {bytes([b]) for b in range(256)}
        while len(pieces) < vocab_size:
            length = min(16, max(2, int(rng.expovariate(1 / 5))))
            pieces.add("".join(rng.choice(TEXT_CHARS) for _ in range(length)).encode())
        self.pieces = [bytes([b]) for b in range(256)] + sorted(pieces - {bytes([b]) for b in range(256)})
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}

    def encode(self, text: str) -> list[int]:
        data, ids, at = text.encode(), [], 0
        while at < len(data):
            n = next(n for n in range(16, 0, -1) if data[at:at + n] in self.ids)
            ids.append(self.ids[data[at:at + n]])
            at += n
        return ids


def synthetic_vocabulary(vocab_size: int) -> tuple[TokenVocabulary, SyntheticTokenizer]:
    """A `TokenVocabulary` of `SyntheticTokenizer`'s pieces, and the tokenizer."""
    tokenizer = SyntheticTokenizer(vocab_size)
    return TokenVocabulary(dict(enumerate(tokenizer.pieces)), vocab_size), tokenizer


def time_grammar(vocabulary: TokenVocabulary, tokenizer, params: StructuredOutputsParams, text: str) -> Timing:
    """Compile, then walk `text` (as the tokenizer splits it) through a fresh grammar and again."""
    start = time.perf_counter()
    compiler = GrammarCompiler(vocabulary)
    state = compiler.start(params, frozenset())
    compile_ms = (time.perf_counter() - start) * 1e3
    tokens = tokenizer.encode(text)
    walks = []
    for _ in range(2):
        state, steps = compiler.start(params, frozenset()), []
        for token in tokens:
            begin = time.perf_counter()
            state.advance(token)
            steps.append((time.perf_counter() - begin) * 1e3)
        walks.append(steps)
    return Timing(compile_ms, len(tokens), sum(walks[0]), sum(walks[1]), max(walks[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a checkpoint (or tokenizer) directory; default: synthetic")
    parser.add_argument("--vocab-size", type=int, default=131072, help="synthetic vocabulary size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per grammar (medians printed)")
    args = parser.parse_args()
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer is None:
            raise SystemExit(f"no tokenizer in {args.tokenizer}")
        begin = time.perf_counter()
        vocabulary = TokenVocabulary.of_tokenizer(tokenizer, len(tokenizer))
        source = f"{args.tokenizer} ({len(tokenizer)} tokens, vocabulary read in {time.perf_counter() - begin:.2f} s)"
    else:
        vocabulary, tokenizer = synthetic_vocabulary(args.vocab_size)
        source = f"synthetic, {args.vocab_size} tokens"
    print(f"vocabulary: {source}")
    print("| grammar | tokens | compile + first mask (ms) | first request: states and masks made (ms, per token) | slowest step (ms) "
          "| second request (ms) |")
    print("|---|---|---|---|---|---|")
    for name, (params, text) in GRAMMARS.items():
        runs = [time_grammar(vocabulary, tokenizer, params, text) for _ in range(args.repeats)]

        def median(field: str) -> float:
            return statistics.median(getattr(r, field) for r in runs)

        first = median("first_ms")
        print(f"| {name} | {runs[0].tokens} | {median('compile_ms'):.1f} | {first:.0f} ({first / runs[0].tokens:.2f}) "
              f"| {median('slowest_mask_ms'):.1f} | {median('second_ms'):.1f} |")


if __name__ == "__main__":
    main()

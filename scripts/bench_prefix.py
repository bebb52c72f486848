"""Prefix caching benchmark (issue 13): multi-turn chat TTFT and a no-reuse workload's
throughput, with prefix caching on and off, in one process (8B preset, dummy weights, bf16,
async + CUDA graphs).

    python scripts/bench_prefix.py --model preset:nemotron-h-8b --json prefix.json

Multi-turn: `--conversations` closed-loop clients, all starting at once, each running
`--turns` turns. Turn 1's prompt is a shared `--system-len`-token system prompt plus a user
message of `--user-len` tokens (uniform, seeded); turn t+1 is added as soon as turn t
finishes (or, with `--think-time-s MEAN`, a seeded exponential time of that mean later, as
a user reads the answer before writing; TTFT then counts from that arrival), with prompt =
turn t's prompt + its answer + a new user message. Answers are
`--answer-len` tokens (greedy, EOS ignored); token ids are random in [3, vocab). TTFT is the
time from a request's arrival to the step that returns its first output token.
`hit_rate_reusable` (the acceptance number) counts turns >= 2: cached tokens / reusable
tokens, reusable = previous turn's prompt + answer - 1 (the last answer token was never
fed). `system_prompt_hit_rate` is turn 1's share of the system prompt served from other
conversations' blocks (a bonus). `ttft_turn1_p50_ms` / `ttft_later_p50_ms` split the TTFT
p50 by turn, and `largest_first_token_group` is the most turns >= 2 whose first tokens came
back in one step (such a group arrives together at its next turn). `engine_hit_rate` is the engine's prefix_cache_hits /
prefix_cache_queries over the run. `dt_limited_requests`: requests whose generated tokens the
cache did not take, since one had a Mamba dt outside the model's prompt-only limit (the next
turn then prefills that answer again; docs/cache.md, "Exactness").

No-reuse: `--random-requests` random prompts of `--random-len` tokens, all submitted at
once, `--answer-len` tokens each: output tok/s with caching on vs off (the cost of
caching when nothing hits).

Per mode one engine is built (on first, then off; the first is freed before the second),
warmed up on the same workloads at a smaller size (`--warmup-scale`, two turns), then timed
`--repeats` times per workload (default once; the median run is reported). Every run draws
its own prompts, so no run hits what the warm-up or an earlier run cached. Prints one
table and the ratios against issue 13's targets last; `--json` writes everything. With the
defaults the whole command is meant to fit one 10-minute device call. On CPU with `--model
embedded` and tiny sizes it runs in seconds (tests/scripts/test_bench_prefix.py).
"""
import argparse
import collections
import dataclasses
import gc
import heapq
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_probe import checked_step, percentile  # noqa: E402

from hybrid_engine import LLM, SamplingParams  # noqa: E402

MODES = {"on": True, "off": False}
WORKLOADS = ("multi-turn", "no-reuse")
MEDIAN_KEY = {"multi-turn": "ttft_p50_ms", "no-reuse": "output_tok_s"}  # which run of several is reported
# Engine stats that count events; `prefix_cache_checkpoints` (held now) is reported as is.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_dt_limited_requests", "prefill_tokens",
            "pauses", "evictions")
TARGETS = dict(ttft_p50_ratio=0.2, hit_rate_reusable=0.9, no_reuse_tok_s_ratio=0.98)


@dataclasses.dataclass
class Conversation:
    """One client: its first prompt, then the user message of each later turn."""

    name: str
    first_prompt: list[int]
    user_messages: list[list[int]]


@dataclasses.dataclass
class TurnRecord:
    """One request's timings (perf_counter seconds) and cache use."""

    conversation: int
    turn: int  # 1-based
    prompt_len: int
    reusable: int  # tokens a cache could serve from this conversation's previous turn
    added: float
    first_token: float | None = None
    finished: float | None = None
    cached: int = 0
    output_len: int = 0


def random_ids(gen: torch.Generator, length: int, vocab: int) -> list[int]:
    """`length` random token ids in [3, vocab) (0-2 are the special ids of most vocabularies)."""
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def uniform_length(gen: torch.Generator, bounds: tuple[int, int]) -> int:
    """A length drawn uniformly from the inclusive `bounds`."""
    return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=gen))


def multi_turn_workload(conversations: int, turns: int, system_len: int, user_len: tuple[int, int], vocab: int,
                        seed: int) -> list[Conversation]:
    """Conversations sharing one system prompt, each with `turns` random user messages."""
    gen = torch.Generator().manual_seed(seed)
    system = random_ids(gen, system_len, vocab)
    result = []
    for c in range(conversations):
        messages = [random_ids(gen, uniform_length(gen, user_len), vocab) for _ in range(turns)]
        result.append(Conversation(f"c{c}", system + messages[0], messages[1:]))
    return result


def random_workload(requests: int, prompt_len: tuple[int, int], vocab: int, seed: int) -> list[Conversation]:
    """Single-turn conversations with unrelated random prompts (nothing to reuse)."""
    gen = torch.Generator().manual_seed(seed)
    return [Conversation(f"r{i}", random_ids(gen, uniform_length(gen, prompt_len), vocab), [])
            for i in range(requests)]


def run_workload(engine, conversations: list[Conversation], answer_len: int, tag: str, think_time_s: float = 0.0,
                 seed: int = 0) -> tuple[list[TurnRecord], float, dict]:
    """Drive the engine until every conversation has run all its turns; a conversation's
    next turn arrives `think_time_s` on average (exponential, seeded; 0: at once) after the
    step that finished its previous one, and is added at the first step boundary from then
    (its TTFT counts from the arrival). Returns the per-request records, the wall time (s)
    and the engine's `COUNTERS` over the run plus the checkpoints it holds at the end."""
    params = SamplingParams(max_tokens=answer_len, temperature=0, ignore_eos=True)
    records: dict[str, TurnRecord] = {}
    prompts: dict[str, list[int]] = {}
    arrivals: list[tuple[float, int, int, list[int], int]] = []  # heap: (time, conversation, turn, prompt, reusable)
    think = random.Random(seed)

    def submit(arrival: float, index: int, turn: int, prompt: list[int], reusable: int) -> None:
        rid = f"{tag}-{conversations[index].name}-t{turn}"
        prompts[rid] = prompt
        records[rid] = TurnRecord(index, turn, len(prompt), reusable, added=arrival)
        engine.add_request(rid, prompt, params)

    before = engine.stats()
    start = time.perf_counter()
    for index, conv in enumerate(conversations):
        submit(start, index, 1, conv.first_prompt, 0)
    while engine.has_unfinished_requests() or arrivals:
        while arrivals and arrivals[0][0] <= time.perf_counter():
            submit(*heapq.heappop(arrivals))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[0][0] - time.perf_counter()))  # every conversation is thinking
            continue
        outputs = checked_step(engine)
        now = time.perf_counter()
        for out in outputs:
            record = records[out.request_id]
            if out.new_token_ids and record.first_token is None:
                record.first_token = now
            if not out.finished:
                continue
            record.finished, record.cached = now, out.num_cached_tokens
            record.output_len = len(out.output_token_ids)
            messages = conversations[record.conversation].user_messages
            history = prompts.pop(out.request_id) + out.output_token_ids
            if record.turn <= len(messages):
                arrival = now + (think.expovariate(1 / think_time_s) if think_time_s else 0.0)
                heapq.heappush(arrivals, (arrival, record.conversation, record.turn + 1,
                                          history + messages[record.turn - 1], len(history) - 1))
    wall = time.perf_counter() - start
    after = engine.stats()
    stats = {k: after[k] - before[k] for k in COUNTERS}
    stats["prefix_cache_checkpoints"] = after["prefix_cache_checkpoints"]
    return list(records.values()), wall, stats


def first_token_groups(records: list[TurnRecord]) -> list[int]:
    """How many of `records` got their first token in each step, largest first (the driver
    stamps every output of one step with the same time). Closed-loop conversations whose
    answers have one length keep the groups their first turn formed: a group's next turns
    arrive together and share a prompt step."""
    return sorted(collections.Counter(r.first_token for r in records).values(), reverse=True)


def ttft_p50_ms(records: list[TurnRecord]) -> float | None:
    """Median time to first token of `records` in ms (None if there are none)."""
    return statistics.median(1e3 * (r.first_token - r.added) for r in records) if records else None


def summarize(records: list[TurnRecord], wall: float, stats: dict, system_len: int) -> dict:
    """A workload's row: TTFT p50/p99 (also for turn 1 and later turns apart, with the
    largest group of later turns whose first tokens came in one step), total time, output
    tok/s and cache hits."""
    ttft = [1e3 * (r.first_token - r.added) for r in records]
    output = sum(r.output_len for r in records)
    later = [r for r in records if r.turn > 1]
    first = [r for r in records if r.turn == 1]
    reusable = sum(r.reusable for r in later)
    queries = stats["prefix_cache_queries"]
    return dict(
        requests=len(records), ttft_p50_ms=statistics.median(ttft), ttft_p99_ms=percentile(ttft, 0.99),
        ttft_turn1_p50_ms=ttft_p50_ms(first), ttft_later_p50_ms=ttft_p50_ms(later),
        largest_first_token_group=first_token_groups(later)[0] if later else None,
        total_s=wall, output_tokens=output, output_tok_s=output / wall,
        prompt_tokens=sum(r.prompt_len for r in records), cached_tokens=sum(r.cached for r in records),
        reusable_tokens=reusable,
        hit_rate_reusable=sum(r.cached for r in later) / reusable if reusable else None,
        system_prompt_hit_rate=(sum(min(r.cached, system_len) for r in first) / (system_len * len(first))
                                if system_len else None),
        prefix_cache_hits=stats["prefix_cache_hits"], prefix_cache_queries=queries,
        engine_hit_rate=stats["prefix_cache_hits"] / queries if queries else None,
        dt_limited_requests=stats["prefix_cache_dt_limited_requests"],
        prefill_tokens=stats["prefill_tokens"], pauses=stats["pauses"], evictions=stats["evictions"],
        checkpoints_held=stats["prefix_cache_checkpoints"])


def workloads(args: argparse.Namespace, vocab: int, run: int,
              scale: float) -> dict[str, tuple[list[Conversation], int]]:
    """The two workloads (and the system prompt length each shares) at `scale` of the
    requested sizes (at least one conversation / request; below full scale, at most two
    turns). Every `run` number and workload draws its own prompts: no run can hit blocks
    or checkpoints another run left in the cache."""
    seed = 1000 * args.seed + 2 * run
    conversations = max(1, round(args.conversations * scale))
    turns = args.turns if scale == 1 else min(args.turns, 2)
    requests = max(1, round(args.random_requests * scale))
    return {
        "multi-turn": (multi_turn_workload(conversations, turns, args.system_len, tuple(args.user_len), vocab, seed),
                       args.system_len),
        "no-reuse": (random_workload(requests, tuple(args.random_len), vocab, seed + 1), 0),
    }


def max_model_len(args: argparse.Namespace) -> int:
    """The longest request either workload makes (a last turn with the longest messages)."""
    last_turn = args.system_len + args.turns * args.user_len[1] + (args.turns - 1) * args.answer_len
    return max(last_turn, args.random_len[1]) + args.answer_len


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, dict]:
    """Build one engine with prefix caching on or off, warm it up, time both workloads, and
    free it; returns a summary per workload."""
    llm = LLM(model=None if args.model == "embedded" else args.model, enable_prefix_caching=MODES[mode],
              prefix_cache_max_checkpoints=args.prefix_cache_max_checkpoints,
              prefix_cache_checkpoint_interval=args.prefix_cache_checkpoint_interval,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max_model_len(args))
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    # Warm-up: Triton compiles / autotunes per shape.
    for name, (convs, _) in workloads(args, vocab, args.repeats, args.warmup_scale).items():
        run_workload(engine, convs, args.answer_len, f"warmup-{name}")
    runs: dict[str, list[dict]] = {name: [] for name in WORKLOADS}
    for run in range(args.repeats):
        for name, (convs, system_len) in workloads(args, vocab, run, 1.0).items():
            r = summarize(*run_workload(engine, convs, args.answer_len, f"{name}-{run}", args.think_time_s,
                                        seed=1000 * args.seed + run), system_len)
            runs[name].append(r)
            print(f"caching {mode:3s} {name:10s} TTFT p50/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms  "
                  f"(p50 turn 1 / later {milliseconds(r['ttft_turn1_p50_ms'])} / {milliseconds(r['ttft_later_p50_ms'])}, "
                  f"largest first-token group {r['largest_first_token_group'] or '-'})  "
                  f"total {r['total_s']:.2f} s  {r['output_tok_s']:.0f} tok/s  hits/queries {r['prefix_cache_hits']}/"
                  f"{r['prefix_cache_queries']}  answers not cached (dt limit) {r['dt_limited_requests']}/"
                  f"{r['requests']}  prefill {r['prefill_tokens']} tokens  pauses {r['pauses']}  "
                  f"evictions {r['evictions']}", flush=True)
    # The median run by each workload's headline number (host jitter moves single runs).
    rows = {name: sorted(runs[name], key=lambda r: r[MEDIAN_KEY[name]])[args.repeats // 2] for name in WORKLOADS}
    del engine, llm
    gc.collect()  # the engine holds reference cycles: free its memory before the next one
    torch.cuda.empty_cache()
    return rows


def ratios(results: dict[str, dict[str, dict]]) -> dict:
    """On / off ratios and whether each meets issue 13's target (both modes needed)."""
    on, off = results["on"], results["off"]
    out = dict(ttft_p50_ratio=on["multi-turn"]["ttft_p50_ms"] / off["multi-turn"]["ttft_p50_ms"],
               ttft_p99_ratio=on["multi-turn"]["ttft_p99_ms"] / off["multi-turn"]["ttft_p99_ms"],
               total_time_ratio=on["multi-turn"]["total_s"] / off["multi-turn"]["total_s"],
               hit_rate_reusable=on["multi-turn"]["hit_rate_reusable"],
               no_reuse_tok_s_ratio=on["no-reuse"]["output_tok_s"] / off["no-reuse"]["output_tok_s"])
    hit = out["hit_rate_reusable"]
    out["meets"] = dict(ttft_p50_ratio=out["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"],
                        hit_rate_reusable=hit is not None and hit >= TARGETS["hit_rate_reusable"],
                        no_reuse_tok_s_ratio=out["no_reuse_tok_s_ratio"] >= TARGETS["no_reuse_tok_s_ratio"])
    return out


def fraction(value: float | None) -> str:
    """A hit rate as a percentage, '-' where it does not apply."""
    return "-" if value is None else f"{value:.1%}"


def milliseconds(value: float | None) -> str:
    """A time in ms, '-' where it does not apply."""
    return "-" if value is None else f"{value:.1f}"


def print_table(results: dict[str, dict[str, dict]], summary: dict | None) -> None:
    """One markdown row per mode and workload, then the ratios against the targets."""
    print("| caching | workload | TTFT p50 (ms) | TTFT p99 (ms) | TTFT p50 turn 1 / later (ms) | largest first-token "
          "group (turns >= 2) | total (s) | output tok/s | hits / reusable (turns >= 2) | system prompt hits (turn 1) "
          "| hits / queries (engine) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        for name, r in rows.items():
            print(f"| {mode} | {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                  f"{milliseconds(r['ttft_turn1_p50_ms'])} / {milliseconds(r['ttft_later_p50_ms'])} | "
                  f"{r['largest_first_token_group'] or '-'} | {r['total_s']:.2f} | "
                  f"{r['output_tok_s']:.0f} | {fraction(r['hit_rate_reusable'])} | "
                  f"{fraction(r['system_prompt_hit_rate'])} | {fraction(r['engine_hit_rate'])} |")
    if summary is None:
        return
    ok = {True: "meets target", False: "MISSES target"}
    meets = summary["meets"]
    print(f"\nTTFT p50 on/off {summary['ttft_p50_ratio']:.3f} (target <= {TARGETS['ttft_p50_ratio']}: "
          f"{ok[meets['ttft_p50_ratio']]}); TTFT p99 on/off {summary['ttft_p99_ratio']:.3f}; "
          f"total time on/off {summary['total_time_ratio']:.3f}")
    print(f"hits / reusable tokens (turns >= 2) {fraction(summary['hit_rate_reusable'])} "
          f"(target >= {TARGETS['hit_rate_reusable']:.0%}: {ok[meets['hit_rate_reusable']]})")
    print(f"no-reuse output tok/s on/off {summary['no_reuse_tok_s_ratio']:.3f} "
          f"(target >= {TARGETS['no_reuse_tok_s_ratio']}: {ok[meets['no_reuse_tok_s_ratio']]})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); bad sizes exit with an argparse error."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:nemotron-h-8b",
                    help="'preset:NAME', a checkpoint directory, or 'embedded' (the tiny built-in model)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="prefix caching on / off, run in this order (ratios need both)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    ap.add_argument("--user-len", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"),
                    help="user message tokens, uniform in [MIN, MAX]")
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--think-time-s", type=float, default=0.0,
                    help="mean seconds (exponential) between an answer and the next turn (default 0: at once)")
    ap.add_argument("--random-requests", type=int, default=256, help="no-reuse workload requests")
    ap.add_argument("--random-len", type=int, nargs=2, default=[2048, 3072], metavar=("MIN", "MAX"),
                    help="no-reuse prompt tokens, uniform in [MIN, MAX]")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, both modes (default: the engine's)")
    ap.add_argument("--prefix-cache-max-checkpoints", type=int, default=None, help="default: the engine's")
    ap.add_argument("--prefix-cache-checkpoint-interval", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per workload and mode (fresh prompts each); the median run is reported")
    ap.add_argument("--warmup-scale", type=float, default=0.25,
                    help="warm-up size as a fraction of the requested conversations / requests (2 turns)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    for name in ("conversations", "turns", "system_len", "answer_len", "random_requests", "max_num_seqs",
                 "repeats"):
        if getattr(args, name) < (0 if name == "system_len" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("user_len", "random_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")
    if not 0 < args.warmup_scale <= 1:
        ap.error("--warmup-scale must be in (0, 1]")
    if args.think_time_s < 0:
        ap.error("--think-time-s must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns what `--json` writes: the arguments, a row per mode and
    workload, and the on/off ratios (None unless both modes ran)."""
    args = parse_args(argv)
    results = {mode: run_mode(args, mode) for mode in args.modes}
    summary = ratios(results) if set(args.modes) == set(MODES) else None
    print(f"\nmodel {args.model}, {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_len}, user {args.user_len[0]}-{args.user_len[1]}, answers {args.answer_len}, think time "
          f"{args.think_time_s} s; no-reuse "
          f"{args.random_requests} x {args.random_len[0]}-{args.random_len[1]} tokens; max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens or 'default'}")
    print_table(results, summary)
    report = dict(args=vars(args), results=results, ratios=summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

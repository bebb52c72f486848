"""scripts/bench_prefix.py on CPU with the embedded model at tiny sizes: the workloads it
builds, the closed-loop driver's accounting, and the report's structure (no timings
asserted: the script's numbers are meant for a GPU)."""
import json
import sys
from pathlib import Path

import pytest

from hybrid_engine.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_prefix import (  # noqa: E402
    WORKLOADS, TurnRecord, first_token_groups, main, multi_turn_workload, parse_args, percentile, random_workload,
    run_workload, workloads)

from hybrid_engine import LLM  # noqa: E402

TINY = ["--model", "embedded", "--conversations", "3", "--turns", "3", "--system-len", "48", "--user-len", "8", "16",
        "--answer-len", "5", "--random-requests", "4", "--random-len", "30", "50", "--max-num-seqs", "4",
        "--prefix-cache-checkpoint-interval", "32"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """main() on TINY sizes, both modes; returns (report, what --json wrote)."""
    path = tmp_path_factory.mktemp("bench_prefix") / "out.json"
    result = main(TINY + ["--json", str(path)])
    return result, json.loads(path.read_text())


def expected_prompt_tokens(argv: list[str]) -> tuple[int, int]:
    """(all prompt tokens, reusable tokens of turns >= 2) of the timed multi-turn workload,
    from its conversations: turn t+1's prompt is turn t's prompt + answer + next message."""
    args = parse_args(argv)
    convs, _ = workloads(args, BYTE_TOKENIZER_VOCAB_SIZE, 0, 1.0)["multi-turn"]
    total = reusable = 0
    for conv in convs:
        length = len(conv.first_prompt)
        total += length
        for message in conv.user_messages:
            reusable += length + args.answer_len - 1
            length += args.answer_len + len(message)
            total += length
    return total, reusable


def test_report_structure_and_json(report):
    result, written = report
    assert written == json.loads(json.dumps(result))
    assert set(result["results"]) == {"on", "off"}
    for mode in ("on", "off"):
        assert set(result["results"][mode]) == set(WORKLOADS)
        for row in result["results"][mode].values():
            assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
            assert row["total_s"] > 0 and row["output_tok_s"] > 0
    ratios = result["ratios"]
    assert set(ratios["meets"]) == {"ttft_p50_ratio", "hit_rate_reusable", "no_reuse_tok_s_ratio"}
    assert ratios["ttft_p50_ratio"] > 0 and ratios["no_reuse_tok_s_ratio"] > 0


def test_every_turn_runs_and_answers(report):
    result, _ = report
    prompts, reusable = expected_prompt_tokens(TINY)
    for mode in ("on", "off"):
        multi, single = result["results"][mode]["multi-turn"], result["results"][mode]["no-reuse"]
        assert multi["requests"] == 3 * 3 and multi["output_tokens"] == 3 * 3 * 5
        assert single["requests"] == 4 and single["output_tokens"] == 4 * 5
        assert multi["prompt_tokens"] == prompts and multi["reusable_tokens"] == reusable


def test_caching_on_hits_and_off_does_not(report):
    result, _ = report
    on, off = result["results"]["on"], result["results"]["off"]
    multi = on["multi-turn"]
    assert multi["evictions"] == 0  # so every query below is a prompt token, counted once
    assert multi["prefix_cache_hits"] > 0 and multi["cached_tokens"] == multi["prefix_cache_hits"]
    assert multi["prefix_cache_queries"] == multi["prompt_tokens"]
    assert 0 < multi["hit_rate_reusable"] <= 1 and result["ratios"]["hit_rate_reusable"] == multi["hit_rate_reusable"]
    assert on["no-reuse"]["prefix_cache_hits"] == 0  # fresh random prompts: nothing from warm-up or multi-turn
    assert 0 <= multi["dt_limited_requests"] <= multi["requests"]
    for row in off.values():
        assert row["cached_tokens"] == 0 and row["prefix_cache_hits"] == 0 and row["checkpoints_held"] == 0
        assert row["dt_limited_requests"] == 0  # (only a cache checks the dt limit)


def test_turn_split_and_first_token_groups(report):
    """Turn 1 and later turns' TTFT apart, and the largest group of later turns whose first
    tokens came back in one step: at most every later turn, at least one."""
    result, _ = report
    for mode in ("on", "off"):
        multi, single = result["results"][mode]["multi-turn"], result["results"][mode]["no-reuse"]
        assert multi["ttft_turn1_p50_ms"] > 0 and multi["ttft_later_p50_ms"] > 0
        assert 1 <= multi["largest_first_token_group"] <= 3 * 2
        assert single["ttft_turn1_p50_ms"] == single["ttft_p50_ms"] and single["ttft_later_p50_ms"] is None
        assert single["largest_first_token_group"] is None


@pytest.mark.parametrize("think_time_s", [0.0, 0.02])
def test_next_turn_arrives_after_the_think_time(think_time_s):
    """A turn arrives when its previous turn finished (think time 0) or a seeded exponential
    time later, the same draws for the same seed; TTFT counts from that arrival."""
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256, cuda_graphs=False)  # embedded
    convs = multi_turn_workload(3, 3, 16, (4, 8), BYTE_TOKENIZER_VOCAB_SIZE, seed=5)

    def gaps(tag: str) -> list[float]:
        records, wall, _ = run_workload(llm.engine, convs, 4, tag, think_time_s, seed=7)
        assert len(records) == 9 and all(r.output_len == 4 and r.first_token >= r.added for r in records)
        by_turn = {(r.conversation, r.turn): r for r in records}
        assert wall >= max(r.finished for r in records) - min(r.added for r in records)
        return sorted(r.added - by_turn[r.conversation, r.turn - 1].finished for r in records if r.turn > 1)

    first = gaps("a")
    if think_time_s == 0:
        assert first == [0.0] * 6
    else:  # six distinct positive draws; a second run draws the same ones
        assert all(g > 0 for g in first) and len(set(first)) == 6
        assert gaps("b") == pytest.approx(first, abs=1e-6)  # (perf_counter's magnitude rounds them)


def test_first_token_groups_count_requests_per_step():
    def record(first_token: float) -> TurnRecord:
        return TurnRecord(conversation=0, turn=2, prompt_len=1, reusable=0, added=0.0, first_token=first_token)

    steps = [0.5, 0.7, 0.5, 0.9, 0.5, 0.7]  # three in the step stamped 0.5, two in 0.7, one in 0.9
    assert first_token_groups([record(t) for t in steps]) == [3, 2, 1]
    assert first_token_groups([]) == []


def test_one_mode_has_no_ratios():
    result = main(TINY + ["--modes", "off", "--conversations", "2", "--turns", "2", "--random-requests", "2"])
    assert set(result["results"]) == {"off"} and result["ratios"] is None


def test_workloads_share_the_system_prompt_and_respect_bounds():
    convs = multi_turn_workload(4, 3, 20, (5, 9), 100, seed=7)
    assert all(c.first_prompt[:20] == convs[0].first_prompt[:20] for c in convs)
    assert all(len(c.user_messages) == 2 for c in convs)
    lengths = [len(c.first_prompt) - 20 for c in convs] + [len(m) for c in convs for m in c.user_messages]
    assert all(5 <= n <= 9 for n in lengths)
    ids = [t for c in convs for t in c.first_prompt + sum(c.user_messages, [])]
    assert min(ids) >= 3 and max(ids) < 100
    assert multi_turn_workload(4, 3, 20, (5, 9), 100, seed=7) == convs
    singles = random_workload(5, (10, 12), 100, seed=7)
    assert all(10 <= len(c.first_prompt) <= 12 and not c.user_messages for c in singles)
    assert len({tuple(c.first_prompt[:4]) for c in singles}) == 5


def test_runs_draw_distinct_prompts():
    args = parse_args(TINY)
    first = workloads(args, BYTE_TOKENIZER_VOCAB_SIZE, 0, 1.0)
    second = workloads(args, BYTE_TOKENIZER_VOCAB_SIZE, 1, 1.0)
    for name in WORKLOADS:
        assert first[name][0][0].first_prompt[:16] != second[name][0][0].first_prompt[:16]


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 100 and percentile(values, 0.5) == 51 and percentile([3.0], 0.99) == 3.0


@pytest.mark.parametrize("argv", [["--think-time-s", "-1"], ["--user-len", "9", "8"], ["--turns", "0"],
                                  ["--warmup-scale", "0"]])
def test_bad_sizes_exit(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)

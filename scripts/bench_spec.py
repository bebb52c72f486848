"""Speculative decoding benchmark: output tok/s with drafts against our own non-speculative
decoding in the same process, on bench_decode's peer shapes (bf16, dummy weights, async +
CUDA graphs by default).

    python scripts/bench_spec.py --batches 1 32 128 --k 4 --output-len 128

Proposers: `oracle` (proposes the continuation the speculative engine itself produces:
acceptance ~100%, the ceiling of any proposer; found by iterating from the non-speculative
run's output until a run reproduces its own drafts, because bf16 verify steps round
differently and dummy weights give near-ties that flip -- `calib` runs it took), `adversarial` (always wrong: acceptance 0, shows the
cost of verifying and the back-off), `ngram` (prompt lookup, on prompts that repeat a text),
and draft models: `draft-small` (a 6-layer, 1024-wide dummy-weight hybrid with the target's
vocabulary; random weights, so its drafts are rarely accepted: the cost of a draft model
that does not help) and `draft-self` (the target drafting for itself: every draft accepted
up to bf16 rounding; the cost of a draft as large as the target).

    python scripts/bench_spec.py --model preset:nemotron-h-8b --batches 1 8 --proposers draft-small draft-self

Each row is the median of `--repeats` timed runs after a warm-up run: `speedup` counts the
whole run (prefill included), `decode_speedup` the tokens after every request had its first
one (the decode phase speculation speeds up); `agree` is the share
of output tokens equal to the non-speculative run's (bf16 verify steps multiply more rows
than decode steps, so rounding can flip a near-tie). Prints one table; `--json` writes it.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import StepProbe, model_hf_config, peer_model_dir  # noqa: E402

from hybrid_engine import LLM, SamplingParams  # noqa: E402

# The small draft model: NemotronH, 6 layers (3 Mamba-2, 1 attention, 2 MLP), 1024 wide.
SMALL_DRAFT = dict(hybrid_override_pattern="M-M*M-", num_hidden_layers=6, hidden_size=1024, intermediate_size=4096,
                   num_attention_heads=8, num_key_value_heads=2, mamba_head_dim=64, mamba_num_heads=32, n_groups=8)


def small_draft_dir(target: dict) -> str:
    """A checkpoint directory holding the small draft's config.json (dummy weights): the
    target's NemotronH config, vocabulary included, at SMALL_DRAFT's size."""
    if target.get("model_type") != "nemotron_h":
        raise SystemExit("draft-small is a NemotronH draft: use a NemotronH target")
    path = tempfile.mkdtemp(prefix="small-draft-")
    with open(f"{path}/config.json", "w") as f:
        json.dump({**target, **SMALL_DRAFT}, f)
    return path


class OracleProposer:
    """Drafts the tokens the non-speculative run produced after the same context."""

    def __init__(self, truth: dict[str, list[int]]):
        self.truth = truth

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        full = self.truth[request_id]
        n = len(token_ids)
        return full[n:n + num_tokens] if full[:n] == token_ids else []


class AdversarialProposer(OracleProposer):
    """Drafts a token other than the non-speculative run's at every position."""

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        full = self.truth[request_id]
        n = len(token_ids)
        return [(t + 1) % 1000 for t in full[n:n + num_tokens]] + [5] * max(0, n + num_tokens - len(full))


def workload(batch: int, prompt_len: int, vocab: int, repetitive: bool) -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(batch)
    prompts = []
    for i in range(batch):
        if repetitive:  # a text said three times: prompt lookup has something to find
            text = torch.randint(3, vocab, (prompt_len // 3,), generator=gen).tolist()
            prompts.append((f"b{batch}-{i}", text * 3))
        else:
            prompts.append((f"b{batch}-{i}", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()))
    return prompts


def timed_run(llm: LLM, prompts: list[tuple[str, list[int]]], output_len: int) -> tuple[float, dict, dict]:
    """(output tok/s, outputs by id, stats delta) of one run of the whole batch; the stats
    also hold `decode_tok_s`: tokens after every request had its first one, per second."""
    engine = llm.engine
    before = engine.stats()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for rid, prompt in prompts:
        engine.add_request(rid, prompt, params)
    outputs, started, produced = {}, set(), 0
    decode_start = decode_tokens = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.new_token_ids)
            started.add(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        if decode_start is None and len(started) == len(prompts):
            decode_start, decode_tokens = time.perf_counter(), produced
    end = time.perf_counter()
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("steps", "spec_steps", "spec_proposed_tokens", "spec_accepted_tokens")}
    delta["decode_tok_s"] = (produced - decode_tokens) / (end - decode_start)
    return produced / (end - start), outputs, delta


def probe(llm: LLM, prompts: list[tuple[str, list[int]]], output_len: int, steps: int) -> dict:
    """GPU busy time and host time per step (bench_decode's StepProbe) over `steps` steps
    after the prompts are prefilled."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for rid, prompt in prompts:
        engine.add_request(rid, prompt, params)
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    result = StepProbe(engine).run(steps)
    while engine.has_unfinished_requests():
        engine.step()
    host = sum(v for k, v in result.items() if k.startswith("host_") and k != "host_wait_us")
    return dict(gpu_ms=round(result["gpu_busy_ms_per_step"], 3), idle=round(result["gpu_idle"], 3),
                host_ms=round(host / 1e3, 3))


def median_run(llm, prompts, output_len, repeats):
    timed_run(llm, prompts, output_len)  # warm-up
    runs = [timed_run(llm, prompts, output_len) for _ in range(repeats)]
    tok_s = statistics.median(r[0] for r in runs)
    stats = {**runs[-1][2], "decode_tok_s": statistics.median(r[2]["decode_tok_s"] for r in runs)}
    return tok_s, runs[-1][1], stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=255)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="target: 'preset:NAME' or a checkpoint directory (default: bench_decode's "
                                   "peer shapes); weights are dummy")
    p.add_argument("--proposers", nargs="+", default=["oracle", "adversarial", "ngram"],
                   choices=["oracle", "adversarial", "ngram", "draft-small", "draft-self"])
    p.add_argument("--eager", action="store_true", help="serial eager instead of async + CUDA graphs")
    p.add_argument("--probe", action="store_true", help="add GPU busy / host time per step columns")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    model = args.model or peer_model_dir()
    common = dict(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_model_len=args.prompt_len + args.output_len + 16)
    if args.eager:
        common.update(async_scheduling=False, cuda_graphs=False)
    truth: dict[str, list[int]] = {}
    spec_llms = {}
    oracle, adversarial = OracleProposer(truth), AdversarialProposer(truth)
    configs = {"oracle": {"method": "proposer", "proposer": oracle},
               "adversarial": {"method": "proposer", "proposer": adversarial},
               "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}}
    if "draft-small" in args.proposers:
        configs["draft-small"] = {"method": "draft_model", "model": small_draft_dir(model_hf_config(model))}
    configs["draft-self"] = {"method": "draft_model", "model": model}
    base = LLM(**common)
    for name in args.proposers:
        spec_llms[name] = LLM(**common, speculative_config={**configs[name], "num_speculative_tokens": args.k})
    vocab = base.engine.model_config.vocab_size
    rows = []
    for batch in args.batches:
        for repetitive in (False, True):
            names = [n for n in args.proposers if (n == "ngram") == repetitive]
            if not names:
                continue
            prompts = workload(batch, args.prompt_len, vocab, repetitive)
            base_tok_s, base_out, base_stats = median_run(base, prompts, args.output_len, args.repeats)
            truth.clear()
            truth.update({rid: prompt + base_out[rid] for rid, prompt in prompts})
            calibration = 0
            if "oracle" in names:
                for calibration in range(1, 31):
                    _, out, _ = timed_run(spec_llms["oracle"], prompts, args.output_len)
                    fixed = {rid: prompt + out[rid] for rid, prompt in prompts}
                    if fixed == truth:
                        break
                    truth.update(fixed)
            for name in names:
                tok_s, out, stats = median_run(spec_llms[name], prompts, args.output_len, args.repeats)
                agree = sum(a == b for rid in out for a, b in zip(out[rid], base_out[rid])) / sum(
                    map(len, base_out.values()))
                proposed = stats["spec_proposed_tokens"]
                rows.append(dict(batch=batch, proposer=name, k=args.k, base_tok_s=round(base_tok_s, 1),
                                 spec_tok_s=round(tok_s, 1), speedup=round(tok_s / base_tok_s, 3),
                                 decode_speedup=round(stats["decode_tok_s"] / base_stats["decode_tok_s"], 3),
                                 acceptance=round(stats["spec_accepted_tokens"] / proposed, 3) if proposed else 0.0,
                                 tokens_per_step=round(sum(map(len, out.values())) / max(stats["steps"], 1), 2),
                                 verify_steps=stats["spec_steps"], steps=stats["steps"], agree=round(agree, 4),
                                 calib=calibration if name == "oracle" else 0))
                if args.probe:
                    rows[-1].update({f"base_{k}": v for k, v in probe(base, prompts, args.output_len, 16).items()})
                    rows[-1].update(probe(spec_llms[name], prompts, args.output_len, 16))
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

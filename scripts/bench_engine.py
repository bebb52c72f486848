#!/usr/bin/env python
"""Engine step benchmark on the embedded model: steps/s and CPU bookkeeping time per step.

For each batch size, `batch` requests with short prompts decode `--max-tokens` tokens each
(ignore_eos), so steady state is pure decode with the whole batch running. Every
`LLMEngine.step()` is timed, and split into
  device   : `runner.launch` + `StepHandle.wait` (forward + sampling + the samples' copy back)
  schedule : `scheduler.schedule`
  prepare  : `runner.prepare` (step buffer writes + the one H2D copy)
  post     : everything else in step() (appending tokens, stop checks, detokenizing, outputs)
bookkeeping = schedule + prepare + post = step - device. Only decode-only steps are counted
(the first, prefill, step and any later mixed step are skipped).

    python scripts/bench_engine.py                 # table, batch 1 / 16 / 64
    python scripts/bench_engine.py --json out.json # also write the results as JSON ('-' = stdout)
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hybrid_engine import LLM, SamplingParams  # noqa: E402


class _Timer:
    """Accumulates the time spent inside a wrapped callable during the current step."""

    def __init__(self):
        self.elapsed = 0.0

    def wrap(self, fn, on_result=None):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if on_result is not None:
                result = on_result(result)
            self.elapsed += time.perf_counter() - start
            return result

        return timed


def bench_batch(batch: int, args) -> dict:
    prompt_len, max_tokens = args.prompt_len, args.max_tokens
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=batch, max_model_len=prompt_len + max_tokens + 16,
              async_scheduling=args.async_scheduling, seed=0)
    eng, runner = llm.engine, llm.engine.runner
    t_sched, t_prep, t_dev = _Timer(), _Timer(), _Timer()
    plans = []

    def wrap_handle(handle):  # time the wait for the samples as device time too
        handle.wait = t_dev.wrap(handle.wait)
        return handle

    def record_plan(plan):
        plans.append(plan)
        return plan

    eng.scheduler.schedule = t_sched.wrap(eng.scheduler.schedule)
    runner.prepare = t_prep.wrap(runner.prepare, record_plan)
    runner.launch = t_dev.wrap(runner.launch, wrap_handle)

    for i in range(batch):
        prompt = [(i * 7 + j * 13) % 256 for j in range(prompt_len)]
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True))
        eng.add_request(f"b{batch}-{i}", prompt, params)

    rows = []  # (step, device, schedule, prepare, decode rows) per decode-only step
    while eng.has_unfinished_requests():
        for t in (t_sched, t_prep, t_dev):
            t.elapsed = 0.0
        n_plans = len(plans)
        start = time.perf_counter()
        eng.step()
        total = time.perf_counter() - start
        new = plans[n_plans:]
        if new and all(p.num_prefill == 0 for p in new):
            rows.append((total, t_dev.elapsed, t_sched.elapsed, t_prep.elapsed, sum(p.num_decode for p in new)))
    stats = eng.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"], "benchmark leaked KV blocks"
    rows = rows[args.warmup:] or rows

    def us(i):
        return statistics.median(r[i] for r in rows) * 1e6

    step_us, dev_us, sched_us, prep_us = us(0), us(1), us(2), us(3)
    mean_step = statistics.fmean(r[0] for r in rows)
    return {
        "batch": batch,
        "decode_steps_measured": len(rows),
        "steps_per_s": 1.0 / mean_step,
        "tokens_per_s": statistics.fmean(r[4] for r in rows) / mean_step,
        "step_us": step_us,
        "device_us": dev_us,
        "bookkeeping_us": step_us - dev_us,
        "schedule_us": sched_us,
        "prepare_us": prep_us,
        "post_us": step_us - dev_us - sched_us - prep_us,
        "bookkeeping_frac": (step_us - dev_us) / step_us,
        "engine_steps": stats["steps"],
        "h2d_copies": stats["h2d_copies"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4, help="decode steps dropped from each measurement")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the model is tiny; 0 = torch's default)")
    ap.add_argument("--async-scheduling", action="store_true", help="engine launch-ahead mode (default: serial)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON to PATH ('-' for stdout)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    results = [bench_batch(b, args) for b in args.batches]
    header = (f"{'batch':>5} {'steps/s':>8} {'tok/s':>8} {'step us':>9} {'fwd+samp us':>11} "
              f"{'bookkeep us':>11} {'sched us':>8} {'prep us':>8} {'post us':>8} {'bk %':>5}")
    print(f"embedded model, CPU float32, {torch.get_num_threads()} thread(s), "
          f"{'async' if args.async_scheduling else 'serial'}, prompt {args.prompt_len}, "
          f"{args.max_tokens} tokens/request; decode-only steps: us = medians, steps/s and tok/s = means")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['batch']:>5} {r['steps_per_s']:>8.1f} {r['tokens_per_s']:>8.0f} {r['step_us']:>9.0f} "
              f"{r['device_us']:>11.0f} {r['bookkeeping_us']:>11.0f} {r['schedule_us']:>8.0f} "
              f"{r['prepare_us']:>8.0f} {r['post_us']:>8.0f} {100 * r['bookkeeping_frac']:>5.1f}")
    if args.json:
        payload = json.dumps({"config": vars(args), "threads": torch.get_num_threads(), "results": results},
                             indent=2)
        if args.json == "-":
            print(payload)
        else:
            with open(args.json, "w") as f:
                f.write(payload + "\n")


if __name__ == "__main__":
    main()

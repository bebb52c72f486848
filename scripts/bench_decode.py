"""Decode benchmark: output tok/s, inter-token latency, GPU idle fraction and the memory
floors of a decode step, for our engine in three modes (async + graphs, serial + graphs,
serial eager); `--count-kernels` also counts the CUDA kernels of one eager decode step, and
`--graph-timeline` charges each kernel of the timed steps its share of the step.

    python scripts/bench_decode.py --model peer --batches 1 8 32 128 256 --prompt-len 256 --output-len 128
    python scripts/bench_decode.py --model preset:nemotron-h-8b --batches 1 8 --hf-batch 8 --json out.json
    python scripts/bench_decode.py --model preset:granite-4.0-h-tiny --batches 1 32 128 --modes async+graphs
    python scripts/bench_decode.py --model preset:granite-4.0-h-tiny --batches 1 32 --count-kernels --modes
    python scripts/bench_decode.py --model preset:granite-4.0-h-tiny --batches 1 --modes async+graphs --graph-timeline
    python scripts/bench_decode.py --batches 32 128 --modes async+graphs --mamba-ssm-cache-dtype bfloat16
    python scripts/bench_decode.py --batches 1 32 --modes async+graphs --logprobs 1 --repetition-penalty 1.1
    python scripts/bench_decode.py --model preset:nemotron-h-8b --batches 1 32 --modes async+graphs --tensor-parallel-size 2

`--model peer` is a NemotronH config with the shapes of the Megatron-Core peer harness
(../shared/peers/megatron): hidden 1024, pattern M*-M-M*-M-M*-M-M*-M-, relu2 MLP 4096,
16/4 heads, no RoPE, Mamba-2 32x64 heads, 8 groups, state 128, vocab 32768. Weights are
random (load_format="dummy"), bf16. Each row is the median of `--repeats` timed runs after
a warm-up run; the GPU idle fraction and host time per phase come from `StepProbe` (CUDA
events, no profiler). `--hf-batch N` adds HF transformers' `generate` on the same config.

Floors: the bytes one decode step must move over the device copy bandwidth measured in the
same run. Both count Mamba state read + write per sequence (conv + SSM, all Mamba layers)
and the KV read (mean context x KV bytes per token of the attention layers), and an
input embedding table the LM head does not share only as the batch's rows (the step looks
up only those; a shared table counts whole, as the LM head reads it all), plus
- all-weights floor: every other parameter (for a dense model the only floor);
- active-weight floor (MoE models): every other parameter except the routed experts'
  stacked weights (router, shared expert, mixers, norms and LM head stay), plus the
  routed experts the step uses: one eager decode step of the batch (distinct random
  prompts, graph padding rows excluded) with each MoE layer's router output recorded,
  counting distinct experts per layer. The analytic count for uniform routing,
  E * (1 - (1 - k/E)^B), is printed beside the measured one.
`--mamba-ssm-cache-dtype` sets the SSM state pool's dtype (default "auto": float32 for the
peer). Megatron-Core keeps its SSM states in the model dtype, bfloat16 in the peer harness:
`bfloat16` here is the like-for-like setting against it.
`--logprobs K` / `--repetition-penalty P`: every timed request also asks for K top logprobs /
that penalty (decode steps then replay the forward graph and sample eagerly); the probe's
columns (GPU idle, host time per phase), the floors and the expert count stay greedy.
`--count-kernels`: one eager decode step per batch (a separate serial, graphs-off LLM of the
same model) under torch.profiler; CUDA kernels per step, per layer and per layer part
(mamba / attention / mlp / moe mixers, the norms and residual adds between them, the work
outside the layers) with their GPU time. Without CUDA it prints why it skipped.
`--graph-timeline`: after a mode's timed runs, 20 decode steps of each batch on the same LLM
(graphs and launch-ahead as the mode has them) under torch.profiler; each kernel and copy is
charged its marginal time, how far its end lies past the latest end of everything before
it, and idle gaps get a row of their own, so the charges add up to the profiled span and a
kernel's wait for the one before it is not charged to it (graph_timeline.py). The table
lists the kernels by that time per step.
`--tensor-parallel-size N` shards the model over N GPUs (the engine starts N - 1 worker
processes); the floors are then one rank's: its shard of the weights and of the cache
state, which every rank reads at once.
`--modes` with no value skips the timed runs. Prints tables; `--json` also writes the
rows. Numbers and commands: docs/benchmarks.md.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_floors import StepFloors, copy_bandwidth, measure_distinct_experts, step_floors  # noqa: E402
from graph_timeline import print_timeline, profile_graph_steps  # noqa: E402
from step_kernels import report_kernel_counts  # noqa: E402
from step_probe import PROBE_TOKENS, StepProbe, percentile, probe_decode, random_prompts  # noqa: E402

from hybrid_engine import LLM, SamplingParams  # noqa: E402
from hybrid_engine.config import MAMBA_SSM_CACHE_DTYPES  # noqa: E402
from hybrid_engine.models.loader import read_config  # noqa: E402
from hybrid_engine.models.presets import get_preset  # noqa: E402

PEER_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 32768,
    "hidden_size": 1024, "hybrid_override_pattern": "M*-M-M*-M-M*-M-M*-M-", "intermediate_size": 4096,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "mamba_num_heads": 32,
    "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
    "max_position_embeddings": 4096, "eos_token_id": 2,
}
MODES = {
    "async+graphs": dict(async_scheduling=True, cuda_graphs=True),
    "serial+graphs": dict(async_scheduling=False, cuda_graphs=True),
    "serial eager": dict(async_scheduling=False, cuda_graphs=False),
}


def peer_model_dir() -> str:
    """A checkpoint directory holding only the peer-shaped config.json (weights are dummy)."""
    path = tempfile.mkdtemp(prefix="peer-model-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(PEER_CONFIG, f)
    return path


def model_hf_config(model: str) -> dict:
    """The model's config.json dict (a checkpoint directory, or "preset:NAME")."""
    return read_config(model) if os.path.isdir(model) else get_preset(model.removeprefix("preset:"))


def run_batch(llm: LLM, batch: int, prompt_len: int, output_len: int, logprobs: int | None = None,
              repetition_penalty: float = 1.0) -> dict:
    """Generate `batch` greedy requests (with `logprobs` / `repetition_penalty` if given);
    returns throughput and inter-token latencies."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, logprobs=logprobs,
                            repetition_penalty=repetition_penalty)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, engine.model_config.vocab_size)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []
    ttft: list[float] = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.new_token_ids)
            tokens += n
            if o.request_id in last_token_time and n:
                gaps.append((now - last_token_time[o.request_id]) / n)
            elif n:
                ttft.append(now - start)
            last_token_time[o.request_id] = now
    wall = time.perf_counter() - start
    # TTFT: every request is added at `start`; all_first_token_s: until the last request got
    # its first token (every prompt prefilled).
    return dict(tok_s=tokens / wall, itl_mean_ms=1e3 * statistics.fmean(gaps), itl_p50_ms=1e3 * percentile(gaps, 0.5),
                itl_p99_ms=1e3 * percentile(gaps, 0.99), wall_s=wall, ttft_p50_ms=1e3 * percentile(ttft, 0.5),
                ttft_p99_ms=1e3 * percentile(ttft, 0.99), all_first_token_s=max(ttft))


def run_hf_generate(hf_config: dict, batch: int, prompt_len: int, output_len: int) -> dict:
    """Baseline: HF transformers' `generate` (greedy, random bf16 weights built on the GPU)."""
    import transformers

    arch = hf_config["architectures"][0]
    # transformers' torch Mamba-2 scan materializes [batch, chunks, L, L, heads, state]:
    # 64 GB for the 8B preset at batch 32 x 256 with L = 128, so it runs with 32-token
    # chunks (the same math, blocked finer).
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**hf_config, "chunk_size": 32})
    with torch.device("cuda"):
        model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen).cuda()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    del model
    torch.cuda.empty_cache()
    return dict(tok_s=tokens / wall, wall_s=wall, itl_mean_ms=1e3 * wall / output_len)


def floor_columns(floors: StepFloors, bandwidth: float, step_ms: float) -> dict:
    """A row's floor columns (ms at `bandwidth`) and the step's ratios to them; the active
    floor's only for MoE models."""
    all_ms = 1e3 * floors.all_weights / bandwidth
    cols = dict(roofline_ms=all_ms, vs_roofline=step_ms / all_ms)
    if floors.distinct:
        active_ms = 1e3 * floors.active / bandwidth
        cols.update(active_floor_ms=active_ms, vs_active_floor=step_ms / active_ms,
                    analytic_active_floor_ms=1e3 * floors.expected_active / bandwidth,
                    distinct_experts=list(floors.distinct), distinct_experts_mean=statistics.fmean(floors.distinct),
                    analytic_distinct_experts=statistics.fmean(floors.expected_distinct))
    return cols


def time_modes(args: argparse.Namespace, model: str, bandwidth: float) -> list[dict]:
    """The timed rows: every mode x batch, each with its probe and floors."""
    rows = []
    distinct: dict[int, list[int]] = {}  # per batch: routing does not depend on the mode
    for mode in args.modes:
        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_num_batched_tokens=args.max_num_batched_tokens, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                  max_model_len=args.prompt_len + max(args.output_len, PROBE_TOKENS) + 64,
                  tensor_parallel_size=args.tensor_parallel_size, **MODES[mode])
        for batch in args.batches:
            sampling = dict(logprobs=args.logprobs, repetition_penalty=args.repetition_penalty)
            run_batch(llm, batch, args.prompt_len, 4, **sampling)  # warm-up: Triton compiles / autotunes per shape
            runs = sorted((run_batch(llm, batch, args.prompt_len, args.output_len, **sampling)
                           for _ in range(args.repeats)), key=lambda x: x["tok_s"])
            r = runs[len(runs) // 2]  # the median run (host jitter on shared machines moves single runs)
            if batch not in distinct:
                distinct[batch] = measure_distinct_experts(llm, batch, args.prompt_len)
            floors = step_floors(llm.engine, batch, args.prompt_len + args.output_len // 2, distinct[batch])
            probe = probe_decode(llm, batch, args.prompt_len)
            row = dict(mode=mode, batch=batch, tensor_parallel_size=args.tensor_parallel_size,
                       mamba_ssm_cache_dtype=llm.engine.config.mamba_ssm_cache_dtype, **r,
                       **probe, **floor_columns(floors, bandwidth, r["itl_p50_ms"]))
            rows.append(row)
            host = " ".join(f"{k}={probe[f'host_{k}_us']:.0f}" for k in StepProbe.PHASES)
            moe = ""
            if "active_floor_ms" in row:
                moe = (f"  floors all/active {row['roofline_ms']:.3f}/{row['active_floor_ms']:.3f} ms  experts/layer "
                       f"{row['distinct_experts_mean']:.1f} (analytic {row['analytic_distinct_experts']:.1f})  "
                       f"step/active floor {row['vs_active_floor']:.2f}x")
            print(f"{mode:14s} B={batch:4d} {r['tok_s']:9.0f} tok/s  itl mean/p50/p99 {r['itl_mean_ms']:.3f}/"
                  f"{r['itl_p50_ms']:.3f}/{r['itl_p99_ms']:.3f} ms  ttft p50/p99 {r['ttft_p50_ms']:.0f}/"
                  f"{r['ttft_p99_ms']:.0f} ms  idle {probe['gpu_idle']:.1%}  gpu busy "
                  f"{probe['gpu_busy_ms_per_step']:.3f} ms/step  largest gaps {probe['largest_gaps_ms']} ms  prefill "
                  f"{r['all_first_token_s']:.3f} s  step/floor {row['vs_roofline']:.2f}x{moe}  host us/step: {host}",
                  flush=True)
        if args.graph_timeline:  # after the mode's timed runs, which the profiler so stays out of
            for row in rows[len(rows) - len(args.batches):]:
                timeline = profile_graph_steps(llm, row["batch"], args.prompt_len)
                print_timeline(mode, timeline)
                row.update(timeline_us_per_step=timeline.per_step(timeline.span_us),
                           timeline_by_name={name: dict(launches=n.launches / timeline.steps,
                                                        marginal_us=timeline.per_step(n.marginal_us),
                                                        busy_us=timeline.per_step(n.busy_us))
                                             for name, n in timeline.by_name.items()})
        llm.shutdown()  # (stops tensor-parallel workers; frees nothing else)
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    """The timed rows as one markdown table; MoE models get the active-weight floor columns."""
    moe = any("active_floor_ms" in r for r in rows)
    header = "| mode | batch | output tok/s | ITL mean / p50 / p99 (ms) | GPU idle |"
    header += (" all-weights floor (ms) | active-weight floor (ms) | experts / layer: measured (analytic) |"
               " decode step / all-weights floor | decode step / active floor |" if moe
               else " decode step / roofline floor |")
    print(header)
    print("|---" * header.count(" | ") + "|---|")
    for r in rows:
        if "gpu_idle" not in r:  # the HF baseline: throughput and mean step only
            print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_mean_ms']:.2f} (wall / output len) |"
                  + " |" * (header.count(" | ") - 3))
            continue
        cells = [r["mode"], r["batch"], f"{r['tok_s']:.0f}",
                 # Microseconds: batch-1 steps of a small model differ by a few of them.
                 f"{r['itl_mean_ms']:.3f} / {r['itl_p50_ms']:.3f} / {r['itl_p99_ms']:.3f}", f"{r['gpu_idle']:.1%}"]
        if moe:
            cells += [f"{r['roofline_ms']:.3f}", f"{r['active_floor_ms']:.3f}",
                      f"{r['distinct_experts_mean']:.1f} ({r['analytic_distinct_experts']:.1f})"]
        cells.append(f"{r['vs_roofline']:.2f}x")
        if moe:
            cells.append(f"{r['vs_active_floor']:.2f}x")
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="peer", help="'peer', 'preset:NAME' or a checkpoint directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                    help="timed modes (none: no timed runs, e.g. with --count-kernels)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step (prompt steps' budget); default: the engine's (8192 on CUDA)")
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                    help="the SSM state pool's dtype (auto: the config's, else float32); Megatron-Core's "
                         "default is the model dtype (bfloat16 in its peer run)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="every request also returns this many top logprobs per token (default: none)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's repetition penalty (default 1.0: none)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs to shard the model over (default 1); floors are per rank")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median run is reported")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="also time HF transformers generate at this batch (0: skip)")
    ap.add_argument("--count-kernels", action="store_true",
                    help="also count the CUDA kernels of one eager decode step per batch, per layer and layer part")
    ap.add_argument("--graph-timeline", action="store_true",
                    help="also profile 20 decode steps of each timed batch and charge each kernel its marginal time")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    model = peer_model_dir() if args.model == "peer" else args.model
    bandwidth = copy_bandwidth() if args.modes else None
    rows = time_modes(args, model, bandwidth) if args.modes else []
    if args.hf_batch:
        r = run_hf_generate(model_hf_config(model), args.hf_batch, args.prompt_len, args.output_len)
        rows.append(dict(mode="HF transformers generate", batch=args.hf_batch, **r))
        print(f"HF generate    B={args.hf_batch:4d} {r['tok_s']:9.0f} tok/s  mean step {r['itl_mean_ms']:.2f} ms", flush=True)
    if rows:
        print(f"\nmodel {args.model}, tensor parallel size {args.tensor_parallel_size}, prompt {args.prompt_len}, "
              f"output {args.output_len}, bf16, "
              f"mamba_ssm_cache_dtype {rows[0].get('mamba_ssm_cache_dtype', args.mamba_ssm_cache_dtype)}, "
              f"logprobs {args.logprobs}, repetition penalty {args.repetition_penalty}"
              + (f", copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
        print_table(rows)
    if args.count_kernels:
        rows += report_kernel_counts(model, args.model, args.batches, args.prompt_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

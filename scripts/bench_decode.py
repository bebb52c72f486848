"""Decode benchmark: output tok/s, inter-token latency, GPU idle fraction and the memory
roofline floor, for our engine in three modes (async + graphs, serial + graphs, serial eager).

    python scripts/bench_decode.py --model peer --batches 1 8 32 128 --prompt-len 256 --output-len 128
    python scripts/bench_decode.py --model preset:nemotron-h-8b --batches 1 32 --json out.json

`--model peer` is a NemotronH config with the shapes of the Megatron-Core peer harness
(../shared/peers/megatron): hidden 1024, pattern M*-M-M*-M-M*-M-M*-M-, relu2 MLP 4096,
16/4 heads, no RoPE, Mamba-2 32x64 heads, 8 groups, state 128, vocab 32768. Weights are
random (load_format="dummy"), bf16. Prints one table; `--json` also writes the rows.
"""
import argparse
import json
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybrid_engine import LLM, SamplingParams

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


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s (read + write counted), measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3)


def step_bytes(llm: LLM, batch: int, context: int) -> int:
    """Bytes one decode step must move at least: weights, Mamba state (read + write), KV read."""
    engine = llm.engine
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    mamba = engine.mamba
    per_seq_state = (mamba.conv_states[:, 0].numel() * mamba.conv_states.element_size()
                     + mamba.ssm_states[:, 0].numel() * mamba.ssm_states.element_size())
    kv = engine.kv.kv_caches
    per_token_kv = sum(k[0, 0].numel() * k.element_size() * 2 for k, _ in kv)
    return weights + batch * (2 * per_seq_state + context * per_token_kv)


def gpu_idle_fraction(llm: LLM, batch: int, prompt: list[int], steps: int = 24) -> float:
    """Fraction of wall time between the first and last kernel with no kernel running,
    over decode-only steps (the batch is prefilled before profiling starts)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"idle-{i}", prompt, params)
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return float("nan")
    busy, cur_start, cur_end = 0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_end:
            busy, cur_start, cur_end = busy + cur_end - cur_start, s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    return 1.0 - busy / (spans[-1][1] - spans[0][0])


def peer_model_dir() -> str:
    """A checkpoint directory holding only the peer-shaped config.json (weights are dummy)."""
    path = tempfile.mkdtemp(prefix="peer-model-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(PEER_CONFIG, f)
    return path


def run_batch(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    """Generate `batch` requests; returns throughput and inter-token latencies."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []
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
            last_token_time[o.request_id] = now
    wall = time.perf_counter() - start
    gaps.sort()
    return dict(tok_s=tokens / wall, itl_mean_ms=1e3 * statistics.fmean(gaps), itl_p50_ms=1e3 * gaps[len(gaps) // 2],
                itl_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], wall_s=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="peer", help="'peer', 'preset:NAME' or a checkpoint directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    model = peer_model_dir() if args.model == "peer" else args.model
    bandwidth = copy_bandwidth()
    rows = []
    for mode in args.modes:
        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_model_len=args.prompt_len + args.output_len + 64, **MODES[mode])
        for batch in args.batches:
            run_batch(llm, batch, args.prompt_len, 4)  # warm-up: Triton compiles / autotunes per shape
            r = run_batch(llm, batch, args.prompt_len, args.output_len)
            floor_ms = 1e3 * step_bytes(llm, batch, args.prompt_len + args.output_len // 2) / bandwidth
            idle = gpu_idle_fraction(llm, batch, list(range(3, 3 + args.prompt_len)))
            rows.append(dict(mode=mode, batch=batch, **r, gpu_idle=idle, roofline_ms=floor_ms,
                             vs_roofline=r["itl_p50_ms"] / floor_ms))
            print(f"{mode:14s} B={batch:4d} {r['tok_s']:9.0f} tok/s  itl mean/p50/p99 {r['itl_mean_ms']:.2f}/"
                  f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms  idle {idle:.1%}  step/floor "
                  f"{r['itl_p50_ms'] / floor_ms:.2f}x", flush=True)
        del llm
        torch.cuda.empty_cache()
    print(f"\nmodel {args.model}, prompt {args.prompt_len}, output {args.output_len}, bf16, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| mode | batch | output tok/s | ITL mean / p50 / p99 (ms) | GPU idle | decode step / roofline floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_mean_ms']:.2f} / {r['itl_p50_ms']:.2f} / "
              f"{r['itl_p99_ms']:.2f} | {r['gpu_idle']:.1%} | {r['vs_roofline']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

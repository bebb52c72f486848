"""Launch-ahead benchmark: decode step time async vs serial, GPU idle time between steps,
and the cost of the ping-pong shadow state (reading one state copy and writing the other
instead of updating in place) as a share of the step's GPU time.

    python scripts/bench_async.py --model peer --batches 1 16 64

Both modes run with CUDA graphs, bf16, dummy weights; `peer` is the Megatron-peer-shaped
NemotronH config of bench_decode.py.
"""
import argparse
import json

import torch

from bench_decode import peer_model_dir, run_batch
from step_probe import PROBE_TOKENS, probe_decode
from hybrid_engine import LLM


def time_cuda(fn, iters: int = 50) -> float:
    """Median-free mean GPU time of `fn` in ms over `iters` calls, after warm-up."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def shadow_cost_ms(llm: LLM, batch: int) -> float:
    """Extra GPU time per step of ping-pong (src != dst) over in-place (src == dst) for the
    Mamba decode state updates of every Mamba layer (conv + SSM), at this batch."""
    engine, kernels = llm.engine, llm.engine.kernels
    mc, mamba = engine.model_config, engine.mamba
    conv, ssm = mamba.layer_views(0)
    dtype, dev = conv.dtype, conv.device
    x = torch.randn(batch, mc.mamba_conv_dim, dtype=dtype, device=dev)
    w = torch.randn(mc.mamba_conv_dim, mc.conv_kernel, dtype=dtype, device=dev)
    xs = torch.randn(batch, mc.mamba_num_heads, mc.mamba_head_dim, dtype=dtype, device=dev)
    dt = torch.rand(batch, mc.mamba_num_heads, device=dev)
    a = -torch.rand(mc.mamba_num_heads, device=dev)
    bc = torch.randn(batch, mc.mamba_n_groups, mc.ssm_state_size, dtype=dtype, device=dev)
    d = torch.ones(mc.mamba_num_heads, device=dev)
    src = torch.arange(batch, device=dev) * 2
    times = {}
    for name, dst in (("in_place", src), ("ping_pong", src + 1)):
        def step(dst=dst):
            kernels.causal_conv1d_update(x, w, None, conv, src, dst)
            kernels.ssm_state_update(ssm, xs, dt, a, bc, bc, d, src, dst)
        times[name] = time_cuda(step)
    return (times["ping_pong"] - times["in_place"]) * len(mc.mamba_layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="peer")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = peer_model_dir() if args.model == "peer" else args.model
    rows = []
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_model_len=args.prompt_len + max(args.output_len, PROBE_TOKENS) + 64,
                  async_scheduling=async_scheduling)
        for batch in args.batches:
            run_batch(llm, batch, args.prompt_len, 4)
            r = run_batch(llm, batch, args.prompt_len, args.output_len)
            r["gpu_idle"] = probe_decode(llm, batch, args.prompt_len)["gpu_idle"]
            if async_scheduling:
                r["shadow_ms"] = shadow_cost_ms(llm, batch)
            results[(async_scheduling, batch)] = r
        del llm
        torch.cuda.empty_cache()
    print("| batch | serial step p50 (ms) | async step p50 (ms) | async / serial | GPU idle serial | GPU idle async "
          "| ping-pong cost (ms, % of async step) |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        s, a = results[(False, batch)], results[(True, batch)]
        rows.append(dict(batch=batch, serial=s, launch_ahead=a))
        print(f"| {batch} | {s['itl_p50_ms']:.3f} | {a['itl_p50_ms']:.3f} | {a['itl_p50_ms'] / s['itl_p50_ms']:.2f} | "
              f"{s['gpu_idle']:.1%} | {a['gpu_idle']:.1%} | {a['shadow_ms']:.4f} "
              f"({a['shadow_ms'] / a['itl_p50_ms']:.2%}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark the fast GPU ops at nemotron-h-8b layer shapes (not a test).

    PYTHONUNBUFFERED=1 python scripts/bench_kernels.py --json bench_kernels.json
    PYTHONUNBUFFERED=1 python scripts/bench_kernels.py --moe --json bench_moe.json

`--moe` runs the MoE layer table instead (scripts/bench_moe.py: the fused path against the
old one at the granite-4.0-h-tiny and nemotron-3-nano-30b-a3b shapes). `--linear` runs the
projection table instead: `ops.linear` (own kernel where it takes one) against cuBLAS's
`F.linear` on the presets' projection shapes at 1, 16 and 32 rows.

Shapes: hidden 4096; Mamba-2 128 heads x 64, 8 groups, state 128, conv 4 (conv dim 10240);
attention 32 q / 8 kv heads x 128, KV block 64; MoE (nemotron-h-8b has none) at the
Nemotron-3-Nano-30B-A3B expert shape: 128 experts, top-6, hidden 2688, inter 1856, relu2.
Decode at batch 1, 16, 64, 256 with a 4096-token context; prefill one 4096-token sequence.

Ops are timed as CUDA-graph replays of several calls (how the engine runs decode; for
prefill it leaves out the host launch overhead), decode calls rotating over distinct state
slots / KV blocks / expert ids so the L2 cache does not serve repeated reads. All report
the median. Prefill rows also give the summed GPU kernel time (torch.profiler).
Each row gives the bytes the op must move (each input read once, each output written once)
as GB/s, its flops as TFLOP/s where arithmetic matters, and the fraction of the ceiling
measured here (device-to-device copy bandwidth, bf16 matmul rate), whichever is higher.
"""
import argparse
import json
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from layers.kernels.triton import attention, conv1d, linear, moe, norm, ssd, ssm_update

DEV = "cuda"
BF16 = torch.bfloat16
HIDDEN, M_HEADS, M_DIM, M_GROUPS, M_STATE, CONV_K = 4096, 128, 64, 8, 128, 4
CONV_DIM = M_HEADS * M_DIM + 2 * M_GROUPS * M_STATE
Q_HEADS, KV_HEADS, HEAD_DIM, KV_BLOCK = 32, 8, 128, 64
MOE_E, MOE_K, MOE_H, MOE_I = 128, 6, 2688, 1856
CONTEXT, PREFILL = 4096, 4096
L2_BYTES = 50 * 2**20
# What each bench_* builds: the calls to time (rotating inputs), bytes moved, flops.
Case = tuple[list[Callable[[], object]], float, float]


def time_events(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of one call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_graph(calls: list[Callable[[], object]], per_graph: int = 16, reps: int = 20) -> float:
    """Median seconds of one call: `per_graph` calls (cycling over `calls`) captured in one
    CUDA graph, each replay timed with events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    return time_events(graph.replay, reps=reps) / per_graph


def kernel_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """GPU kernel time of one call (torch.profiler, summed over its kernels): excludes the
    host-side launch overhead and sync gaps that an eagerly timed call includes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / reps


def rotations(working_set_bytes: float) -> int:
    """Distinct input sets needed so one graph's calls together exceed the L2 cache."""
    return max(1, min(8, math.ceil(4 * L2_BYTES / max(working_set_bytes, 1))))


def ceilings() -> tuple[float, float]:
    """(device copy bytes/s, read + write counted; bf16 matmul flop/s) on this GPU."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_s = time_events(lambda: dst.copy_(src))
    a, b = torch.randn(8192, 8192, device=DEV, dtype=BF16), torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm_s = time_events(lambda: a @ b)
    return 2 * src.numel() / copy_s, 2 * 8192**3 / mm_s


def bench_ssm_update(batch: int) -> Case:
    state_bytes = batch * M_HEADS * M_DIM * M_STATE * 4
    rot = rotations(2 * state_bytes)
    pool = torch.randn(2 * batch * rot, M_HEADS, M_DIM, M_STATE, device=DEV) * 0.1
    x = torch.randn(batch, M_HEADS, M_DIM, device=DEV, dtype=BF16)
    dt = torch.rand(batch, M_HEADS, device=DEV) * 0.1
    a, d = -torch.rand(M_HEADS, device=DEV), torch.randn(M_HEADS, device=DEV)
    bc = torch.randn(batch, 2, M_GROUPS, M_STATE, device=DEV, dtype=BF16)
    slots = torch.arange(2 * batch * rot, device=DEV).view(rot, 2, batch)
    calls = [lambda r=r: ssm_update.ssm_state_update(pool, x, dt, a, bc[:, 0], bc[:, 1], d, slots[r, 0], slots[r, 1])
             for r in range(rot)]
    moved = 2 * state_bytes + 2 * x.numel() * 2 + bc.numel() * 2 + dt.numel() * 4
    return calls, moved, 0.0


def bench_conv_update(batch: int) -> Case:
    state_bytes = batch * CONV_DIM * (CONV_K - 1) * 2
    rot = rotations(2 * state_bytes)
    pool = torch.randn(2 * batch * rot, CONV_DIM, CONV_K - 1, device=DEV, dtype=BF16)
    x = torch.randn(batch, CONV_DIM, device=DEV, dtype=BF16)
    w, bias = torch.randn(CONV_DIM, CONV_K, device=DEV, dtype=BF16), torch.randn(CONV_DIM, device=DEV, dtype=BF16)
    slots = torch.arange(2 * batch * rot, device=DEV).view(rot, 2, batch)
    calls = [lambda r=r: conv1d.causal_conv1d_update(x, w, bias, pool, slots[r, 0], slots[r, 1]) for r in range(rot)]
    return calls, 2 * state_bytes + 2 * x.numel() * 2, 0.0


def _kv_cache(num_seqs: int, context: int, rot: int):
    blocks_per_seq = context // KV_BLOCK
    shape = (num_seqs * blocks_per_seq * rot, KV_BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEV, dtype=BF16)
    v_cache = torch.randn(shape, device=DEV, dtype=BF16)
    tables = torch.randperm(shape[0], device=DEV).int().view(rot, num_seqs, blocks_per_seq)
    return k_cache, v_cache, tables


def bench_attention_decode(batch: int) -> Case:
    kv_bytes = 2 * batch * CONTEXT * KV_HEADS * HEAD_DIM * 2
    rot = rotations(kv_bytes)
    k_cache, v_cache, tables = _kv_cache(batch, CONTEXT, rot)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device=DEV)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    calls = [lambda r=r: attention.paged_attention(q, k_cache, v_cache, tables[r], lens, cu, HEAD_DIM**-0.5,
                                                   max_seqlen_q=1, num_decode=batch) for r in range(rot)]
    flops = 4 * batch * Q_HEADS * CONTEXT * HEAD_DIM
    return calls, kv_bytes + 2 * q.numel() * 2, flops


def bench_write_kv(tokens: int) -> Case:
    k_cache, v_cache, _ = _kv_cache(1, max(tokens, KV_BLOCK) * 8 // KV_BLOCK * KV_BLOCK, 1)
    kv = torch.randn(tokens, 2, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    slots = torch.randperm(k_cache.shape[0] * KV_BLOCK, device=DEV)[:tokens]
    calls = [lambda: attention.write_kv_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)]
    return calls, 2 * kv.numel() * 2, 0.0


def bench_gated_norm(tokens: int) -> Case:
    d = M_HEADS * M_DIM
    x, z = torch.randn(tokens, d, device=DEV, dtype=BF16), torch.randn(tokens, d, device=DEV, dtype=BF16)
    w = torch.randn(d, device=DEV, dtype=BF16)
    return [lambda: norm.gated_rms_norm(x, z, w, 1e-5, d // M_GROUPS)], 3 * x.numel() * 2, 0.0


def bench_rms_norm(tokens: int) -> Case:
    x, w = torch.randn(tokens, HIDDEN, device=DEV, dtype=BF16), torch.randn(HIDDEN, device=DEV)
    return [lambda: norm.rms_norm(x, w, 1e-5)], 2 * x.numel() * 2, 0.0


def _moe_weights():
    w_up = torch.randn(MOE_E, MOE_I, MOE_H, device=DEV, dtype=BF16) * MOE_H**-0.5
    w_down = torch.randn(MOE_E, MOE_H, MOE_I, device=DEV, dtype=BF16) * MOE_I**-0.5
    return w_up, w_down


def bench_moe_experts(tokens: int, weights: tuple[torch.Tensor, torch.Tensor], fused: bool) -> Case:
    """`moe_experts` (fused) or the sorted-dispatch torch._grouped_mm path it replaced."""
    from bench_moe import sorted_grouped_mm_experts

    w_up, w_down = weights
    rot = 4
    x = torch.randn(tokens, MOE_H, device=DEV, dtype=BF16)
    ids = torch.rand(rot, tokens, MOE_E, device=DEV).argsort(dim=-1)[..., :MOE_K]
    topw = torch.softmax(torch.randn(tokens, MOE_K, device=DEV), dim=-1)
    experts = moe.moe_experts if fused else sorted_grouped_mm_experts
    calls = [lambda r=r: experts(x, w_up, w_down, topw, ids[r], "relu2") for r in range(rot)]
    touched = MOE_E * (1 - (1 - MOE_K / MOE_E) ** tokens)  # expected distinct experts per call
    moved = touched * 2 * MOE_I * MOE_H * 2 + 2 * x.numel() * 2
    return calls, moved, 2 * tokens * MOE_K * 2 * MOE_I * MOE_H


def bench_conv_prefill() -> Case:
    x = torch.randn(PREFILL, CONV_DIM, device=DEV, dtype=BF16)
    w, bias = torch.randn(CONV_DIM, CONV_K, device=DEV, dtype=BF16), torch.randn(CONV_DIM, device=DEV, dtype=BF16)
    pool = torch.randn(2, CONV_DIM, CONV_K - 1, device=DEV, dtype=BF16)
    cu = torch.tensor([0, PREFILL], dtype=torch.int32, device=DEV)
    src, dst = torch.tensor([0], device=DEV), torch.tensor([1], device=DEV)
    return [lambda: conv1d.causal_conv1d_varlen(x, w, bias, pool, cu, src, dst)], 2 * x.numel() * 2, 0.0


def bench_ssd_prefill(num_seqs: int) -> Case:
    """`num_seqs` prompts packed into PREFILL tokens (one long prompt, or a prefill batch)."""
    x = torch.randn(PREFILL, M_HEADS, M_DIM, device=DEV, dtype=BF16)
    dt = torch.rand(PREFILL, M_HEADS, device=DEV) * 0.1
    a, d = -torch.rand(M_HEADS, device=DEV), torch.randn(M_HEADS, device=DEV)
    bc = torch.randn(PREFILL, 2, M_GROUPS, M_STATE, device=DEV, dtype=BF16)
    pool = torch.randn(2 * num_seqs, M_HEADS, M_DIM, M_STATE, device=DEV) * 0.1
    cu = torch.arange(0, PREFILL + 1, PREFILL // num_seqs, dtype=torch.int32, device=DEV)
    src = torch.arange(num_seqs, device=DEV)
    dst = src + num_seqs
    call = lambda: ssd.ssd_chunk_scan_varlen(x, dt, a, bc[:, 0], bc[:, 1], d, cu, pool, src, dst)  # noqa: E731
    moved = 2 * x.numel() * 2 + bc.numel() * 2 + dt.numel() * 4 + pool.numel() * 4
    # Chunked SSD with 64-token chunks: intra-chunk C.B^T and its product with X, plus the
    # chunk state and its read-out (2 * P * N each), per token and head.
    flops = PREFILL * M_HEADS * (2 * 64 * (M_STATE + M_DIM) + 4 * M_DIM * M_STATE)
    return [call], moved, flops


def bench_attention_prefill() -> Case:
    k_cache, v_cache, tables = _kv_cache(1, PREFILL, 1)
    q = torch.randn(PREFILL, Q_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    lens = torch.tensor([PREFILL], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, PREFILL], dtype=torch.int32, device=DEV)
    call = lambda: attention.paged_attention(q, k_cache, v_cache, tables[0], lens, cu, HEAD_DIM**-0.5,  # noqa: E731
                                             max_seqlen_q=PREFILL, num_decode=0)
    flops = 2 * PREFILL * PREFILL * HEAD_DIM * Q_HEADS  # causal half of 4 * T^2 * Dh * H
    return [call], 2 * q.numel() * 2 + 2 * k_cache.numel() * 2, flops


# (N, K) of each preset's dense projections (weight [N, K]; bf16).
LINEAR_SHAPES = {
    "peer in_proj": (6176, 1024), "peer out_proj": (1024, 2048), "peer q / o": (1024, 1024),
    "peer k / v": (256, 1024), "peer MLP up": (4096, 1024), "peer MLP down": (1024, 4096),
    "peer LM head": (32768, 1024),
    "granite-4.0-h-tiny in_proj": (6448, 1536), "granite-4.0-h-tiny out_proj": (1536, 3072),
    "granite-4.0-h-tiny q / o": (1536, 1536), "granite-4.0-h-tiny k / v": (512, 1536),
    "granite-4.0-h-tiny router": (64, 1536), "granite-4.0-h-tiny LM head": (100352, 1536),
    "nemotron-h-8b in_proj": (18560, 4096), "nemotron-h-8b out_proj": (4096, 8192),
    "nemotron-h-8b MLP up": (21504, 4096), "nemotron-h-8b MLP down": (4096, 21504),
    "nemotron-3-nano-30b-a3b in_proj": (10304, 2688), "nemotron-3-nano-30b-a3b out_proj": (2688, 4096),
    "nemotron-3-nano-30b-a3b LM head": (131072, 2688),
}
LINEAR_ROWS = (1, 16, 32)


def run_linear(copy_bw: float) -> list[dict]:
    """The projection table: per shape and row count, cuBLAS and `linear.linear` (weights
    rotated out of the L2; 32 calls per CUDA graph, so the op's kernels follow each other
    as a decode step's do, with programmatic dependent launch where it applies)."""
    rows = []
    print(f"| {'projection (N x K)':<42} | rows | own kernel (BLOCK_N x BLOCK_K, split) | cuBLAS us | op us | op / cuBLAS | op % copy rate |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in LINEAR_SHAPES.items():
        weights = [torch.randn(n, k, device=DEV, dtype=BF16) for _ in range(rotations(2 * n * k))]
        for m in LINEAR_ROWS:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            cublas = time_graph([lambda w=w: F.linear(x, w) for w in weights], per_graph=32)
            op = time_graph([lambda w=w: linear.linear(x, w) for w in weights], per_graph=32)
            own = linear.takes_kernel(x, weights[0], None)
            tiles = linear.tiling(n, k)
            order = ", weight-major" if tiles.weight_major else ""
            tiles_text = f"{tiles.block_n} x {tiles.block_k}, split {tiles.split}{order}" if own else "(cuBLAS)"
            rows.append(dict(projection=name, n=n, k=k, rows=m, own_kernel=own, tiling=tiles_text, cublas_us=cublas * 1e6,
                             op_us=op * 1e6, frac_of_copy=2 * n * k / op / copy_bw))
            print(f"| {name + f' ({n} x {k})':<42} | {m} | {tiles_text} | {cublas * 1e6:.1f} | "
                  f"{op * 1e6:.1f} | {op / cublas:.3f} | {100 * rows[-1]['frac_of_copy']:.0f}% |", flush=True)
        weights = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="bench_kernels.json", help="where to write the rows as JSON")
    table = parser.add_mutually_exclusive_group()
    table.add_argument("--moe", action="store_true", help="the MoE layer table (scripts/bench_moe.py) instead")
    table.add_argument("--linear", action="store_true", help="the projection table (ops.linear vs cuBLAS) instead")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bw, mm_rate = ceilings()
    print(f"device: {torch.cuda.get_device_name()}  ceilings: copy {copy_bw / 1e9:.0f} GB/s, "
          f"bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s")
    if args.moe:
        import bench_moe

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9,
                       "rows": bench_moe.run(copy_bw)}, f, indent=1)
        return
    if args.linear:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9,
                       "rows": run_linear(copy_bw)}, f, indent=1)
        return
    moe_w = _moe_weights()
    cases: list[tuple[str, str, Callable[[], Case]]] = []
    for batch in (1, 16, 64, 256):
        tag = f"decode b={batch}"
        cases += [
            ("ssm_state_update", tag, lambda b=batch: bench_ssm_update(b)),
            ("causal_conv1d_update", tag, lambda b=batch: bench_conv_update(b)),
            ("paged_attention", tag + " ctx=4k", lambda b=batch: bench_attention_decode(b)),
            ("write_kv_cache", tag, lambda b=batch: bench_write_kv(b)),
            ("gated_rms_norm", tag, lambda b=batch: bench_gated_norm(b)),
            ("rms_norm", tag, lambda b=batch: bench_rms_norm(b)),
            ("moe_experts (fused)", tag, lambda b=batch: bench_moe_experts(b, moe_w, True)),
            ("moe_experts (old grouped_mm)", tag, lambda b=batch: bench_moe_experts(b, moe_w, False)),
        ]
    tag = f"prefill T={PREFILL}"
    cases += [
        ("ssd_chunk_scan_varlen", tag, lambda: bench_ssd_prefill(1)),
        ("ssd_chunk_scan_varlen", tag + " 32 seqs", lambda: bench_ssd_prefill(32)),
        ("causal_conv1d_varlen", tag, bench_conv_prefill),
        ("paged_attention", tag, bench_attention_prefill),
        ("write_kv_cache", tag, lambda: bench_write_kv(PREFILL)),
        ("gated_rms_norm", tag, lambda: bench_gated_norm(PREFILL)),
        ("rms_norm", tag, lambda: bench_rms_norm(PREFILL)),
        ("moe_experts (fused)", tag, lambda: bench_moe_experts(PREFILL, moe_w, True)),
        ("moe_experts (old grouped_mm)", tag, lambda: bench_moe_experts(PREFILL, moe_w, False)),
    ]
    rows = []
    for op, case, build in cases:
        try:
            calls, moved, flops = build()
            seconds, how = time_graph(calls, per_graph=16 if case.startswith("decode") else 4), "graph"
            kernel_s = kernel_seconds(calls[0]) if not case.startswith("decode") else None
        except Exception as exc:  # one broken case must not hide the rest of the table
            print(f"{op} {case}: FAILED {type(exc).__name__}: {exc}")
            continue
        finally:
            calls = None
            torch.cuda.empty_cache()
        rows.append({"op": op, "case": case, "us": seconds * 1e6, "timing": how,
                     "kernel_us": kernel_s * 1e6 if kernel_s is not None else None,
                     "GB/s": moved / seconds / 1e9, "TFLOP/s": flops / seconds / 1e12, "bytes": moved, "flops": flops,
                     "frac_of_ceiling": max(moved / seconds / copy_bw, flops / seconds / mm_rate)})
    header = (f"| {'op':<26} | {'case':<20} | {'time us':>9} | {'kernels us':>10} | {'GB/s':>7} | {'TFLOP/s':>7} "
              f"| {'% ceiling':>9} |")
    print(header)
    print("|" + "|".join("-" * (len(part)) for part in header.split("|")[1:-1]) + "|")
    for r in rows:
        kernel = f"{r['kernel_us']:.1f}" if r["kernel_us"] is not None else "-"
        print(f"| {r['op']:<26} | {r['case']:<20} | {r['us']:>9.1f} | {kernel:>10} | {r['GB/s']:>7.0f} | "
              f"{r['TFLOP/s']:>7.1f} | {100 * r['frac_of_ceiling']:>8.1f}% |")
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9,
                   "bf16_matmul_TFLOPs": mm_rate / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

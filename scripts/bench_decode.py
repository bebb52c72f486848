"""Decode benchmark: output tok/s, inter-token latency, GPU idle fraction and the memory
roofline floor, for our engine in three modes (async + graphs, serial + graphs, serial eager).

    python scripts/bench_decode.py --model peer --batches 1 8 32 128 256 --prompt-len 256 --output-len 128
    python scripts/bench_decode.py --model preset:nemotron-h-8b --batches 1 8 --hf-batch 8 --json out.json

`--model peer` is a NemotronH config with the shapes of the Megatron-Core peer harness
(../shared/peers/megatron): hidden 1024, pattern M*-M-M*-M-M*-M-M*-M-, relu2 MLP 4096,
16/4 heads, no RoPE, Mamba-2 32x64 heads, 8 groups, state 128, vocab 32768. Weights are
random (load_format="dummy"), bf16. Each row is the median of `--repeats` timed runs after
a warm-up run; the GPU idle fraction and host time per phase come from `StepProbe` (CUDA
events, no profiler). `--hf-batch N` adds HF transformers' `generate` on the same config.
Prints one table; `--json` also writes the rows. Numbers and commands: docs/benchmarks.md.
"""
import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.loader import read_config
from hybrid_engine.models.presets import get_preset

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


class StepProbe:
    """Instruments an engine for a few decode steps without a profiler.

    GPU idle: a timing event is recorded just before each step's host-to-device copy
    (the first device work of a step) and just after its sample copy (the last). The GPU
    is idle between one step's end and the next step's start whenever the host had not
    yet enqueued the next step; idle fraction = 1 - sum(end_i - start_i) / (end_last -
    start_first). Host phases: wall time the CPU spends in each call of the step loop
    (`wait` is the time blocked on the device).
    """

    PHASES = ("schedule", "prepare", "launch", "wait", "retire", "reconcile")

    def __init__(self, engine):
        self.engine = engine
        self.starts: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []
        self.host = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def _timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[phase] += time.perf_counter() - t0
        return wrapper

    def _event(self, into: list):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        into.append(ev)

    def run(self, steps: int) -> dict:
        """Run `steps` engine steps instrumented; returns idle fraction and host µs per step."""
        engine = self.engine
        runner, buffer = engine.runner, engine.runner.buffer
        sync, launch = buffer.sync, runner.launch

        def probed_sync():
            self._event(self.starts)
            sync()

        def probed_launch(plan):
            handle = launch(plan)
            self._event(self.ends)
            handle.wait = self._timed("wait", handle.wait)
            return handle

        patches = {(buffer, "sync"): probed_sync, (runner, "launch"): self._timed("launch", probed_launch),
                   (runner, "prepare"): self._timed("prepare", runner.prepare),
                   (engine.scheduler, "schedule"): self._timed("schedule", engine.scheduler.schedule),
                   (engine, "_retire"): self._timed("retire", engine._retire),
                   (engine, "_reconcile"): self._timed("reconcile", engine._reconcile)}
        for (obj, name), fn in patches.items():
            setattr(obj, name, fn)
        if engine._inflight is not None:  # the in-flight step's wait was not wrapped
            engine._inflight.wait = self._timed("wait", engine._inflight.wait)
        try:
            for _ in range(steps):
                engine.step()
        finally:
            for obj, name in patches:
                delattr(obj, name)
        torch.cuda.synchronize()
        # The first recorded end may belong to a step launched before probing began.
        pairs = list(zip(self.starts, self.ends[len(self.ends) - len(self.starts):]))
        busy = sum(s.elapsed_time(e) for s, e in pairs)
        wall = pairs[0][0].elapsed_time(pairs[-1][1])
        gaps = sorted((e.elapsed_time(s) for (_, e), (s, _) in zip(pairs, pairs[1:])), reverse=True)
        return dict(gpu_idle=1.0 - busy / wall, gpu_busy_ms_per_step=busy / len(pairs),
                    largest_gaps_ms=[round(g, 3) for g in gaps[:3]],
                    **{f"host_{k}_us": 1e6 * v / steps for k, v in self.host.items()})


def probe_decode(llm: LLM, batch: int, prompt: list[int], steps: int = 96) -> dict:
    """GPU idle fraction and host time per phase over decode-only steps (the batch is
    prefilled and a few decode steps run before probing)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"idle-{i}", prompt, params)
    while any(r.num_computed < len(r.prompt_token_ids) + 4 for r in engine.requests.values()):
        engine.step()
    result = StepProbe(engine).run(steps)
    while engine.has_unfinished_requests():
        engine.step()
    return result


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
    first_token_time = start
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.new_token_ids)
            tokens += n
            if o.request_id in last_token_time and n:
                gaps.append((now - last_token_time[o.request_id]) / n)
            elif n:
                first_token_time = now
            last_token_time[o.request_id] = now
    wall = time.perf_counter() - start
    gaps.sort()
    # all_first_token_s: until the last request got its first token (every prompt prefilled).
    return dict(tok_s=tokens / wall, itl_mean_ms=1e3 * statistics.fmean(gaps), itl_p50_ms=1e3 * gaps[len(gaps) // 2],
                itl_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], wall_s=wall,
                all_first_token_s=first_token_time - start)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="peer", help="'peer', 'preset:NAME' or a checkpoint directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median run is reported")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="also time HF transformers generate at this batch (0: skip)")
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
            runs = sorted((run_batch(llm, batch, args.prompt_len, args.output_len) for _ in range(args.repeats)),
                          key=lambda x: x["tok_s"])
            r = runs[len(runs) // 2]  # the median run (host jitter on shared machines moves single runs)
            floor_ms = 1e3 * step_bytes(llm, batch, args.prompt_len + args.output_len // 2) / bandwidth
            probe = probe_decode(llm, batch, list(range(3, 3 + args.prompt_len)))
            rows.append(dict(mode=mode, batch=batch, **r, **probe, roofline_ms=floor_ms,
                             vs_roofline=r["itl_p50_ms"] / floor_ms))
            host = " ".join(f"{k}={probe[f'host_{k}_us']:.0f}" for k in StepProbe.PHASES)
            print(f"{mode:14s} B={batch:4d} {r['tok_s']:9.0f} tok/s  itl mean/p50/p99 {r['itl_mean_ms']:.2f}/"
                  f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms  idle {probe['gpu_idle']:.1%}  gpu busy "
                  f"{probe['gpu_busy_ms_per_step']:.3f} ms/step  largest gaps {probe['largest_gaps_ms']} ms  prefill {r['all_first_token_s']:.3f} s  step/floor {r['itl_p50_ms'] / floor_ms:.2f}x  "
                  f"host us/step: {host}", flush=True)
        del llm
        gc.collect()  # the engine holds reference cycles: free its memory before the next one
        torch.cuda.empty_cache()
    if args.hf_batch:
        hf_config = read_config(model) if os.path.isdir(model) else get_preset(model.removeprefix("preset:"))
        r = run_hf_generate(hf_config, args.hf_batch, args.prompt_len, args.output_len)
        rows.append(dict(mode="HF transformers generate", batch=args.hf_batch, **r))
        print(f"HF generate    B={args.hf_batch:4d} {r['tok_s']:9.0f} tok/s  mean step {r['itl_mean_ms']:.2f} ms", flush=True)
    print(f"\nmodel {args.model}, prompt {args.prompt_len}, output {args.output_len}, bf16, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| mode | batch | output tok/s | ITL mean / p50 / p99 (ms) | GPU idle | decode step / roofline floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "gpu_idle" not in r:  # the HF baseline: throughput and mean step only
            print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_mean_ms']:.2f} (wall / output len) | | |")
            continue
        print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_mean_ms']:.2f} / {r['itl_p50_ms']:.2f} / "
              f"{r['itl_p99_ms']:.2f} | {r['gpu_idle']:.1%} | {r['vs_roofline']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

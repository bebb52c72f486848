"""`mamba_ssm_cache_dtype`: what a bfloat16 (or float16) SSM state cache buys in decode
speed and what it costs in accuracy, against the float32 cache.

    python scripts/bench_ssm_cache_dtype.py                                  # CUDA, peer shapes
    python scripts/bench_ssm_cache_dtype.py --model preset:nemotron-h-8b --batches 32 128
    python scripts/bench_ssm_cache_dtype.py --device cpu                     # smoke: embedded model

Speed: decode tok/s at each batch (async + CUDA graphs, dummy weights, model dtype bf16 on
CUDA): every request is prefilled and decoding before `--steps` steps are timed; each row
is the median of `--repeats` timed runs after a warm-up run. `state MiB/req` is the Mamba
state one request holds (conv + SSM, every copy), which is what the pool sizing divides
the memory by.

Accuracy: `--drift-prompts` greedy generations of `--drift-len` tokens with the float32
cache, then the same with each other cache dtype *teacher-forced* on the float32 run's
tokens (serial scheduling; the sampled token is swapped for the reference's before the
bookkeeping appends it, so every position decodes the same history through the decode
path and only the cache dtype differs). Per position: |logprob of the reference token|
difference (max / mean / p99) and whether the forced run's own greedy choice equals the
reference token (`argmax agree`). `free agree`: the share of positions where an unforced
greedy run's tokens equal the reference's, and the mean position of the first
difference. Dummy weights give near-uniform logits (the reference's mean logprob is
printed), so drift is in absolute nats of that model; use a real checkpoint directory as
`--model` to measure a trained model's. Numbers and commands: docs/cache.md.
"""
import argparse
import gc
import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import peer_model_dir  # noqa: E402

from hybrid_engine import LLM, SamplingParams  # noqa: E402
from hybrid_engine.config import MAMBA_SSM_CACHE_DTYPES  # noqa: E402
from hybrid_engine.sampling_params import MAX_LOGPROBS  # noqa: E402

_ids = itertools.count()


@dataclass
class Trace:
    """One greedy generation: per position the token fed back, its logprob (NaN when it is
    outside the top MAX_LOGPROBS), and the run's own greedy choice."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)


def greedy_traces(llm: LLM, prompts: list[list[int]], output_len: int,
                  forced: list[list[int]] | None = None) -> list[Trace]:
    """Greedy generations of `output_len` tokens; with `forced`, prompt i's position j is fed
    forced[i][j] whatever the model picks (teacher forcing; needs serial scheduling, where
    each step's inputs come from the host's token history)."""
    engine = llm.engine
    if forced is not None and engine.config.async_scheduling:
        raise ValueError("teacher forcing needs LLM(..., async_scheduling=False)")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS)
    ids = [f"trace-{next(_ids)}" for _ in prompts]
    traces = {rid: Trace() for rid in ids}
    targets = dict(zip(ids, forced or []))
    retire = engine.scheduler.retire

    def forcing_retire(chunks, valid, token_ids, logprobs, verified=None, dt_limit_hits=None):
        token_ids = list(token_ids)
        for i, chunk in enumerate(chunks):
            trace = traces.get(chunk.request.request_id)
            if trace is None or not (chunk.samples and valid[i]):
                continue
            sampled = token_ids[i]
            token = targets[chunk.request.request_id][len(trace.tokens)] if targets else sampled
            trace.argmax.append(sampled)
            trace.tokens.append(token)
            trace.logprobs.append(dict(logprobs[i]).get(token, math.nan))
            token_ids[i] = token
        return retire(chunks, valid, token_ids, logprobs, verified, dt_limit_hits)

    engine.scheduler.retire = forcing_retire
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.scheduler.retire
    return [traces[rid] for rid in ids]


def logprob_drift(reference: list[Trace], forced: list[Trace]) -> dict:
    """|logprob difference| of the reference tokens between a reference run and a run
    teacher-forced on its tokens, and how often the forced run's greedy choice agrees."""
    diffs, agree, total, missing = [], 0, 0, 0
    for ref, run in zip(reference, forced):
        assert run.tokens == ref.tokens, "the forced run must have been fed the reference's tokens"
        for token, lp_ref, lp, choice in zip(ref.tokens, ref.logprobs, run.logprobs, run.argmax):
            total += 1
            agree += choice == token
            if math.isnan(lp):
                missing += 1
            else:
                diffs.append(abs(lp - lp_ref))
    diffs.sort()
    return dict(max=diffs[-1], mean=statistics.fmean(diffs), p99=diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))],
                argmax_agree=agree / total, outside_top=missing,
                ref_mean_logprob=statistics.fmean(lp for t in reference for lp in t.logprobs))


def token_agreement(reference: list[Trace], free: list[Trace]) -> dict:
    """Share of positions where a free-running greedy run's tokens equal the reference's,
    and the mean position of the first difference (the length when there is none)."""
    same = [[a == b for a, b in zip(r.tokens, f.tokens)] for r, f in zip(reference, free)]
    first = [s.index(False) if False in s else len(s) for s in same]
    return dict(agree=sum(map(sum, same)) / sum(map(len, same)), first_diff=statistics.fmean(first))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Output tok/s over `steps` decode-only steps of `batch` requests."""
    engine, device = llm.engine, llm.engine.config.device
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(f"decode-{next(_ids)}", torch.randint(3, engine.model_config.vocab_size, (prompt_len,),
                                                                 generator=gen).tolist(), params)
    while any(len(r.output_token_ids) < 4 for r in engine.requests.values()):  # prefilled, decoding
        engine.step()
    sync(device)
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync(device)
    wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / wall


def state_mib_per_request(llm: LLM) -> float:
    """Mamba state (conv + SSM, every copy a request owns) of one request, in MiB."""
    mamba = llm.engine.mamba
    slot = sum(t[:, 0].numel() * t.element_size() for t in (mamba.conv_states, mamba.ssm_states))
    return slot * mamba.copies_per_request / 2**20


def release(llm: LLM) -> None:
    """Free an engine's device memory before the next one is built."""
    del llm.engine
    gc.collect()  # the engine holds reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", default=None,
                    help="'peer', 'preset:NAME' or a checkpoint directory (default: peer on CUDA, embedded on CPU)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=MAMBA_SSM_CACHE_DTYPES[1:],
                    help="SSM cache dtypes; the first is the reference")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 32 128 (CUDA), 4 (CPU)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 256 (CUDA), 16 (CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps; default: 128 (CUDA), 8 (CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drift-prompts", type=int, default=None, help="default: 8 (CUDA), 2 (CPU)")
    ap.add_argument("--drift-len", type=int, default=None, help="generated tokens; default: 512 (CUDA), 32 (CPU)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the embedded model is tiny: intra-op threads only contend
    batches = args.batches or ([32, 128] if cuda else [4])
    prompt_len = args.prompt_len or (256 if cuda else 16)
    steps = args.steps or (128 if cuda else 8)
    drift_prompts, drift_len = args.drift_prompts or (8 if cuda else 2), args.drift_len or (512 if cuda else 32)
    name = args.model or ("peer" if cuda else None)
    model = peer_model_dir() if name == "peer" else name
    # A checkpoint directory of the user's is loaded; the peer's (a config alone), a preset and
    # the embedded model get random weights of their shapes.
    trained = name not in (None, "peer") and os.path.isdir(name)
    base = dict(model=model, device=args.device, dtype="bfloat16" if cuda else "float32",
                load_format="auto" if trained else "dummy")

    speed = {}
    for dtype in args.dtypes:
        llm = LLM(**base, mamba_ssm_cache_dtype=dtype, max_num_seqs=max(batches),
                  max_model_len=prompt_len + steps + 64, async_scheduling=True, cuda_graphs=True)
        speed[dtype] = dict(state_mib=state_mib_per_request(llm))
        for batch in batches:
            decode_tok_s(llm, batch, prompt_len, 4)  # warm-up: Triton compiles per shape
            speed[dtype][batch] = statistics.median(decode_tok_s(llm, batch, prompt_len, steps)
                                                    for _ in range(args.repeats))
            print(f"ssm cache {dtype:8s} B={batch:4d} {speed[dtype][batch]:9.0f} tok/s", flush=True)
        release(llm)

    # Same engine shape and schedule in every run, so request i ends in the same state
    # slot: the pools after the reference and the forced runs hold comparable final states.
    reference, forced, free, final_states = None, {}, {}, {}
    for dtype in args.dtypes:
        llm = LLM(**base, mamba_ssm_cache_dtype=dtype, max_num_seqs=drift_prompts,
                  max_model_len=prompt_len + drift_len + 16, async_scheduling=False)
        if reference is None:
            gen = torch.Generator().manual_seed(0)
            vocab = llm.engine.model_config.vocab_size
            prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(drift_prompts)]
            reference = greedy_traces(llm, prompts, drift_len)
        else:
            forced[dtype] = greedy_traces(llm, prompts, drift_len, forced=[t.tokens for t in reference])
        final_states[dtype] = llm.engine.mamba.ssm_states.to("cpu", torch.float32)
        if dtype != args.dtypes[0]:
            free[dtype] = greedy_traces(llm, prompts, drift_len)
        release(llm)

    print(f"\nmodel {name or 'embedded'}, device {args.device}, model dtype {base['dtype']}, prompt {prompt_len}; "
          f"speed: {steps} decode steps, async + graphs; accuracy: {drift_prompts} x {drift_len} greedy tokens "
          f"against the {args.dtypes[0]} cache (reference mean logprob "
          f"{statistics.fmean(lp for t in reference for lp in t.logprobs):.3f})")
    print("| ssm cache | state MiB/req | " + " | ".join(f"B={b} tok/s" for b in batches)
          + " | max / mean / p99 abs dlogprob | argmax agree (forced) | final SSM state rel. err"
          " | free agree, first diff at |")
    print("|---|---|" + "---|" * len(batches) + "---|---|---|---|")
    for dtype in args.dtypes:
        cells = [f"{speed[dtype][b]:.0f}" + (f" ({speed[dtype][b] / speed[args.dtypes[0]][b]:.2f}x)"
                                              if dtype != args.dtypes[0] else "") for b in batches]
        if dtype == args.dtypes[0]:
            accuracy = ["reference", "", "", ""]
        else:
            drift, agree = logprob_drift(reference, forced[dtype]), token_agreement(reference, free[dtype])
            outside = f" ({drift['outside_top']} outside top {MAX_LOGPROBS})" if drift["outside_top"] else ""
            ref_states = final_states[args.dtypes[0]]
            state_err = ((final_states[dtype] - ref_states).norm() / ref_states.norm()).item()
            accuracy = [f"{drift['max']:.2e} / {drift['mean']:.2e} / {drift['p99']:.2e}",
                        f"{drift['argmax_agree']:.2%}{outside}", f"{state_err:.2e}",
                        f"{agree['agree']:.2%}, {agree['first_diff']:.0f}"]
        print(f"| {dtype} | {speed[dtype]['state_mib']:.2f} | " + " | ".join(cells + accuracy) + " |")


if __name__ == "__main__":
    main()

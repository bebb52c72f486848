"""What one persistent kernel would save at batch 1: a chain of decode projections run as our
ops in a CUDA graph against the same chain in one kernel with a grid barrier between its ops.

    python scripts/bench_persistent.py

A decode step at batch 1 is a chain of small dependent kernels, and each kernel boundary
costs its own launch, ramp-up and drain even as a programmatic dependent launch in a graph
(docs/benchmarks.md: the peer's step is 94 kernels, granite-4.0-h-tiny's 505). A persistent
kernel runs every op of the chain in one launch, its programs resident on the SMs, and
waits at a grid barrier (an arrival counter) where one op needs the previous op's whole
output. This script measures the difference on the peer's MLP layers, L x (up 4096 x 1024
+ relu^2, down 1024 x 4096), one row:
- `ops`: `linear_relu_square` then `linear` per layer, our production decode kernels, in
  one CUDA graph;
- `persistent`: one Triton kernel; each of its G programs owns I / G rows of every up
  projection and H / G rows of every down projection, reads the op's input vector after
  the barrier, and multiplies in float32 on the CUDA cores (a row is far too little for
  the tensor cores); one variant loads the program's next weight slab before it waits at
  the barrier, another is a cooperative launch (the driver refuses it, rather than letting
  it hang, when its programs cannot all be resident at once);
- the grid barriers alone (64 per launch, no work between them).
The weights (134 MB for 8 layers) are larger than the L2, so every call reads them from
memory; the floor is their bytes over the device copy rate measured in the same run. Each
persistent variant is checked op by op against float32 torch from its own inputs first.
This is a prototype kernel for the measurement (no model calls it): docs/benchmarks.md,
"Session 21", says what the numbers mean for a decode megakernel.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_floors import copy_bandwidth  # noqa: E402

from layers.kernels.triton.device import sm_count  # noqa: E402
from layers.kernels.triton.linear import linear, linear_relu_square  # noqa: E402

HIDDEN, INTERMEDIATE = 1024, 4096  # the peer's MLP (scripts/bench_decode.py, PEER_CONFIG)
BARRIERS = 64  # in the barriers-only launch


@triton.jit
def _arrive_and_wait(counter_ptr, target):
    """A grid barrier: count this program in, then spin until `target` programs have."""
    tl.debug_barrier()  # every thread's stores are issued before the arrival releases them
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _chain_kernel(x_ptr, up_ptr, down_ptr, hidden_ptr, out_ptr, counter_ptr, G: tl.constexpr, L: tl.constexpr,
                  H: tl.constexpr, I: tl.constexpr, RU: tl.constexpr, RD: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    ku, kd = tl.arange(0, H), tl.arange(0, I)
    ru, rd = pid * RU + tl.arange(0, RU), pid * RD + tl.arange(0, RD)
    for layer in tl.static_range(L):
        up_tile = up_ptr + layer * I * H + ru[:, None] * H + ku[None, :]
        if PREFETCH:
            w = tl.load(up_tile)
        if layer > 0:  # the previous layer's down projection is whole
            _arrive_and_wait(counter_ptr, 2 * layer * G)
        if not PREFETCH:
            w = tl.load(up_tile)
        if layer == 0:
            v = tl.load(x_ptr + ku).to(tl.float32)
        else:
            v = tl.load(out_ptr + (layer - 1) * H + ku, cache_modifier=".cg").to(tl.float32)
        y = tl.sum(w.to(tl.float32) * v[None, :], axis=1).to(tl.bfloat16).to(tl.float32)
        y = tl.where(y < 0, 0.0, y)
        tl.store(hidden_ptr + layer * I + ru, (y * y).to(tl.bfloat16))
        down_tile = down_ptr + layer * H * I + rd[:, None] * I + kd[None, :]
        if PREFETCH:
            w2 = tl.load(down_tile)
        _arrive_and_wait(counter_ptr, (2 * layer + 1) * G)  # this layer's up projection is whole
        if not PREFETCH:
            w2 = tl.load(down_tile)
        v2 = tl.load(hidden_ptr + layer * I + kd, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + layer * H + rd, tl.sum(w2.to(tl.float32) * v2[None, :], axis=1).to(tl.bfloat16))


@triton.jit
def _barriers_kernel(counter_ptr, N: tl.constexpr, G: tl.constexpr):
    for n in tl.static_range(N):
        _arrive_and_wait(counter_ptr, (n + 1) * G)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="MLP layers in the chain")
    ap.add_argument("--replays", type=int, default=200, help="graph replays per timing (the median of 5 is kept)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_persistent.py needs a CUDA GPU; skipped")
        return
    run(args.layers, args.replays)


def run(layers: int, replays: int) -> None:
    """Build the chain, check each persistent variant, time everything, print the table."""
    torch.manual_seed(0)
    h, i, dev = HIDDEN, INTERMEDIATE, torch.device("cuda")
    # Scales that keep the chain's activations finite and non-zero over 8 layers of relu^2.
    up = torch.randn(layers, i, h, device=dev, dtype=torch.bfloat16) / 32
    down = torch.randn(layers, h, i, device=dev, dtype=torch.bfloat16) / 80
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    hidden = torch.empty(layers, i, device=dev, dtype=torch.bfloat16)
    out = torch.empty(layers, h, device=dev, dtype=torch.bfloat16)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    # A power of two of programs, at most one per SM, so that every program is resident
    # (16 warps each) and the barriers return.
    programs = 1 << (min(sm_count(dev), h).bit_length() - 1)

    def ops_chain() -> None:
        y = x
        for layer in range(layers):
            y = linear(linear_relu_square(y, up[layer]), down[layer])

    def persistent(prefetch: bool, cooperative: bool = False) -> None:
        counter.zero_()
        _chain_kernel[(programs,)](x, up, down, hidden, out, counter, G=programs, L=layers, H=h, I=i,
                                   RU=i // programs, RD=h // programs, PREFETCH=prefetch, num_warps=16,
                                   launch_cooperative_grid=cooperative)

    def barriers() -> None:
        counter.zero_()
        _barriers_kernel[(programs,)](counter, N=BARRIERS, G=programs, num_warps=4)

    rows = [("ops: linear_relu_square + linear per layer, one CUDA graph", time_graph(ops_chain, replays))]
    variants = {"": (False, False), ", next weights loaded before each barrier": (True, False),
                ", a cooperative launch": (False, True)}
    for label, (prefetch, cooperative) in variants.items():
        persistent(prefetch, cooperative)
        torch.cuda.synchronize()
        error = check(x, up, down, hidden, out)
        name = f"persistent, {programs} programs x 16 warps{label}"
        print(f"{name}: largest error per op {error:.2e} (relative to the op's largest output)", flush=True)
        rows.append((name, time_graph(lambda: persistent(prefetch, cooperative), replays)))
    barrier_us = time_graph(barriers, replays)
    weight_bytes = (up.numel() + down.numel()) * up.element_size()
    floor = weight_bytes / copy_bandwidth() * 1e6
    projections = 2 * layers
    print(f"\n{layers} MLP layers (up {i} x {h} + relu^2, down {h} x {i}), 1 row, {weight_bytes / 1e6:.0f} MB of "
          f"weights, floor {floor:.1f} us; triton {triton.__version__}, {torch.cuda.get_device_name(dev)}")
    print("| chain | us per chain | us per projection | over the floor |\n|---|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {us / projections:.2f} | {us / floor:.2f}x |")
    print(f"| {BARRIERS} grid barriers alone, {programs} programs | {barrier_us:.1f} | "
          f"{barrier_us / BARRIERS:.2f} per barrier | - |")


def check(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> float:
    """The largest error of any op of the persistent chain against float32 torch on the
    op's own input (the previous op's bf16 output), relative to the op's largest output.
    Raises if it is not at bf16 rounding level (a race at a barrier would show here)."""
    worst = 0.0
    for layer in range(up.shape[0]):
        v = (x[0] if layer == 0 else out[layer - 1]).float()
        a = (up[layer].float() @ v).bfloat16().float()
        expected_hidden = (torch.relu(a) ** 2).bfloat16().float()
        expected_out = down[layer].float() @ hidden[layer].float()
        for got, expected in ((hidden[layer], expected_hidden), (out[layer], expected_out)):
            worst = max(worst, ((got.float() - expected).abs().max() / expected.abs().max()).item())
    if not worst < 2e-2:
        raise AssertionError(f"persistent chain differs from torch by {worst:.3g} (relative)")
    return worst


def time_graph(fn, replays: int) -> float:
    """Microseconds per call of `fn` captured in a CUDA graph: the median of 5 timings of
    `replays` replays each."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timings = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) * 1e3 / replays)
    return sorted(timings)[2]


if __name__ == "__main__":
    main()

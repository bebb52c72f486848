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
  the barrier;
- the grid barriers alone (64 per launch, no work between them), over an empty launch;
- then the peer's Mamba-2 decode layer, L of them chained: our 4 kernels per layer
  (`linear_conv_update`, `ssm_state_update`, `gated_rms_norm`, `linear`, as
  `Mamba2Mixer` runs a decode step) against two persistent kernels with 3 barriers per
  layer (in_proj with the conv update | the SSM update, 16 channels of a head per program |
  the gated norm and out_proj): a naive one (32-row in_proj tiles, CUDA-core sums, the
  gated norm computed whole by every program) and one built from the skinny projection
  kernel's own tiles and helpers, which must equal our ops bit for bit.
Every persistent kernel is a cooperative launch (refused, not hung, when its programs
cannot all be resident); the memset that resets its barrier counter is part of its
timing, and an empty launch is timed for reference. The weights (134-135 MB for 8 layers)
are larger than the L2, so every call reads them from memory; the floor is their bytes
(and the Mamba states read and written) over the device copy rate measured in the same
run. Every buffer a persistent kernel writes is NaN-filled before its checked run: each
MLP op is checked against float32 torch from its own inputs, each Mamba layer against our
ops on the same input and starting states.
This is a prototype kernel for the measurement (no model calls it): docs/benchmarks.md,
"Session 21", says what the numbers mean for a decode megakernel.
"""
import argparse
import os
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_floors import copy_bandwidth  # noqa: E402

from layers.kernels.triton.conv1d import conv_update_channels  # noqa: E402
from layers.kernels.triton.device import sm_count  # noqa: E402
from layers.kernels.triton.linear import (  # noqa: E402
    ROW_TILE, _store_rows, row_tile_product, sum_slices, linear, linear_conv_update, linear_relu_square, tiling)
from layers.kernels.triton.norm import gated_rms_norm  # noqa: E402
from layers.kernels.triton.ssm_update import softplus, ssm_state_update  # noqa: E402

HIDDEN, INTERMEDIATE = 1024, 4096  # the peer's MLP (scripts/bench_decode.py, PEER_CONFIG)
# The peer's Mamba-2 mixer: 32 heads x 64, 8 groups, state 128, conv 4; in_proj makes z,
# xBC (the conv channels: x, B, C) and dt; the gated norm's groups are 256 channels.
HEADS, HEAD_DIM, GROUPS, STATE, CONV_K = 32, 64, 8, 128, 4
D_SSM = HEADS * HEAD_DIM
CONV_DIM = D_SSM + 2 * GROUPS * STATE
IN_PROJ = D_SSM + CONV_DIM + HEADS
NORM_EPS = 1e-5
BARRIERS = 64  # in the barriers-only launch
MAMBA_CHANNELS_PER_PROGRAM = 16  # of a head, in the SSM update (as `_ssm_update_kernel` tiles it)


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
    """L MLP layers for one row: program pid computes RU rows of each up projection (relu^2
    of them to `hidden_ptr`) and RD rows of each down projection (to `out_ptr`, the next
    layer's input), with a grid barrier wherever the next op reads the whole previous output.
    PREFETCH: load the next op's weight rows before waiting at its barrier."""
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
def _ssm_update_phase(zx, ssm, y_ptr, a_ptr, d_ptr, dt_bias_ptr, pid, counter_ptr, target, G: tl.constexpr,
                      DSSM: tl.constexpr, CONV: tl.constexpr, NH: tl.constexpr, P: tl.constexpr, NG: tl.constexpr,
                      NS: tl.constexpr, BP: tl.constexpr):
    """Between the barrier at `target` (in_proj is whole) and the one at `target` + G (every
    head is updated): the SSM update of program `pid`'s BP channels of one head (as
    `_ssm_update_kernel`'s tiles), with x, B, C and dt from this layer's in_proj output `zx`,
    the state from slot 0 of `ssm` to slot 1, y (D skip included) to `y_ptr`."""
    _arrive_and_wait(counter_ptr, target)
    head = pid // (P // BP)
    p = (pid % (P // BP)) * BP + tl.arange(0, BP)
    n = tl.arange(0, NS)
    group = head // (NH // NG)
    tile_off = head * P * NS + p[:, None] * NS + n[None, :]
    h = tl.load(ssm + tile_off)
    xv = tl.load(zx + DSSM + head * P + p, cache_modifier=".cg").to(tl.float32)
    b = tl.load(zx + 2 * DSSM + group * NS + n, cache_modifier=".cg").to(tl.float32)
    c = tl.load(zx + 2 * DSSM + NG * NS + group * NS + n, cache_modifier=".cg").to(tl.float32)
    dt = softplus(tl.load(zx + DSSM + CONV + head, cache_modifier=".cg").to(tl.float32) + tl.load(dt_bias_ptr + head))
    h = h * tl.exp(dt * tl.load(a_ptr + head)) + (dt * xv)[:, None] * b[None, :]
    tl.store(ssm + NH * P * NS + tile_off, h)
    y = tl.sum(h * c[None, :], axis=1) + tl.load(d_ptr + head) * xv
    tl.store(y_ptr + head * P + p, y.to(tl.bfloat16))
    _arrive_and_wait(counter_ptr, target + G)


@triton.jit
def _mamba_chain_kernel(
    x_ptr, w_in_ptr, conv_w_ptr, conv_b_ptr, conv_state_ptr, a_ptr, d_ptr, dt_bias_ptr, norm_w_ptr, w_out_ptr,
    ssm_state_ptr, zxbcdt_ptr, y_ptr, out_ptr, counter_ptr, eps,
    G: tl.constexpr, L: tl.constexpr, H: tl.constexpr, NIN: tl.constexpr, DSSM: tl.constexpr, CONV: tl.constexpr,
    NH: tl.constexpr, P: tl.constexpr, NG: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, TILE: tl.constexpr,
    BP: tl.constexpr, RO: tl.constexpr,
):
    """L Mamba-2 decode layers for one row (state slot 0 -> slot 1), each: in_proj with the
    conv update of its xBC channels | barrier | the SSM update, BP channels of a head per
    program | barrier | the gated norm (every program computes it whole) and out_proj |
    barrier. Weights and states are stacked per layer."""
    pid = tl.program_id(0)
    k = tl.arange(0, H)
    barrier = 0
    for layer in tl.static_range(L):
        if layer == 0:
            v = tl.load(x_ptr + k).to(tl.float32)
        else:
            barrier += G
            _arrive_and_wait(counter_ptr, barrier)  # the previous layer's out_proj is whole
            v = tl.load(out_ptr + (layer - 1) * H + k, cache_modifier=".cg").to(tl.float32)
        zxbcdt = zxbcdt_ptr + layer * NIN
        # in_proj (+ conv): TILE-row tiles of the weight, dealt round-robin to the programs
        for tile in range(pid, tl.cdiv(NIN, TILE), G):
            rows = tile * TILE + tl.arange(0, TILE)
            w = tl.load(w_in_ptr + layer * NIN * H + rows[:, None] * H + k[None, :], mask=rows[:, None] < NIN,
                        other=0.0)
            y = tl.sum(w.to(tl.float32) * v[None, :], axis=1).to(tl.bfloat16)
            ch = rows - DSSM
            is_conv = (ch >= 0) & (ch < CONV)
            ch = tl.where(is_conv, ch, 0)
            state = conv_state_ptr + layer * 2 * CONV * (K - 1) + ch * (K - 1)
            conv = conv_update_channels(y, conv_w_ptr + layer * CONV * K + ch * K, conv_b_ptr + layer * CONV + ch,
                                        state, state + CONV * (K - 1), 1, is_conv, K, True, True)
            tl.store(zxbcdt + rows, tl.where(is_conv, conv.to(tl.bfloat16), y), mask=rows < NIN)
        _ssm_update_phase(zxbcdt, ssm_state_ptr + layer * 2 * NH * P * NS, y_ptr + layer * DSSM, a_ptr + layer * NH,
                          d_ptr + layer * NH, dt_bias_ptr + layer * NH, pid, counter_ptr, barrier + G, G, DSSM, CONV,
                          NH, P, NG, NS, BP)
        barrier += 2 * G
        # gated norm (whole, in every program) and out_proj: RO rows per program
        c_all = tl.arange(0, DSSM)
        yv = tl.load(y_ptr + layer * DSSM + c_all, cache_modifier=".cg").to(tl.float32)
        z = tl.load(zxbcdt + c_all, cache_modifier=".cg").to(tl.float32)
        g = tl.reshape(yv * z * tl.sigmoid(z), (NG, DSSM // NG))
        rstd = tl.rsqrt(tl.sum(g * g, axis=1) / (DSSM // NG) + eps)
        nw = tl.reshape(tl.load(norm_w_ptr + layer * DSSM + c_all).to(tl.float32), (NG, DSSM // NG))
        normed = tl.reshape((nw * (g * rstd[:, None]).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16), (DSSM,))
        out_rows = pid * RO + tl.arange(0, RO)
        w_out = tl.load(w_out_ptr + layer * H * DSSM + out_rows[:, None] * DSSM + c_all[None, :])
        o = tl.sum(w_out.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + layer * H + out_rows, o.to(tl.bfloat16))


@triton.jit
def _mamba_tiled_kernel(
    x_ptr, w_in_ptr, conv_w_ptr, conv_b_ptr, conv_state_ptr, a_ptr, d_ptr, dt_bias_ptr, norm_w_ptr, w_out_ptr,
    ssm_state_ptr, zxbcdt_ptr, y_ptr, normed_ptr, partial_ptr, arrivals_ptr, out_ptr, src_ptr, dst_ptr, counter_ptr,
    eps, G: tl.constexpr, L: tl.constexpr, H: tl.constexpr, NIN: tl.constexpr, DSSM: tl.constexpr,
    CONV: tl.constexpr, NH: tl.constexpr, P: tl.constexpr, NG: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
    BN_IN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN_OUT: tl.constexpr, SPLIT_OUT: tl.constexpr,
):
    """`_mamba_chain_kernel`'s layers with each phase done as our separate kernels do it:
    in_proj and out_proj with the skinny projection kernel's tiles and helpers (16-row
    tensor-core tiles, the same K steps, out_proj split in SPLIT_OUT K slices added by the
    last program of a column tile), the SSM update with its kernel's tiles, and the gated
    norm of only the groups in a program's K slice of out_proj, just before it."""
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    ks = tl.arange(0, BK)
    gs: tl.constexpr = DSSM // NG
    k_len: tl.constexpr = DSSM // SPLIT_OUT
    barrier = 0
    for layer in tl.static_range(L):
        if layer == 0:
            v_ptr = x_ptr
        else:
            barrier += G
            _arrive_and_wait(counter_ptr, barrier)  # the previous layer's out_proj is whole
            # (read by the skinny kernel's own loads: the barrier's acquire orders them after
            # the other programs' stores, as the naive kernel's `.cg` loads are too)
            v_ptr = out_ptr + (layer - 1) * H
        zx = zxbcdt_ptr + layer * NIN
        # in_proj + conv: program p < cdiv(NIN, BN_IN) is the skinny kernel's column tile p
        if pid < tl.cdiv(NIN, BN_IN):
            cols = pid * BN_IN + tl.arange(0, BN_IN)
            w_rows = w_in_ptr + layer * NIN * H + cols.to(tl.int64)[:, None] * H
            acc = tl.zeros((16, BN_IN), tl.float32)
            for k0 in range(0, H, BK):
                k = k0 + ks
                w = tl.load(w_rows + k[None, :], mask=(cols[:, None] < NIN) & (k[None, :] < H), other=0.0)
                acc = row_tile_product(acc, v_ptr, w, rows, k, 1, H, H, "tf32")
            _store_rows(acc, w_in_ptr, zx, rows, cols, 1, NIN, NIN, False, DSSM, CONV, conv_w_ptr + layer * CONV * K,
                        conv_b_ptr + layer * CONV, conv_state_ptr + layer * 2 * CONV * (K - 1), src_ptr, dst_ptr,
                        K, CONV * (K - 1), K - 1, 1, 0, 0, 1, zx, zx, zx, 1, 0, 0, 0, True, K, True, True, False,
                        False)
        _ssm_update_phase(zx, ssm_state_ptr + layer * 2 * NH * P * NS, y_ptr + layer * DSSM, a_ptr + layer * NH,
                          d_ptr + layer * NH, dt_bias_ptr + layer * NH, pid, counter_ptr, barrier + G, G, DSSM, CONV,
                          NH, P, NG, NS, BP)
        barrier += 2 * G
        # out_proj: program -> (column tile, K slice); first the gated norm of the slice's groups
        col_tile = pid % (H // BN_OUT)
        k_start = (pid // (H // BN_OUT)) * k_len
        scratch = normed_ptr + pid * k_len
        for gi in tl.static_range(k_len // gs):
            ch = k_start + gi * gs + tl.arange(0, gs)
            z = tl.load(zx + ch, cache_modifier=".cg").to(tl.float32)
            gated = tl.load(y_ptr + layer * DSSM + ch, cache_modifier=".cg").to(tl.float32) * z * tl.sigmoid(z)
            gated = (gated * tl.rsqrt(tl.sum(gated * gated, axis=0) / gs + eps)).to(tl.bfloat16).to(tl.float32)
            norm_w = tl.load(norm_w_ptr + layer * DSSM + ch).to(tl.float32)
            tl.store(scratch + gi * gs + tl.arange(0, gs), (norm_w * gated).to(tl.bfloat16))
        tl.debug_barrier()  # the slice is stored before this program's threads read it
        cols_o = col_tile * BN_OUT + tl.arange(0, BN_OUT)
        w_rows_o = w_out_ptr + layer * H * DSSM + cols_o.to(tl.int64)[:, None] * DSSM
        acc_o = tl.zeros((16, BN_OUT), tl.float32)
        for k0 in range(k_start, k_start + k_len, BK):
            k_o = k0 + ks
            w_o = tl.load(w_rows_o + k_o[None, :], mask=(cols_o[:, None] < H) & (k_o[None, :] < k_start + k_len),
                          other=0.0)
            acc_o = row_tile_product(acc_o, scratch - k_start, w_o, rows, k_o, 1, k_start + k_len, 0, "tf32")
        tl.store(partial_ptr + (pid // (H // BN_OUT)) * 16 * H + rows[:, None] * H + cols_o[None, :], acc_o)
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + col_tile, 1, sem="acq_rel") == SPLIT_OUT - 1:
            acc_o = sum_slices(partial_ptr, rows, cols_o, 1, H, 16, SPLIT_OUT)
            _store_rows(acc_o, w_out_ptr, out_ptr + layer * H, rows, cols_o, 1, H, H, False, 0, 0, out_ptr, out_ptr,
                        out_ptr, out_ptr, out_ptr, 0, 0, 0, 0, 0, 0, 1, out_ptr, out_ptr, out_ptr, 1, 0, 0, 0,
                        False, 2, False, False, False, False)
            tl.atomic_xchg(arrivals_ptr + col_tile, 0)


@triton.jit
def _barriers_kernel(counter_ptr, N: tl.constexpr, G: tl.constexpr):
    """N grid barriers and nothing else (N = 0: an empty launch, the baseline)."""
    for n in tl.static_range(N):
        _arrive_and_wait(counter_ptr, (n + 1) * G)


def main() -> None:
    """Parse the flags; run on a CUDA device, else say why not."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="layers in each chain (MLP and Mamba)")
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
    # A power of two of programs, at most one per SM. Every persistent kernel here is a
    # cooperative launch: the driver refuses it when its programs cannot all be resident
    # at once (other work on the device), instead of letting it spin at a barrier forever.
    programs = 1 << (min(sm_count(dev), h).bit_length() - 1)

    def ops_chain() -> None:
        y = x
        for layer in range(layers):
            y = linear(linear_relu_square(y, up[layer]), down[layer])

    def persistent(prefetch: bool) -> None:
        counter.zero_()  # (a memset node in the graph: part of every persistent timing)
        _chain_kernel[(programs,)](x, up, down, hidden, out, counter, G=programs, L=layers, H=h, I=i,
                                   RU=i // programs, RD=h // programs, PREFETCH=prefetch, num_warps=16,
                                   launch_cooperative_grid=True)

    def barriers(n: int) -> None:
        counter.zero_()
        _barriers_kernel[(programs,)](counter, N=n, G=programs, num_warps=4, launch_cooperative_grid=True)

    rows = [("ops: linear_relu_square + linear per layer, one CUDA graph", time_graph(ops_chain, replays))]
    for label, prefetch in (("", False), (", next weights loaded before each barrier", True)):
        hidden.fill_(float("nan"))  # so that an op that wrote nothing, or read too early, shows
        out.fill_(float("nan"))
        persistent(prefetch)
        torch.cuda.synchronize()
        error = check(x, up, down, hidden, out)
        name = f"persistent, {programs} programs x 16 warps{label}"
        print(f"{name}: largest error per op {error:.2e} (relative to the op's largest output)", flush=True)
        rows.append((name, time_graph(lambda: persistent(prefetch), replays)))
    empty_us, barriers_us = time_graph(lambda: barriers(0), replays), time_graph(lambda: barriers(BARRIERS), replays)
    weight_bytes = (up.numel() + down.numel()) * up.element_size()
    floor = weight_bytes / copy_bandwidth() * 1e6
    projections = 2 * layers
    print(f"\n{layers} MLP layers (up {i} x {h} + relu^2, down {h} x {i}), 1 row, {weight_bytes / 1e6:.0f} MB of "
          f"weights, floor {floor:.1f} us; triton {triton.__version__}, {torch.cuda.get_device_name(dev)}")
    print("| chain | us per chain | us per projection | over the floor |\n|---|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {us / projections:.2f} | {us / floor:.2f}x |")
    print(f"| an empty persistent launch (memset + kernel), {programs} programs | {empty_us:.1f} | - | - |")
    print(f"| {BARRIERS} grid barriers, {programs} programs | {barriers_us:.1f} | "
          f"{(barriers_us - empty_us) / BARRIERS:.2f} per barrier (over the empty launch) | - |")
    if programs != HEADS * HEAD_DIM // MAMBA_CHANNELS_PER_PROGRAM:
        print(f"\nMamba chain skipped: its SSM phase gives each of {HEADS * HEAD_DIM // MAMBA_CHANNELS_PER_PROGRAM} "
              f"programs {MAMBA_CHANNELS_PER_PROGRAM} channels of a head, and this device takes {programs}")
        return
    run_mamba(layers, replays, programs, counter)


def run_mamba(layers: int, replays: int, programs: int, counter: torch.Tensor) -> None:
    """The peer's Mamba-2 decode layer, L of them chained (each layer's out_proj output is the
    next one's input), one row: our ops (`linear_conv_update`, `ssm_state_update`,
    `gated_rms_norm`, `linear`, as `Mamba2Mixer` runs them at decode) in a CUDA graph, against
    `_mamba_chain_kernel` (checked to rounding) and `_mamba_tiled_kernel` (checked bit for
    bit). Each reads state slot 0 and writes slot 1 of its own copies of the states."""
    torch.manual_seed(1)
    dev, bf16, f32 = torch.device("cuda"), torch.bfloat16, torch.float32
    n_l, gn = layers, GROUPS * STATE
    w_in = torch.randn(n_l, IN_PROJ, HIDDEN, device=dev, dtype=bf16) / 32
    conv_w = torch.randn(n_l, CONV_DIM, CONV_K, device=dev, dtype=bf16) / 2
    conv_b = torch.randn(n_l, CONV_DIM, device=dev, dtype=bf16) / 10
    a = -torch.exp(torch.randn(n_l, HEADS, device=dev, dtype=f32) / 2)
    d = torch.ones(n_l, HEADS, device=dev, dtype=f32)
    dt_bias = torch.randn(n_l, HEADS, device=dev, dtype=f32) / 2 - 2
    norm_w = 1 + torch.randn(n_l, D_SSM, device=dev, dtype=bf16) / 10
    w_out = torch.randn(n_l, HIDDEN, D_SSM, device=dev, dtype=bf16) / 45
    x = torch.randn(1, HIDDEN, device=dev, dtype=bf16)
    conv0 = torch.randn(n_l, 2, CONV_DIM, CONV_K - 1, device=dev, dtype=bf16) / 2
    ssm0 = torch.randn(n_l, 2, HEADS, HEAD_DIM, STATE, device=dev, dtype=f32) / 10
    ops_conv, ops_ssm, mk_conv, mk_ssm = conv0.clone(), ssm0.clone(), conv0.clone(), ssm0.clone()
    src = torch.zeros(1, device=dev, dtype=torch.int64)
    dst = torch.ones(1, device=dev, dtype=torch.int64)
    zxbcdt = torch.empty(n_l, IN_PROJ, device=dev, dtype=bf16)
    y = torch.empty(n_l, D_SSM, device=dev, dtype=bf16)
    out = torch.empty(n_l, HIDDEN, device=dev, dtype=bf16)
    # The tiled kernel's: the skinny kernel's tilings of in_proj and out_proj.
    in_tiles, out_tiles = tiling(IN_PROJ, HIDDEN), tiling(HIDDEN, D_SSM)
    tiled_out = torch.empty(n_l, HIDDEN, device=dev, dtype=bf16)
    normed = torch.empty(programs, D_SSM // out_tiles.split, device=dev, dtype=bf16)
    partials = torch.empty(out_tiles.split, ROW_TILE, HIDDEN, device=dev, dtype=f32)
    arrivals = torch.zeros(HIDDEN // out_tiles.block_n, device=dev, dtype=torch.int32)
    tiled_conv, tiled_ssm = conv0.clone(), ssm0.clone()
    assert (in_tiles.split == 1 and in_tiles.block_k == out_tiles.block_k
            and programs == (HIDDEN // out_tiles.block_n) * out_tiles.split), (in_tiles, out_tiles)

    def ops_layer(v: torch.Tensor, layer: int, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
        zx = linear_conv_update(v, w_in[layer], None, D_SSM, conv_w[layer], conv_b[layer], conv_states[layer], src,
                                dst)
        z, xbc, dt = zx.split([D_SSM, CONV_DIM, HEADS], dim=-1)
        xs, b, c = xbc.split([D_SSM, gn, gn], dim=-1)
        yh = ssm_state_update(ssm_states[layer], xs.reshape(1, HEADS, HEAD_DIM), dt, a[layer],
                              b.reshape(1, GROUPS, STATE), c.reshape(1, GROUPS, STATE), d[layer], src, dst,
                              dt_bias[layer])
        gated = gated_rms_norm(yh.reshape(1, D_SSM), z, norm_w[layer], NORM_EPS, D_SSM // GROUPS)
        return linear(gated, w_out[layer])

    def ops_chain() -> None:
        v = x
        for layer in range(n_l):
            v = ops_layer(v, layer, ops_conv, ops_ssm)

    def persistent() -> None:
        counter.zero_()
        _mamba_chain_kernel[(programs,)](
            x, w_in, conv_w, conv_b, mk_conv, a, d, dt_bias, norm_w, w_out, mk_ssm, zxbcdt, y, out, counter, NORM_EPS,
            G=programs, L=n_l, H=HIDDEN, NIN=IN_PROJ, DSSM=D_SSM, CONV=CONV_DIM, NH=HEADS, P=HEAD_DIM, NG=GROUPS,
            NS=STATE, K=CONV_K, TILE=32, BP=MAMBA_CHANNELS_PER_PROGRAM, RO=HIDDEN // programs, num_warps=16,
            enable_fp_fusion=False, launch_cooperative_grid=True)

    # Everything the kernels write is NaN first, so that a value not written, or read
    # before its barrier, shows in the checks.
    poison = (zxbcdt, y, out, normed, mk_conv[:, 1], mk_ssm[:, 1], tiled_conv[:, 1], tiled_ssm[:, 1], tiled_out)

    def run_poisoned(kernel: Callable[[], None]) -> None:
        for t in poison:
            t.fill_(float("nan"))
        kernel()
        torch.cuda.synchronize()

    run_poisoned(persistent)
    # Each layer against our ops on the same input (the persistent chain's previous output)
    # and the same starting states: per-layer rounding differences would compound over a
    # chain of layers compared end to end.
    errors, state_errors = [], []
    for layer in range(n_l):
        expected = ops_layer(x if layer == 0 else out[layer - 1:layer], layer, ops_conv, ops_ssm)[0].float()
        errors.append(((out[layer].float() - expected).abs().max() / expected.abs().max()).item())
        state_errors.append(((mk_ssm[layer, 1] - ops_ssm[layer, 1]).abs().max()
                             / ops_ssm[layer, 1].abs().max()).item())
    print(f"\nMamba chain: persistent against our ops on the same inputs, largest relative error per layer: "
          f"outputs {max(errors):.1e}, SSM states {max(state_errors):.1e}", flush=True)
    if not all(e < 2e-2 for e in errors + state_errors):  # (a NaN fails too)
        raise AssertionError("the persistent Mamba chain differs from our ops")

    def tiled() -> None:
        counter.zero_()
        _mamba_tiled_kernel[(programs,)](
            x, w_in, conv_w, conv_b, tiled_conv, a, d, dt_bias, norm_w, w_out, tiled_ssm, zxbcdt, y, normed, partials,
            arrivals, tiled_out, src, dst, counter, NORM_EPS, G=programs, L=n_l, H=HIDDEN, NIN=IN_PROJ, DSSM=D_SSM,
            CONV=CONV_DIM, NH=HEADS, P=HEAD_DIM, NG=GROUPS, NS=STATE, K=CONV_K, BN_IN=in_tiles.block_n,
            BK=in_tiles.block_k, BP=MAMBA_CHANNELS_PER_PROGRAM, BN_OUT=out_tiles.block_n, SPLIT_OUT=out_tiles.split,
            num_warps=8, num_stages=4, enable_fp_fusion=False, launch_cooperative_grid=True)

    run_poisoned(tiled)
    tiled_errors, tiled_equal = [], []
    for layer in range(n_l):
        expected = ops_layer(x if layer == 0 else tiled_out[layer - 1:layer], layer, ops_conv, ops_ssm)[0]
        tiled_errors.append(((tiled_out[layer].float() - expected.float()).abs().max()
                             / expected.float().abs().max()).item())
        tiled_equal.append(torch.equal(tiled_out[layer], expected) and torch.equal(tiled_ssm[layer, 1], ops_ssm[layer, 1])
                           and torch.equal(tiled_conv[layer, 1], ops_conv[layer, 1]))
    print(f"Mamba chain, persistent with our kernels' tiles: largest relative error per layer {max(tiled_errors):.1e}; "
          f"layers equal to our ops bit for bit (output, SSM and conv states): {sum(tiled_equal)} of {n_l}", flush=True)
    if not all(tiled_equal):
        raise AssertionError("the tiled persistent Mamba chain is not our ops bit for bit")
    ops_us, mk_us, tiled_us = (time_graph(fn, replays) for fn in (ops_chain, persistent, tiled))

    weight_bytes = sum(t.numel() * t.element_size() for t in (w_in, conv_w, conv_b, norm_w, w_out))
    state_bytes = 2 * (conv0[:, 0].numel() * 2 + ssm0[:, 0].numel() * 4)  # read slot 0, write slot 1
    floor = (weight_bytes + state_bytes) / copy_bandwidth() * 1e6
    print(f"{n_l} Mamba-2 layers (in_proj {IN_PROJ} x {HIDDEN} + conv, SSM update {HEADS} x {HEAD_DIM} x {STATE}, "
          f"gated norm, out_proj {HIDDEN} x {D_SSM}), 1 row; {weight_bytes / 1e6:.0f} MB of weights, "
          f"{state_bytes / 1e6:.1f} MB of state read + written; floor {floor:.1f} us")
    print("| chain | us per chain | us per layer | over the floor |\n|---|---|---|---|")
    print(f"| ops: 4 kernels per layer, one CUDA graph | {ops_us:.1f} | {ops_us / n_l:.2f} | {ops_us / floor:.2f}x |")
    print(f"| persistent, {programs} programs x 16 warps, 3 barriers per layer | {mk_us:.1f} | {mk_us / n_l:.2f} | "
          f"{mk_us / floor:.2f}x |")
    print(f"| persistent with our kernels' tiles, {programs} programs x 8 warps, 3 barriers per layer | {tiled_us:.1f} | "
          f"{tiled_us / n_l:.2f} | {tiled_us / floor:.2f}x |")


def check(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> float:
    """The largest error of any op of the persistent chain against float32 torch on the
    op's own input (the previous op's bf16 output), relative to the op's largest output.
    Raises if one is not at bf16 rounding level or is NaN (an op that wrote nothing into
    the NaN-filled buffers, or read its input before the barrier, shows here)."""
    errors = []
    for layer in range(up.shape[0]):
        v = (x[0] if layer == 0 else out[layer - 1]).float()
        a = (up[layer].float() @ v).bfloat16().float()
        expected_hidden = (torch.relu(a) ** 2).bfloat16().float()
        expected_out = down[layer].float() @ hidden[layer].float()
        for got, expected in ((hidden[layer], expected_hidden), (out[layer], expected_out)):
            errors.append(((got.float() - expected).abs().max() / expected.abs().max()).item())
    if not all(e < 2e-2 for e in errors):
        raise AssertionError(f"persistent chain differs from torch: relative errors {errors}")
    return max(errors)


def time_graph(fn: Callable[[], None], replays: int) -> float:
    """Microseconds per call of `fn` captured in a CUDA graph: the median of 5 timings of
    `replays` back-to-back replays each (bench_kernels.py's `time_graph` times each replay
    on its own, which adds a launch to every chain of ~100 us measured here)."""
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

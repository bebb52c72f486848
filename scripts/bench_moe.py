"""MoE layer benchmark: the fused path against the path it replaced, at the presets' shapes.
Run through `python scripts/bench_kernels.py --moe` (not a test).

One MoE layer of granite-4.0-h-tiny and of nemotron-3-nano-30b-a3b (bf16, random weights,
random tokens doing the routing) at T = 1, 8, 32, 128, 2048 tokens, three ways:
- old layer: the forward before the fused path: float32 casts, the torch reference routers,
  sorted dispatch + torch._grouped_mm experts, the shared expert as its own MLP, an add;
- fused layer: `NemotronHMoE` / `GraniteMoE` on the fast ops (router GEMM and routing kernel,
  one kernel for NemotronH up to 16 tokens; alignment, up GEMM, down GEMM, combine; the
  shared expert inside the GEMMs);
- fused experts: `moe_experts` alone on fixed routes (the GEMMs' share of the layer).
Calls rotate over 4 copies of the layer with distinct weights, so no weight comes from the
L2 cache. "active MB": the bytes a call must move -- router and shared-expert weights, the
weights of the distinct experts its tokens chose (counted from the routes), x and the
output; GB/s is that over the time and "% copy" that over the measured copy rate (1.0 =
the active-weight floor). "kernels": CUDA kernels per call (torch.profiler). Under the
table: each fused layer's kernels with their GPU time, for tuning `MOE_TILES`.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench_kernels import BF16, DEV, time_graph
from hybrid_engine.models.config import NEMOTRON_H, HybridConfig, parse_hf_config
from hybrid_engine.models.presets import get_preset
from layers.kernels import REFERENCE_OPS, fast
from layers.kernels import reference as ref
from layers.kernels.triton import moe
from layers.mlp import SwiGLUMLP
from layers.moe import GraniteMoE, NemotronHMoE

PRESETS = ("granite-4.0-h-tiny", "nemotron-3-nano-30b-a3b")
TOKENS = (1, 8, 32, 128, 2048)
ROTATIONS = 4
FAST_OPS = REFERENCE_OPS.with_ops("fast", fast.available_ops())


def sorted_grouped_mm_experts(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """The experts path the fused one replaced (bf16, Hopper): sort the (token, slot) pairs
    by expert, torch._grouped_mm up and down, weight, un-sort, sum over k in float32."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x.index_select(0, order // top_k), w_up.transpose(1, 2), offs=ends)
    if activation == "relu2":
        h = torch.square(F.relu(h))
    else:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    weighted = y.float() * topk_weights.reshape(-1)[order, None].float()
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


@dataclass
class Layer:
    """One copy of a preset's MoE layer (Granite's shared MLP belongs to its block)."""

    module: NemotronHMoE | GraniteMoE
    shared: SwiGLUMLP | None

    @property
    def nemotron(self) -> bool:
        return isinstance(self.module, NemotronHMoE)

    def up_down(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.module
        return (m.experts.up, m.experts.down) if self.nemotron else (m.input_linear.weight, m.output_linear.weight)

    def shared_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.shared_experts.expert_weights() if self.nemotron else self.shared.expert_weights()

    def routes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast routers' (weights, ids), as the fused layer computes them."""
        m = self.module
        if self.nemotron:
            return FAST_OPS.route_sigmoid_grouped(x, m.gate.weight, m.gate.e_score_correction_bias, m.top_k,
                                                  m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor)
        return FAST_OPS.route_softmax_topk(x, m.router.layer.weight, m.top_k)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) if self.nemotron else self.module(x, self.shared)

    def old(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if self.nemotron:
            weights, ids = ref.route_sigmoid_grouped(x, m.gate.weight, m.gate.e_score_correction_bias, m.top_k,
                                                     m.n_group, m.topk_group, m.norm_topk_prob,
                                                     m.routed_scaling_factor)
            routed = sorted_grouped_mm_experts(x, *self.up_down(), weights, ids, "relu2")
            return routed + m.shared_experts(x)
        weights, ids = ref.route_softmax_topk(x, m.router.layer.weight, m.top_k)
        return sorted_grouped_mm_experts(x, *self.up_down(), weights.to(x.dtype), ids, "swiglu") + self.shared(x)

    def weight_bytes(self, ids: torch.Tensor) -> float:
        """Router, shared expert and the distinct chosen experts' weights, in bytes."""
        up, down = self.up_down()
        router = self.module.gate.weight if self.nemotron else self.module.router.layer.weight
        per_expert = (up[0].numel() + down[0].numel()) * up.element_size()
        shared = sum(w.numel() * w.element_size() for w in self.shared_weights())
        return router.numel() * router.element_size() + shared + ids.unique().numel() * per_expert


def build_layer(c: HybridConfig) -> Layer:
    """A layer with random bf16 weights, made on the GPU (the experts are GBs)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device(DEV):
            if c.architecture == NEMOTRON_H:
                layer = Layer(NemotronHMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size,
                                           c.shared_intermediate_size, c.n_group, c.topk_group, c.norm_topk_prob,
                                           c.routed_scaling_factor, c.moe_latent_size, bias=c.mlp_bias,
                                           ops=FAST_OPS), None)
            else:
                layer = Layer(GraniteMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size, ops=FAST_OPS),
                              SwiGLUMLP(c.hidden_size, c.intermediate_size, ops=FAST_OPS))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for module in (layer.module, layer.shared):
            for p in module.parameters() if module is not None else ():
                p.normal_(0.0, p.shape[-1] ** -0.5)
        if layer.nemotron:
            layer.module.gate.e_score_correction_bias.normal_(0.0, 0.01)
    return layer


def kernel_profile(fn: Callable[[], object]) -> list[tuple[str, float]]:
    """(name, GPU us) of every CUDA kernel one call launches, in launch order."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in sorted(kernels, key=lambda e: e.time_range.start)]


def bench_preset(name: str, copy_bw: float) -> list[dict]:
    """Rows of the MoE table for one preset."""
    c = parse_hf_config(get_preset(name))
    layers = [build_layer(c) for _ in range(ROTATIONS)]
    rows = []
    for tokens in TOKENS:
        xs = [torch.randn(tokens, c.hidden_size, device=DEV, dtype=BF16) for _ in range(ROTATIONS)]
        routes = [layer.routes(x) for layer, x in zip(layers, xs)]
        io_bytes = 2 * tokens * c.hidden_size * 2
        moved = sum(layer.weight_bytes(ids) for layer, (_, ids) in zip(layers, routes)) / ROTATIONS + io_bytes
        activation = "relu2" if layers[0].nemotron else "swiglu"
        paths = {
            "old layer": [lambda r=r: layers[r].old(xs[r]) for r in range(ROTATIONS)],
            "fused layer": [lambda r=r: layers[r].fused(xs[r]) for r in range(ROTATIONS)],
            "fused experts": [lambda r=r: moe.moe_experts(xs[r], *layers[r].up_down(), *routes[r], activation,
                                                          *layers[r].shared_weights()) for r in range(ROTATIONS)],
        }
        for path, calls in paths.items():
            with torch.no_grad():
                seconds = time_graph(calls, per_graph=16 if tokens <= 128 else 4)
                kernels = kernel_profile(calls[0])
            rows.append({"model": name, "tokens": tokens, "path": path, "us": seconds * 1e6, "kernels": len(kernels),
                         "kernel_us": kernels, "bytes": moved, "GB/s": moved / seconds / 1e9,
                         "frac_of_copy": moved / seconds / copy_bw})
    return rows


def run(copy_bw: float) -> list[dict]:
    """Print the MoE table (and each fused layer's kernels); return its rows."""
    rows = [row for name in PRESETS for row in bench_preset(name, copy_bw)]
    header = (f"| {'model':<24} | {'T':>5} | {'path':<13} | {'time us':>8} | {'kernels':>7} | {'active MB':>9} "
              f"| {'GB/s':>6} | {'% copy':>6} |")
    print(header)
    print("|" + "|".join("-" * len(part) for part in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['model']:<24} | {r['tokens']:>5} | {r['path']:<13} | {r['us']:>8.1f} | {r['kernels']:>7} "
              f"| {r['bytes'] / 1e6:>9.1f} | {r['GB/s']:>6.0f} | {100 * r['frac_of_copy']:>5.1f}% |")
    for r in rows:
        if r["path"] == "fused layer":
            listed = ", ".join(f"{kernel[:40]} {us:.1f}" for kernel, us in r["kernel_us"])
            print(f"{r['model']} T={r['tokens']} fused layer kernels (us): {listed}")
    return rows

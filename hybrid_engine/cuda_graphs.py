"""Full-iteration decode CUDA graphs.

One graph per (padded batch size, sampler variant, row width) captures a whole decode
step (width 1: plain decode; with speculative decoding also the widest verify rows, input
token + K drafts, every position sampled and verified on the device):
decode inputs gathered from the previous step's samples on the device -> forward through
every layer kind (Mamba-2, attention, MLP, MoE) -> logits -> sampling (greedy graphs: the
argmax straight from the LM head's output) -> samples written to the runner's fixed
sample buffer. Every input lives at a fixed address (the step
buffer's device views), so a replay only needs the step's one host-to-device copy.

A decode batch is padded up to the next captured size; padding rows use Mamba slot -1,
KV slot -1 and sequence length 0, so they never touch real state. Steps with prefill
chunks, penalties or logprobs run eager (their shapes or sampler paths vary).
"""
import logging
import time

import torch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Ops a decode step calls: graphs are captured only when every one runs its fast kernel
# (sync-free; most of their reference ops are not).
DECODE_OPS = ("add_rms_norm", "gated_rms_norm", "linear_conv_update", "linear_relu_square", "causal_conv1d_update",
              "ssm_state_update", "causal_conv1d_verify", "ssm_state_verify", "write_kv_cache", "paged_attention",
              "moe_experts", "logits_argmax")


class DecodeGraphs:
    """Captured decode steps of a `ModelRunner`, replayed when a plan matches one."""

    def __init__(self, max_num_seqs: int, max_width: int = 1):
        sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(sizes))
        self.widths = sorted({1, max_width})
        self._graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = dict.fromkeys(self.widths, 0)  # replays per row width (tests, benchmarks)

    def padded_size(self, num_decode: int, num_prefill: int, use_penalties: bool, num_logprobs: int) -> int | None:
        """The captured batch size a step pads to, or None if it must run eager."""
        if num_prefill or use_penalties or num_logprobs >= 0:
            return None
        return next((b for b in self.sizes if b >= num_decode), None)

    @torch.inference_mode()
    def capture(self, runner) -> None:
        """Capture every (size, greedy / sampling) graph of `runner`'s decode step into one
        shared memory pool. (The runner is not kept: it holds these graphs, and a
        reference back would make a cycle that only the garbage collector could free.)"""
        torch.cuda.synchronize()
        start, mem_before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool blocks
            for width in reversed(self.widths):
                for all_greedy in (True, False):
                    plan = runner.padding_plan(size, all_greedy, width)
                    for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                        runner.forward_sample(plan)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = runner.forward_sample(plan)
                    self._graphs[(size, all_greedy, width)] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s, row widths %s) in %.1f s, %.1f MiB",
                    len(self._graphs), self.sizes, self.widths, time.perf_counter() - start, (torch.cuda.memory_allocated() - mem_before) / 2**20)

    def replay(self, plan) -> torch.Tensor | None:
        """Replay the graph captured for this (already padded) plan; None if there is none."""
        if plan.num_prefill or plan.use_penalties or plan.num_logprobs >= 0:
            return None
        entry = self._graphs.get((plan.num_decode, plan.all_greedy, plan.decode_width))
        if entry is None:
            return None
        graph, out = entry
        graph.replay()
        self.replays[plan.decode_width] += 1
        return out

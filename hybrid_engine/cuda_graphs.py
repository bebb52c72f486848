"""Full-iteration decode CUDA graphs.

Two graphs per (padded batch size, row width) capture a whole decode step (width 1: plain
decode; with speculative decoding also the widest verify rows, input token + K drafts,
every position sampled and verified on the device), one per sampler variant (greedy,
sampling): decode inputs gathered from the previous step's samples on the device ->
forward through every layer kind (Mamba-2, attention, MLP, MoE) -> logits -> sampling
(greedy graphs: the argmax straight from the LM head's output) -> samples written to the
runner's fixed sample buffer. Every input lives at a fixed address (the step buffer's
device views), so a replay only needs the step's one host-to-device copy.

A third graph per (size, width) stops at the sampled rows' final hidden states: a decode
step whose rows want penalties or logprobs (a sampler whose kernels and output width
vary with the batch) or a grammar's token mask (structured outputs) replays it and runs only the LM head and the sampler eagerly, so
that such requests decode at graph speed too.

A decode batch is padded up to the next captured size; padding rows use Mamba slot -1,
KV slot -1 and sequence length 0, so they never touch real state. Steps with prefill
chunks run eager (their shapes vary).
"""
import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# What a graph captures: a whole step with either sampler, or the forward up to the sampled
# rows' hidden states (steps with penalties or logprobs).
GREEDY, SAMPLING, FORWARD = "greedy", "sampling", "forward"
# Ops a decode step calls: graphs are captured only when every one runs its fast kernel
# (sync-free; most of their reference ops are not).
DECODE_OPS = ("add_rms_norm", "gated_rms_norm", "linear_conv_update", "linear_relu_square", "linear_write_kv",
              "causal_conv1d_update", "ssm_state_update", "causal_conv1d_verify", "ssm_state_verify", "write_kv_cache",
              "paged_attention", "moe_experts", "logits_argmax")


class DecodeGraphs:
    """Captured decode steps of a `ModelRunner`, replayed when a plan matches one."""

    def __init__(self, max_num_seqs: int, max_width: int = 1):
        sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(sizes))
        self.widths = sorted({1, max_width})
        # (size, width, GREEDY / SAMPLING / FORWARD) -> the graph and its output tensor
        self._graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = dict.fromkeys(self.widths, 0)  # replays per row width (tests, benchmarks)
        self.forward_replays = dict.fromkeys(self.widths, 0)  # of which forward graphs (penalties, logprobs)
        # `release` may come from another thread (a tensor-parallel driver's watch thread):
        # a graph is never destroyed between its lookup and its launch.
        self._lock = threading.Lock()
        self._released = False

    def padded_size(self, num_decode: int, num_prefill: int) -> int | None:
        """The captured batch size a step pads to, or None if it must run eager."""
        if num_prefill:
            return None
        return next((b for b in self.sizes if b >= num_decode), None)

    @torch.inference_mode()
    def capture(self, runner) -> None:
        """Capture every (size, width, greedy / sampling / forward) graph of `runner`'s decode
        step into one shared memory pool. (The runner is not kept: it holds these graphs, and a
        reference back would make a cycle that only the garbage collector could free.)"""
        torch.cuda.synchronize()
        start, mem_before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool blocks
            for width in reversed(self.widths):
                for kind in (GREEDY, SAMPLING, FORWARD):
                    plan = runner.padding_plan(size, kind != SAMPLING, width)
                    for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                        self._step(runner, plan, kind)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.graph(graph, pool=pool):
                            out = self._step(runner, plan, kind)
                    except BaseException:
                        graph.reset()  # (a partial graph may hold a collective: `release`)
                        raise
                    with self._lock:
                        if self._released:  # (a worker died: the watch thread released the others)
                            graph.reset()
                            raise RuntimeError("decode graphs released during their capture")
                        self._graphs[(size, width, kind)] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s, row widths %s) in %.1f s, %.1f MiB",
                    len(self._graphs), self.sizes, self.widths, time.perf_counter() - start, (torch.cuda.memory_allocated() - mem_before) / 2**20)

    def release(self) -> None:
        """Destroy every graph now, not when the garbage collector gets to them: NCCL frees
        a communicator only once no graph holding its collectives is left (a tensor-parallel
        rank's shutdown would wait forever). A graph still running is freed when it ends.
        Later steps of this runner run eagerly. Any thread."""
        with self._lock:
            for graph, _ in self._graphs.values():
                graph.reset()
            self._graphs.clear()
            self.sizes = []
            self._released = True

    @staticmethod
    def _step(runner, plan, kind: str) -> torch.Tensor:
        """The device work a graph of `kind` captures for `plan`."""
        if kind == FORWARD:
            return runner.forward_rows(plan, runner.forward_meta(plan))
        return runner.forward_sample(plan)

    def replay(self, plan, sampler: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """Run this (already padded) plan's step through its graphs: its packed samples, or
        None if no graph fits (prefill chunks, a size not captured). A plan with penalties
        or logprobs replays the forward graph and hands the sampled rows' hidden states to
        `sampler` (the runner's `sample_rows` for this plan, run eagerly); so does one with
        structured outputs (grammar masks)."""
        if plan.num_prefill:
            return None
        eager_sampler = plan.use_penalties or plan.num_logprobs >= 0 or plan.num_masks > 0
        kind = FORWARD if eager_sampler else GREEDY if plan.all_greedy else SAMPLING
        with self._lock:
            entry = self._graphs.get((plan.num_decode, plan.decode_width, kind))
            if entry is None:
                return None
            graph, out = entry
            graph.replay()
        self.replays[plan.decode_width] += 1
        if eager_sampler:
            self.forward_replays[plan.decode_width] += 1
            return sampler(out)
        return out

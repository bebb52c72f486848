"""The floors of a decode step for bench_decode.py: the bytes one step must move (weights,
Mamba state, KV) and the device copy bandwidth they are divided by, with the routed experts
an MoE step actually reads, recorded from its routers (see bench_decode.py's docstring for
the three floors).
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_engine import LLM
from layers.moe import GraniteMoE, NemotronHMoE
from step_probe import checked_step, finish, start_decoding

MOE_BLOCKS = (NemotronHMoE, GraniteMoE)


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


# ---- floors ------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks in layer order."""
    return [m for m in model.modules() if isinstance(m, MOE_BLOCKS)]


def routed_expert_weights(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's stacked routed-expert weights (up, down), each [E, ...]."""
    if isinstance(block, NemotronHMoE):
        return block.experts.up, block.experts.down
    return block.input_linear.weight, block.output_linear.weight


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens route to when each token picks `top_k`
    of `num_experts` uniformly and independently: an expert is missed by one token with
    probability 1 - k/E, by all of them with (1 - k/E)^B."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def distinct_experts(ids: torch.Tensor) -> int:
    """Distinct expert ids in a [tokens, k] routing."""
    return int(torch.unique(ids).numel())


@dataclass(frozen=True)
class MoeLayerBytes:
    """One MoE layer's routing shape and the bytes of one routed expert (up + down)."""

    num_experts: int
    top_k: int
    expert_bytes: int


@dataclass(frozen=True)
class WeightBytes:
    """A model's weight bytes: all of them, the routed experts' per MoE layer, and the input
    embedding table when the LM head does not share it (a step looks up only its tokens'
    rows of such a table, where the LM head reads a shared one whole)."""

    total: int
    moe_layers: tuple[MoeLayerBytes, ...]
    lookup_table: int = 0  # bytes of an input embedding table of its own (0: shared with the LM head)
    lookup_row: int = 0  # bytes of one of its rows

    def non_expert(self, batch: int) -> int:
        """What a step of `batch` tokens reads whatever the routing: all but the routed
        experts (the router, the shared expert, mixers, norms and LM head included), with
        `batch` rows of an input embedding table of its own in place of the whole table."""
        lookups = min(self.lookup_table, batch * self.lookup_row)
        routed = sum(layer.num_experts * layer.expert_bytes for layer in self.moe_layers)
        return self.total - routed - self.lookup_table + lookups

    def active(self, distinct: Sequence[float], batch: int) -> float:
        """Weight bytes of a step of `batch` tokens in which MoE layer i reads `distinct[i]`
        routed experts."""
        if len(distinct) != len(self.moe_layers):
            raise ValueError(f"distinct: {len(distinct)} counts for {len(self.moe_layers)} MoE layers")
        return self.non_expert(batch) + sum(d * layer.expert_bytes for d, layer in zip(distinct, self.moe_layers))

    def every_expert(self, batch: int) -> int:
        """Weight bytes of a step of `batch` tokens that reads every routed expert."""
        return self.active([layer.num_experts for layer in self.moe_layers], batch)

    def expected_distinct(self, batch: int) -> list[float]:
        """`expected_distinct_experts` of each MoE layer for a decode step of `batch` tokens."""
        return [expected_distinct_experts(layer.num_experts, layer.top_k, batch) for layer in self.moe_layers]


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Split the model's parameters (each shared tensor once) into routed experts, an input
    embedding table the LM head does not share, and the rest."""
    total = sum(tensor_bytes(p) for p in model.parameters())
    layers = []
    for block in moe_blocks(model):
        up, down = routed_expert_weights(block)
        layers.append(MoeLayerBytes(up.shape[0], block.top_k, (tensor_bytes(up) + tensor_bytes(down)) // up.shape[0]))
    table = model.input_embeddings().weight
    if table is model.lm_head.weight:
        return WeightBytes(total, tuple(layers))
    return WeightBytes(total, tuple(layers), tensor_bytes(table), tensor_bytes(table[0]))


def state_bytes(engine, batch: int, context: int) -> int:
    """Bytes of a decode step's cache traffic: per sequence, the Mamba state (conv + SSM,
    all Mamba layers) read and written, and `context` tokens of KV read (all attention layers)."""
    mamba = engine.mamba
    per_seq_state = tensor_bytes(mamba.conv_states[:, 0]) + tensor_bytes(mamba.ssm_states[:, 0])
    per_token_kv = sum(2 * tensor_bytes(k[0, 0]) for k, _ in engine.kv.kv_caches)
    return batch * (2 * per_seq_state + context * per_token_kv)


@dataclass(frozen=True)
class StepFloors:
    """Bytes one decode step must move at least, three ways (see the module docstring)."""

    all_weights: float
    active: float  # the routed experts measured in a step
    expected_active: float  # the routed experts of `expected_distinct_experts`
    distinct: tuple[int, ...]  # measured distinct experts, per MoE layer
    expected_distinct: tuple[float, ...]


def step_floors(engine, batch: int, context: int, distinct: Sequence[int]) -> StepFloors:
    """The floors of a decode step of `batch` sequences at `context` tokens whose MoE layers
    read `distinct` routed experts each (empty for a dense model: all three floors agree)."""
    weights, state = weight_bytes(engine.model), state_bytes(engine, batch, context)
    expected = weights.expected_distinct(batch)
    return StepFloors(weights.every_expert(batch) + state, weights.active(distinct, batch) + state,
                      weights.active(expected, batch) + state,
                      tuple(distinct), tuple(expected))


# ---- routing ------------------------------------------------------------------------------
class _RecordingOps:
    """An op set that passes every call through and keeps the expert ids its routers return."""

    def __init__(self, ops, into: list[torch.Tensor]):
        self.inner, self._into = ops, into

    def __getattr__(self, name: str):
        op = getattr(self.inner, name)
        if not name.startswith("route_"):
            return op

        def recorded(*args, **kwargs):
            weights, ids = op(*args, **kwargs)
            self._into.append(ids)
            return weights, ids
        return recorded


class RoutingRecorder:
    """While open, `ids[i]` collects the [tokens, k] expert ids that MoE layer i's router
    returns, one tensor per forward (eager forwards only: a graph replay runs no Python)."""

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.blocks]

    def __enter__(self) -> "RoutingRecorder":
        for block, into in zip(self.blocks, self.ids):
            block.ops = _RecordingOps(block.ops, into)
        return self

    def __exit__(self, *exc) -> None:
        for block in self.blocks:
            block.ops = block.ops.inner


def measure_distinct_experts(llm: LLM, batch: int, prompt_len: int) -> list[int]:
    """Distinct routed experts per MoE layer in one decode step of `batch` requests with
    distinct random prompts ([] for a dense model). That step runs eager even under CUDA
    graphs (so the routers' outputs can be recorded); rows padding it to a graph size are
    not counted."""
    engine, runner = llm.engine, llm.engine.runner
    if not moe_blocks(engine.model):
        return []
    ids = start_decoding(engine, batch, prompt_len, "route")
    launched = []
    launch = runner.launch

    def eager_launch(plan):
        launched.append(plan)
        graphs, runner.graphs = runner.graphs, None
        try:
            return launch(plan)
        finally:
            runner.graphs = graphs

    runner.launch = eager_launch
    try:
        with RoutingRecorder(engine.model) as recorder:
            checked_step(engine)
    finally:
        del runner.launch  # the instance attribute: the class method shows through again
    finish(engine, ids)
    if len(launched) != 1 or launched[0].num_prefill or len(launched[0].sched.decodes) != batch:
        raise RuntimeError(f"expected one decode-only launch of {batch} rows, got {len(launched)} launches")
    if any(len(per_layer) != 1 for per_layer in recorder.ids):
        raise RuntimeError("expected one router call per MoE layer in the recorded step")
    return [distinct_experts(per_layer[0][:batch]) for per_layer in recorder.ids]

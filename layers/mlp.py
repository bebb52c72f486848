"""Dense feed-forward blocks: NemotronH's relu^2 MLP and Granite's fused SwiGLU MLP.

Tensor parallel (`tp`): the intermediate size is split; the input projection is
column-parallel, the output projection row-parallel (the ranks' outputs are summed, the
bias added once). `partial` / `finish` split that sum out, so that a MoE block can add its
routed experts' partial output and reduce once.
"""
import torch
import torch.nn.functional as F
from torch import nn

from layers.kernels.ops import KernelOps
from layers.parallel import SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear


class _ParallelMLP(nn.Module):
    """What both MLPs share: `down(act(up(x)))` with a row-parallel `down` (the attribute
    `down_name`) and the partial / finished forms of it."""

    down_name: str

    def _down(self) -> RowParallelLinear:
        return getattr(self, self.down_name)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(up(x)): this rank's intermediate activations."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down()(self._hidden(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's unreduced share of the output, without the output bias."""
        return self._down().partial(self._hidden(x))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The full output from a sum of partial outputs (this MLP's and any others added to
        it): summed over the ranks, then the output bias."""
        return self._down().reduce(partial)


class Relu2MLP(_ParallelMLP):
    """down(relu(up(x))^2): NemotronH's MLP layers and shared experts."""

    down_name = "down_proj"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, ops: KernelOps,
                 tp: ParallelContext = SINGLE):
        super().__init__()
        self.ops = ops
        self.up_proj = ColumnParallelLinear(hidden_size, tp.shard(0, intermediate_size), bias=bias, ops=ops)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, ops=ops, tp=tp)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_relu_square(x, self.up_proj.weight, self.up_proj.bias)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's (up, down) weights for running this MLP as the shared expert inside
        the fused MoE op (`moe_experts`' shared_up / shared_down), or None when it has biases
        (the op has none)."""
        if self.up_proj.bias is not None or self.down_proj.bias is not None:
            return None
        return self.up_proj.weight, self.down_proj.weight


class SwiGLUMLP(_ParallelMLP):
    """output(silu(gate) * up) with gate and up fused in one `input_linear` (Granite); each
    rank holds the same share of the gate and of the up rows."""

    down_name = "output_linear"

    def __init__(self, hidden_size: int, intermediate_size: int, *, ops: KernelOps, tp: ParallelContext = SINGLE):
        super().__init__()
        self.input_linear = ColumnParallelLinear(
            hidden_size, tp.shard(0, intermediate_size, pieces=(0, intermediate_size)), bias=False, ops=ops)
        self.output_linear = RowParallelLinear(intermediate_size, hidden_size, bias=False, ops=ops, tp=tp)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (gate+up, down) weights for running this MLP as the shared expert
        inside the fused MoE op (`moe_experts`' shared_up / shared_down)."""
        return self.input_linear.weight, self.output_linear.weight

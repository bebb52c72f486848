"""Dense feed-forward blocks: NemotronH's relu^2 MLP and Granite's fused SwiGLU MLP."""
import torch
import torch.nn.functional as F
from torch import nn


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2): NemotronH's MLP layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(up, down) weights for running this MLP as the shared expert inside the fused MoE
        op (`moe_experts`' shared_up / shared_down), or None when it has biases (the op has none)."""
        if self.up_proj.bias is not None or self.down_proj.bias is not None:
            return None
        return self.up_proj.weight, self.down_proj.weight


class SwiGLUMLP(nn.Module):
    """output(silu(gate) * up) with gate and up fused in one `input_linear` (Granite)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate+up, down) weights for running this MLP as the shared expert inside the fused
        MoE op (`moe_experts`' shared_up / shared_down)."""
        return self.input_linear.weight, self.output_linear.weight

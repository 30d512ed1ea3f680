from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over flat tokens, with cos/sin tables built once for every position served."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.freq_factors = freq_factors
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables on device (default: where they are). Models are built on the meta device and take
        the checkpoint's tensors as parameters; these tables are non-persistent buffers, outside the state dict and
        its strict check, so the loader builds them once the model is loaded."""
        device = self.cos.device if device is None else torch.device(device)
        if device.type == "meta":
            return
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        if self.freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float64)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq).float()
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [tokens, 1, head_dim / 2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE on x: [tokens, heads, head_dim]."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import backend
from tokenmill.kernels import gpu
from tokenmill.layers.linear import row_matmul_takes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if backend.gpu_runs(x):  # one launch (kernels/gpu.py), rows of any leading shape
            return gpu.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if backend.cpu_kernels(x.device):  # one pass (kernels/norm.cpp): torch's is ~8 small ops
            return torch.ops.tokenmill.rms_norm(x, self.weight, self.eps)
        # PyTorch's fused kernel: statistics in fp32 whatever the compute dtype; in fp32 bitwise equal to the
        # reference formula, in bf16 closer to exact (it rounds once, not twice).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm); the sum is written into x where the kernels run (x must be a tensor the
        caller owns: the residual stream)."""
        if backend.gpu_runs(x):
            return x, gpu.rms_norm(x, self.weight, self.eps, residual)
        if backend.cpu_kernels(x.device):
            return x, torch.ops.tokenmill.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return x, self(x)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                    linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream: x + residual, or x where residual is None; linear of its norm). A one-sequence decode
        step's row on a GPU runs both as one kernel (gpu.row_matmul), which gives the sum as a new tensor."""
        if row_matmul_takes(linear, x):
            out, stream = gpu.row_matmul(x, linear.weight, linear.bias, "norm" if residual is None else "add_norm",
                                         self.weight, self.eps, residual)
            return (x if stream is None else stream), out
        x, h = (x, self(x)) if residual is None else self.add_and_norm(x, residual)
        return x, linear(h)

"""Linear layers with weights prepacked for the CPU's matmul library, swapped in after loading (as gpt-fast swaps
in quantized Linears).

oneDNN reorders a weight into its own blocked layout on every plain matmul call; PackedLinear has it done once, at
load, for bitwise the same results several times faster (docs/performance/tuning.md).

On a GPU, project() and RMSNorm.norm_linear send a one-row matmul of a plain Linear, and one of up to 8 rows of a
quantized one, to tokenmill's row_matmul kernel (kernels/gpu.py), the norm or SwiGLU before it fused in.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import nn

from tokenmill import cpu
from tokenmill.kernels import gpu
from tokenmill.layers.quantized import GpuQuantizedLinear

# The row count oneDNN picks the layout for: the layout chosen for 32 serves 1 to 2048 rows well.
PACK_FOR_ROWS = 32


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    # Private ops (inductor's CPU path uses them): a torch without them loads the plain Linears instead.
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.computes_bf16())


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out], for a weight of [out, in]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# Rows of every matmul call in deterministic mode: a fixed shape, so the library picks one kernel, blocking and
# thread split whatever the batch. Measured (torch 2.13, Zen 3): a row's result did not depend on its place in the
# tile nor on the other rows, fp32 and bf16, plain and prepacked. The price: a 1-2 row decode step computes a whole
# tile (the dense fp32 model's two-stream decode took 1.8x as long).
INVARIANT_ROWS = 16


class RowInvariantLinear(nn.Module):
    """A Linear (plain or prepacked) run on tiles of INVARIANT_ROWS rows, the last one padded with zeros, so that
    each row's output depends on that row alone (deterministic mode); the library's own choice depends on the row
    count, and a different count can round a row differently."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = torch.nn.functional.pad(x, (0, 0, 0, -rows % INVARIANT_ROWS))
        return torch.cat([self.inner(tile) for tile in padded.split(INVARIANT_ROWS)])[:rows]


def make_row_invariant(module: nn.Module) -> None:
    """Wrap every dense Linear under module (nn.Linear, PackedLinear) in a RowInvariantLinear."""
    for parent in list(module.modules()):
        if isinstance(parent, RowInvariantLinear):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear | PackedLinear):
                setattr(parent, name, RowInvariantLinear(child))


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these tensors (no initialisation of its own), for prepack_linears to take like any."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def prepack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under module by a PackedLinear of the same weights."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))


def row_matmul_takes(linear: nn.Module, x: torch.Tensor) -> TypeGuard[nn.Linear | GpuQuantizedLinear]:
    """Whether linear's matmul of x runs as tokenmill's row_matmul kernel (a decode step of one sequence, or of a few
    over quantized weights, on a GPU: kernels/gpu.py), with the op before it fused in where the caller has one."""
    if isinstance(linear, GpuQuantizedLinear):
        return gpu.row_matmul_runs(x, quantized=True)
    return isinstance(linear, nn.Linear) and gpu.row_matmul_runs(x)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x), through the row_matmul kernel where it takes it."""
    if row_matmul_takes(linear, x):
        return gpu.row_matmul(x, linear.weight, linear.bias)[0]
    return linear(x)

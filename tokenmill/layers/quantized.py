"""Weights kept in GGUF's quantization: the layout our C++ kernel reads (tokenmill/kernels/quant.cpp), and the
Linear and Embedding that use it.

A QuantizedWeight is w = scale * (q - zero) + min per block of `sub` weights along a row, which is exactly how GGUF's
Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 dequantize (loader/gguf_blocks.py converts them, keeping every
value: dequantize() equals gguf's own dequantization bit for bit in fp32). 4-bit types pack two weights a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class QuantizedWeight:
    # uint8 [out, in/2]: 4-bit, weight j of block b in the low nibble of byte 16b+j, weight 16+j in its high nibble;
    # int8 [out, in]: one weight a byte
    qweight: torch.Tensor
    scales: torch.Tensor  # fp32 [out, in/sub]
    mins: torch.Tensor | None  # fp32 [out, in/sub], or None for 0
    zero: int  # subtracted from 4-bit q (8 for Q4_0); 0 for int8 storage, whose q are signed already
    sub: int  # weights per scale: 32, or 16 (Q6_K)

    @property
    def packed4(self) -> bool:
        return self.qweight.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int]:
        out, width = self.qweight.shape
        return out, width * 2 if self.packed4 else width

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales) + (() if self.mins is None else (self.mins,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def q(self) -> torch.Tensor:
        """The integer q - zero of every weight, [out, in] int16."""
        if not self.packed4:
            return self.qweight.to(torch.int16)
        out, width = self.qweight.shape
        blocks = self.qweight.view(out, width // 16, 16).to(torch.int16)
        return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).view(out, width * 2) - self.zero

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, width = self.shape
        w = self.q().view(out, width // self.sub, self.sub).float() * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(out, width).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the given rows (output features), in that order."""
        return QuantizedWeight(self.qweight.index_select(0, index), self.scales.index_select(0, index),
                               None if self.mins is None else self.mins.index_select(0, index), self.zero, self.sub)

    def layout(self) -> tuple[torch.dtype, int, int, bool]:
        return self.qweight.dtype, self.zero, self.sub, self.mins is not None

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The parts' rows one after another, or None when their layouts differ (the caller dequantizes them)."""
        if len({p.layout() for p in parts}) != 1:
            return None
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
        return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins,
                               parts[0].zero, parts[0].sub)


# From this many rows a step runs the dense copy where there is one. Measured on SmolLM2, 2-core AVX2 Zen 3, fp32:
# the kernel 1.35x faster than dense over HTTP at 8 streams; at 32 rows the profiled step's matmuls 1.36 ms a call
# quantized against 0.81 ms dense (whole steps too noisy there to tell); 256-row matmuls 1.6-1.9x faster dense.
DENSE_FROM_ROWS = 32


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.dense: nn.Module | None = None  # a dequantized (prepacked) copy for many-row steps, memory allowing
        # Without one: steps of this many rows or more dequantize the matrix for the matmul library (0: never).
        # Measured on a 1.1B model's 11264 x 2048 Q4_0 gate|up, bf16, 2-core Zen 5: the C++ dequantization takes
        # 7 ms (torch's ops 45); the kernel against dequantizing + matmul, 64 rows 8.5 vs 11.5 ms, 128 rows 16.8 vs
        # 14.7, 512 rows 76 vs 42.
        self.dequantize_from_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if self.dense is not None and x.shape[0] >= DENSE_FROM_ROWS:
            return self.dense(x)
        w = self.weight
        if self.dequantize_from_rows and x.shape[0] >= self.dequantize_from_rows:
            dense = torch.ops.tokenmill.dequantize(w.qweight, w.scales, w.mins, w.sub, w.zero, w.shape[1], x.dtype)
            return F.linear(x, dense, self.bias)
        out = torch.ops.tokenmill.quantized_linear(x, w.qweight, w.scales, w.mins, w.sub, w.zero)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized table, dequantized as they are looked up."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids).dequantize(self.dtype)


"""Weights kept in GGUF's quantization: the layout our C++ kernel reads (tokenmill/kernels/quant.cpp), and the
Linear and Embedding that use it.

A QuantizedWeight is w = scale * (q - zero) + min per block of `sub` weights along a row, which is exactly how GGUF's
Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 dequantize (loader/gguf_blocks.py converts them, keeping every
value: dequantize() equals gguf's own dequantization bit for bit in fp32). 4-bit types pack two weights a byte,
5- and 6-bit ones the same and planes of their higher bits; Q8_0 takes a byte a weight.
Rows are interleaved by 16 (INTERLEAVE), four weights of each row at a time, so that the kernel advances 16 output
rows with one vector instruction.

A dense model's bf16 weights take the same layout at 16 bits a weight (from_dense): the kernels' path, the fused
decode layer's included, for matrices that oneDNN would multiply one op at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import backend
from tokenmill.kernels import gpu

INTERLEAVE = 16  # output rows a group interleaves: kInterleave in kernels/cpu.h
# bf16 weights: a block of 32 as 16 pairs, pair r of weights r's first and that + 2 (kernels/cpu.h's pair_first):
# PAIR_ORDER[k] is the weight at position k of a block's pairs.
PAIR_ORDER = torch.tensor([4 * (r // 4) + (r % 4 >> 1) + 16 * (r % 2) + 2 * second
                           for r in range(16) for second in (0, 1)])


@dataclass
class QuantizedWeight:
    # [groups, in/32, chunks, 16, 4]: group g holds rows 16g..16g+15 (the last padded with zeros), a row's block of 32
    # weights as chunks of four bytes, chunk c of the 16 rows side by side. uint8, 4 chunks: byte j of a block holds
    # weight j in its low nibble and weight 16+j in its high one; uint8, 5 chunks: those of the low four bits, then
    # the fifth bits (byte k: of weight 4c+k in bit 2c, of 16+4c+k in bit 2c+1; kernels/quant.cpp); uint8, 6
    # chunks: the nibbles, then the top two bits of weights 4c+k and of 16+4c+k (bits 2c, 2c+1 of byte k of chunk 4,
    # and of chunk 5); int8, 8 chunks: one weight a byte; uint8, 16 chunks: bf16 values, chunk c the pair of
    # weights PAIR_ORDER[2c], PAIR_ORDER[2c + 1] (from_dense). The chunks a block takes are its bits a weight.
    qweight: torch.Tensor
    scales: torch.Tensor  # [groups, in/sub, 16]: fp32, or fp16 where every scale and min is an fp16 value; bf16: empty
    mins: torch.Tensor | None  # [groups, in/sub, 16] of the scales' dtype, or None for 0
    zero: int  # subtracted from q (Q4_0: 8, Q5_0: 16, Q6_K: 32); 0 for int8 storage, whose q are signed already
    sub: int  # weights per scale: 32, or 16 (Q6_K)
    out_features: int

    @staticmethod
    def interleave(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, zero: int,
                   sub: int) -> QuantizedWeight:
        """From rows one after another: q uint8 [out, in/2] (block b of 32 weights in bytes 16b..16b+15, weight j in
        the low nibble of byte j and 16+j in its high one), uint8 [out, in*bits/8] (5 or 6 bits: each block's 16
        such bytes, then the 4 or 8 bytes of its higher bits) or int8 [out, in]; scales and mins [out, in/sub]."""
        out = q.shape[0]
        pad = -out % INTERLEAVE

        def grouped(t: torch.Tensor, inner: int) -> torch.Tensor:  # [out, n * inner] -> [groups, n, ..., 16, inner]
            t = F.pad(t, (0, 0, 0, pad)) if pad else t
            return t.view(-1, INTERLEAVE, t.shape[1] // inner, inner).transpose(1, 2)

        chunks = q.shape[1] * 8 // (scales.shape[1] * sub)  # bytes a row's block of 32, over 4
        qweight = grouped(q, 4 * chunks).reshape(-1, q.shape[1] // (4 * chunks), INTERLEAVE, chunks, 4)
        return QuantizedWeight(
            qweight.transpose(2, 3).contiguous(), grouped(scales, 1).squeeze(-1).contiguous(),
            None if mins is None else grouped(mins, 1).squeeze(-1).contiguous(), zero, sub, out)

    @staticmethod
    def from_dense(weight: torch.Tensor) -> QuantizedWeight:
        """A dense [out, in] matrix (in a multiple of 32) rounded to bf16, in the 16-bit layout."""
        out, width = weight.shape
        w = F.pad(weight.to(torch.bfloat16), (0, 0, 0, -out % INTERLEAVE))
        pairs = w.view(-1, INTERLEAVE, width // 32, 32)[..., PAIR_ORDER]  # [groups, 16, blocks, 32]
        qweight = pairs.view(*pairs.shape[:3], 16, 2).permute(0, 2, 3, 1, 4).contiguous()  # [groups, blocks, 16, 16, 2]
        return QuantizedWeight(qweight.view(torch.uint8), torch.empty(0), None, 0, 32, out)

    def plain(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """interleave's arguments back (q, scales, mins), of every row or of the given ones, in that order."""
        if index is None:
            index = torch.arange(self.out_features)
        g, lane = index // INTERLEAVE, index % INTERLEAVE
        q = self.qweight[g, :, :, lane].reshape(len(index), -1)  # [n, blocks, chunks, 4]: a row's bytes in order
        return q, self.scales[g, :, lane], None if self.mins is None else self.mins[g, :, lane]

    @property
    def bits(self) -> int:
        return self.qweight.shape[2]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.qweight.shape[1] * 32

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales) + (() if self.mins is None else (self.mins,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The dense [out, in] matrix, or the given rows of it."""
        if self.bits == 16:
            index = torch.arange(self.out_features) if rows is None else rows
            # [n, blocks, 16, 2]: each row's pairs
            pairs = self.qweight.view(torch.bfloat16)[index // INTERLEAVE, :, :, index % INTERLEAVE]
            dense = torch.empty_like(pairs).view(len(index), -1, 32)
            dense[..., PAIR_ORDER] = pairs.reshape(dense.shape)
            return dense.view(len(index), -1).to(dtype)
        q, scales, mins = self.codes(rows)
        n, width = q.shape
        w = (q.view(n, width // self.sub, self.sub) - self.zero).float() * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.view(n, width).to(dtype)

    def codes(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """plain()'s q as one int16 a weight [n, in] (before the zero point), its scales and mins."""
        q, scales, mins = self.plain(rows)
        n, width = q.shape[0], self.shape[1]
        if self.bits == 8:
            return q.view(n, width).to(torch.int16), scales, mins
        blocks = q.view(n, width // 32, 4 * self.bits).to(torch.int16)
        nibbles = blocks[..., :16]
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)
        if self.bits > 4:  # the bits above the nibbles: the layout's comment above, kernels/cpu.h's high_chunk
            planes = blocks[..., 16:].reshape(n, width // 32, -1, 1, 4)  # [n, blocks, planes, 1 (c), 4 (k)]
            c = torch.arange(4).view(4, 1)
            high = [(planes[:, :, half if self.bits == 6 else 0] >> (2 * c + (half if self.bits == 5 else 0)))
                    & (3 if self.bits == 6 else 1) for half in (0, 1)]
            q = q | (torch.cat([h.flatten(-2) for h in high], dim=2) << 4)
        return q.view(n, width), scales, mins

    def gpu_rows(self, device: torch.device) -> gpu.QuantizedRows:
        """The same values in the GPU kernels' layout, on device: plain()'s rows, whose blocks are already what the
        kernels read."""
        q, scales, mins = self.plain()
        return gpu.QuantizedRows(q.to(device), scales.to(device), None if mins is None else mins.to(device),
                                 self.zero, self.sub, self.bits)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the given rows (output features), in that order."""
        return QuantizedWeight.interleave(*self.plain(index), self.zero, self.sub)

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """The weight of input features start..end, both on a block of 32 (a block is never cut)."""
        if start % 32 or end % 32:
            raise ValueError(f"columns {start}..{end} cut a block of 32 weights")
        q, scales, mins = self.plain()
        blocks = q.view(q.shape[0], self.shape[1] // 32, -1)[:, start // 32:end // 32]
        per_scale = slice(start // self.sub, end // self.sub)
        return QuantizedWeight.interleave(blocks.reshape(q.shape[0], -1), scales[:, per_scale],
                                          None if mins is None else mins[:, per_scale], self.zero, self.sub)

    def layout(self) -> tuple[int, int, int, bool]:
        return self.bits, self.zero, self.sub, self.mins is not None

    def widened(self, sub: int, with_mins: bool) -> QuantizedWeight:
        """The same values in the 8-bit layout with a scale per `sub` weights and, if with_mins, a min (q - zero
        fits a signed byte for every type)."""
        q, scales, mins = self.codes()
        repeat = self.sub // sub
        scales = scales.repeat_interleave(repeat, dim=1)
        mins = torch.zeros_like(scales) if mins is None else mins.repeat_interleave(repeat, dim=1)
        return QuantizedWeight.interleave((q - self.zero).to(torch.int8), scales, mins if with_mins else None, 0, sub)

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after another; where their layouts differ (a Q5_0 query beside a Q8_0 value, a Q4_K
        one beside a Q6_K value), in the 8-bit layout that holds them all, still fewer bytes than a dense copy."""
        if len({p.layout() for p in parts}) != 1:
            sub, with_mins = min(p.sub for p in parts), any(p.mins is not None for p in parts)
            parts = [p.widened(sub, with_mins) for p in parts]
        plains = [p.plain() for p in parts]
        dtype = torch.float32 if len({p.scales.dtype for p in parts}) > 1 else parts[0].scales.dtype
        mins = None if parts[0].mins is None else torch.cat([m.to(dtype) for _, _, m in plains])  # type: ignore[union-attr]
        return QuantizedWeight.interleave(torch.cat([q for q, _, _ in plains]),
                                          torch.cat([s.to(dtype) for _, s, _ in plains]), mins, parts[0].zero,
                                          parts[0].sub)


# From this many rows a step runs the dense copy where there is one (bf16 on an AMX CPU by default, registry.py):
# the matmul library beat an earlier quantized kernel from about there; not measured again against today's
# (docs/performance/tuning.md).
DENSE_FROM_ROWS = 32


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.dense: nn.Module | None = None  # a dequantized (prepacked) copy for many-row steps, memory allowing
        # Without one: steps of this many rows or more dequantize the matrix for the matmul library (0: never, the
        # default: the kernel was faster at every row count measured; docs/performance/tuning.md).
        self.dequantize_from_rows = 0
        # Steps of this many rows or more run on AMX tiles in bf16 (kernels/tiles.cpp; 0: never): models/registry.py
        # sets it for a bf16 model on a CPU with AMX.
        self.tiles_from_rows = 0
        # bf16 rows multiply bf16 weights as bf16 pairs (vdpbf16ps) where the CPU has them, else widened to fp32:
        # models/registry.py sets it from backend.bf16_pair_matmul.
        self.pairs = True

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized in one C++ pass (the same values as QuantizedWeight.dequantize)."""
        return kernel_dequantize(self.weight, dtype)

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x: [rows, in] -> [rows, out], in x's dtype, or fp32 where float_out asks (the kernel's sums as they are:
        the output head's logits)."""
        if self.dense is not None and x.shape[0] >= DENSE_FROM_ROWS:
            return self.dense(x)
        w = self.weight
        if self.dequantize_from_rows and x.shape[0] >= self.dequantize_from_rows:
            return F.linear(x, self.dense_weight(x.dtype), self.bias)
        out = torch.ops.tokenmill.quantized_linear(x, w.qweight, w.scales, w.mins, w.sub, w.zero, w.out_features,
                                                   self.tiles_from_rows, False, float_out, self.pairs)
        return out if self.bias is None else out + self.bias


def bf16_linears(module: nn.Module, exact_only: bool) -> int:
    """Replace every nn.Linear under module (of inputs a multiple of 32) by a QuantizedLinear of its weights in the
    16-bit layout (QuantizedWeight.from_dense); exact_only: of those whose values are bf16 ones only (an fp32 model
    of a bf16 checkpoint), so that the model computes the same. Returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.in_features % 32 or not child.in_features:
                continue
            w = child.weight.detach()
            if exact_only and not torch.equal(w.to(torch.bfloat16).to(w.dtype), w):
                continue
            bias = None if child.bias is None else child.bias.detach()
            setattr(parent, name, QuantizedLinear(QuantizedWeight.from_dense(w), bias))
            swapped += 1
    return swapped


class GpuQuantizedLinear(nn.Module):
    """A quantized Linear on a GPU (gpu.QuantizedRows): steps of up to gpu.QUANTIZED_ROWS rows run row_matmul on the
    quantized weights, which layers/linear.project and the norms fuse their ops into; more rows take the dense copy
    where there is one, else the matrix dequantized for cuBLAS's matmul."""

    def __init__(self, weight: gpu.QuantizedRows, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.dense: nn.Module | None = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if gpu.row_matmul_runs(x, quantized=True):
            return gpu.row_matmul(x, self.weight, self.bias)[0]
        if self.dense is not None:
            return self.dense(x)
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


def on_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight | gpu.QuantizedRows:
    """weight as the kernels of device read it."""
    return weight.gpu_rows(device) if device.type == "cuda" else weight


def linear_module(weight: QuantizedWeight | gpu.QuantizedRows, bias: torch.Tensor | None) -> nn.Module:
    """The Linear of on_device's weight."""
    if isinstance(weight, gpu.QuantizedRows):
        return GpuQuantizedLinear(weight, bias)
    return QuantizedLinear(weight, bias)


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized table, dequantized as they are looked up (on the CPU or, as gpu.QuantizedRows, a GPU);
    or of a tied head's bf16 table in the kernels' 16-bit layout, read back as they are."""

    def __init__(self, weight: QuantizedWeight | gpu.QuantizedRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, QuantizedWeight) and w.bits < 16 and backend.cpu_kernels(ids.device):
            rows = kernel_dequantize(w, self.dtype, ids.flatten())
        else:
            rows = w.dequantize(self.dtype, rows=ids.flatten())
        return rows.view(*ids.shape, -1)


def kernel_dequantize(w: QuantizedWeight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """w.dequantize(dtype, rows) in one C++ pass (kernels/quant.cpp), the same values bit for bit."""
    return torch.ops.tokenmill.dequantize(w.qweight, w.scales, w.mins, w.sub, w.zero, w.out_features, dtype, rows)


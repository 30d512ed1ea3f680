"""A quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3), in torch: the write and the read of the paths that do
not run the C++ kernels, bit for bit as kernels/cpu.h's store_row writes them.

Each KV head's row of a token is its head_dim numbers (int8, or fp8 e4m3) and then their fp32 scale in 4 bytes: a
pool is [blocks, block size, kv heads, head_dim + 4] of the storage dtype, so blocks move, get shared and get freed
as any pool's do. One scale per token and KV head: a block is never re-scaled as tokens join it, and a token's KV
is the same bits whether its step was a prefill or a decode. amax / 127 for int8 (rounded to nearest, ties to
even), amax / 448 (e4m3's largest finite) for fp8."""

from __future__ import annotations

import torch

# --kv-cache-dtype's names -> the pool's storage dtype (auto: the model's compute dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
SCALE_BYTES = 4
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def largest(dtype: torch.dtype) -> float:
    """A quantized pool's largest number, which a row's amax maps to (its scale's divisor); 0 for another pool."""
    return _LARGEST.get(dtype, 0.0)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one KV head's row of a token in a pool of this dtype."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> its rows in a pool of dtype, [..., head_dim + 4]."""
    wide = x.float()
    scale = wide.abs().amax(-1, keepdim=True) / largest(dtype)
    numbers = torch.where(scale > 0, wide / scale, 0.0)  # within +-largest (an ulp past it rounds back)
    stored = numbers.round().to(torch.int8) if dtype == torch.int8 else numbers.to(torch.float8_e4m3fn)
    return torch.cat([stored.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1).view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized pool's rows [..., head_dim + 4] -> their values [..., head_dim] in dtype."""
    raw = rows.view(torch.uint8)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (raw[..., :-SCALE_BYTES].view(rows.dtype).float() * scale).to(dtype)


def readable(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a pool, as values of the compute dtype (a pool of that dtype: as they are)."""
    return dequantize(rows, dtype) if is_quantized(rows.dtype) else rows.to(dtype)


def store(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [tokens, kv heads, head_dim] into one layer's pool [blocks, block size, kv heads, width] at the
    tokens' flat slots."""
    rows = quantize(x, pool.dtype) if is_quantized(pool.dtype) else x.to(pool.dtype)
    if is_quantized(pool.dtype):  # index_copy_ has no fp8 kernel: the bytes, as bytes
        pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
    pool.view(-1, *rows.shape[1:]).index_copy_(0, slots, rows)

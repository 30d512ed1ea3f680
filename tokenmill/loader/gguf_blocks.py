"""GGUF's quantized blocks as QuantizedWeights (layers/quantized.py), every value kept.

Each type's block layout is read as gguf-py's dequantize reads it; scales become fp32 exactly as gguf computes them
(K-quants: the super-block's d times the 6-bit sub-block scale), so QuantizedWeight.dequantize() reproduces
gguf.quants.dequantize bit for bit in fp32 (tests/unit/test_quantized.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import Q4_K

from tokenmill.layers.quantized import QuantizedWeight

# q [n, per block] (uint8 of 4 to 6 bits, or int8), scales, mins, zero, sub
_Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]


_BITS = {QType.Q5_0: 5, QType.Q5_1: 5, QType.Q5_K: 5, QType.Q6_K: 6}  # the other uint8 types: 4


def _packed(q: np.ndarray, bits: int) -> np.ndarray:
    """Weights of 4 to 6 bits [rows, blocks, 32] as QuantizedWeight.interleave takes them: per block, weight j and
    16 + j in the low and high nibble of byte j; 5 bits: then 4 bytes of the fifth bits, of weight 4c + k in bit 2c
    of byte k and of weight 16 + 4c + k in bit 2c + 1; 6 bits: then 4 bytes of the top two bits of weights 4c + k
    (bits 2c, 2c + 1 of byte k) and 4 of weights 16 + 4c + k."""
    rows = q.shape[0]
    nibbles = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << 4)
    if bits == 4:
        return nibbles.reshape(rows, -1)
    high = (q >> 4).reshape(rows, -1, 2, 4, 4)  # [rows, blocks, half, c, k]
    c = 2 * np.arange(4, dtype=np.uint8).reshape(4, 1)
    # The bits are distinct, so their sum is their or: one plane [rows, blocks, k], or one for each half.
    if bits == 5:
        planes = (high << (c + np.arange(2, dtype=np.uint8).reshape(2, 1, 1))).sum(axis=(2, 3), dtype=np.uint8)
    else:
        planes = (high << c).sum(axis=3, dtype=np.uint8).reshape(rows, -1, 8)
    return np.concatenate((nibbles, planes), axis=2).reshape(rows, -1)


def _f16(field: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] fp32."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16 k] bytes -> [n, 32 k]: per 16 bytes, the low nibbles then the high ones (GGUF's order)."""
    n = qs.shape[0]
    groups = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (groups & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes, one bit per weight of a 32-block (Q5_0, Q5_1) -> [n, 32] of 0 or 16."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q4_0(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None, 8, 32


def _q4_1(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 32


def _q8_0(b: np.ndarray) -> _Parts:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None, 0, 32


def _q5_0(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), _f16(b[:, :2]), None, 16, 32


def _q5_1(b: np.ndarray) -> _Parts:
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 32


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K and Q5_K: per 32-block scale d * sc and min -(dmin * m), [n, 8] each."""
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256]: per 32 bytes, the low nibbles (one 32-block) then the high ones (the next)."""
    n = qs.shape[0]
    groups = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (groups & 0x0F).reshape(n, -1)


def _q4_k(b: np.ndarray) -> _Parts:
    scales, mins = _k_scales(b)
    return _k_nibbles(b[:, 16:]), scales, mins, 0, 32


def _q5_k(b: np.ndarray) -> _Parts:
    scales, mins = _k_scales(b)
    n = b.shape[0]
    high = ((b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    return _k_nibbles(b[:, 48:]) | high.reshape(n, -1).astype(np.uint8), scales, mins, 0, 32


def _q6_k(b: np.ndarray) -> _Parts:
    n = b.shape[0]
    low = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(n, -1) | (high.reshape(n, -1) << 4)
    scales = _f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q, scales, None, 32, 16


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K and Q3_K's [n, 64] bytes -> [n, 256] 2-bit values: per 32 bytes, bits 0-1 of each (32 weights), then bits
    2-3, 4-5 and 6-7."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, -1)


def _q2_k(b: np.ndarray) -> _Parts:
    """Codes 0-3 in the 4-bit layout, with a scale d * sc and a min -(dmin * m) per 16 (8 bits a weight with them,
    against 16 dense)."""
    sc = b[:, :16]
    scales = _f16(b[:, 80:82]) * (sc & 0x0F).astype(np.float32)
    mins = -(_f16(b[:, 82:84]) * (sc >> 4).astype(np.float32))
    return _two_bit_planes(b[:, 16:80]), scales, mins, 0, 16


def _q3_k(b: np.ndarray) -> _Parts:
    """Codes -4 to 3 in the 4-bit layout (stored + 4: the zero point is 4), with a scale d * (sc - 32) per 16 (6 bits
    a weight with it, against 16 dense). A weight's third bit set means no offset: low 2 bits - 4 * (1 - bit)."""
    n = b.shape[0]
    # weight i's third bit: bit i // 32 of byte i % 32
    high = (b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = _two_bit_planes(b[:, 32:96]) | (high.reshape(n, -1) << 2)  # + 4 where the bit is set: (q + 4)
    low = (b[:, 96:104].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16) & 0x0F
    top = (b[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16) & 3
    scales = _f16(b[:, 108:110]) * ((low | (top << 4)).astype(np.float32) - 32)
    return codes, scales, None, 4, 16


# type -> (bytes per block, reader)
_READERS: dict[QType, tuple[int, Callable[[np.ndarray], _Parts]]] = {
    QType.Q4_0: (18, _q4_0), QType.Q4_1: (20, _q4_1), QType.Q8_0: (34, _q8_0), QType.Q5_0: (22, _q5_0),
    QType.Q5_1: (24, _q5_1), QType.Q4_K: (144, _q4_k), QType.Q5_K: (176, _q5_k), QType.Q6_K: (210, _q6_k),
    QType.Q2_K: (84, _q2_k), QType.Q3_K: (110, _q3_k),
}
QUANTIZED_TYPES = frozenset(_READERS)


def quantized_weight(data: np.ndarray, qtype: QType) -> QuantizedWeight:
    """A 2-D GGUF tensor's raw bytes [rows, bytes per row] as a QuantizedWeight of the same rows."""
    block_bytes, read = _READERS[qtype]
    rows = data.shape[0]
    q, scales, mins, zero, sub = read(data.reshape(-1, block_bytes))
    if q.dtype == np.uint8:
        q = _packed(q.reshape(rows, -1, 32), _BITS.get(qtype, 4))
    # fp16 where that holds every value (the types whose scales are the file's fp16 fields: Q4_0, Q4_1, Q5_0, Q5_1,
    # Q8_0): the kernel reads 2 bytes less per 32 weights; the K-quants' products of two scales stay fp32.
    if all(a is None or np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (scales, mins)):
        scales = scales.astype(np.float16)
        mins = None if mins is None else mins.astype(np.float16)
    return QuantizedWeight.interleave(
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, -1)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins).reshape(rows, -1)), zero, sub)

"""Decode attention over gathered blocks against a naive per-sequence reference (GQA, ragged lengths)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.layers.attention import _causal_sdpa, _decode_attention, _key_mask

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
              scale: float, window: int = 0) -> torch.Tensor:
    """float64, one sequence and one head at a time, over only the keys that exist (the last `window` of them)."""
    b, heads, _ = q.shape
    group = heads // keys.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(b):
        first = max(lengths[i] - window, 0) if window else 0
        for h in range(heads):
            k = keys[i, first: lengths[i], h // group].double()
            v = values[i, first: lengths[i], h // group].double()
            out[i, h] = ((q[i, h].double() @ k.T) * scale).softmax(-1) @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_a_naive_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b, heads, kv_heads, dim, width = 5, 6, 2, 16, 48
    lengths = [1, 7, 16, 33, 48]
    q = torch.randn(b, heads, dim, dtype=dtype)
    keys = torch.randn(b, width, kv_heads, dim, dtype=dtype)
    values = torch.randn(b, width, kv_heads, dim, dtype=dtype)
    # Padding past each length holds huge values: any leak through the mask shows.
    for i, n in enumerate(lengths):
        keys[i, n:], values[i, n:] = 1e4, -1e4
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    out = _decode_attention(q, keys, values, mask, dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    diff = (out.double() - reference(q, keys, values, lengths, dim**-0.5)).abs().max().item()
    assert diff < TOLERANCE[dtype], diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_mask_means_every_key(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    q = torch.randn(1, 6, 16, dtype=dtype)
    keys, values = torch.randn(1, 20, 2, 16, dtype=dtype), torch.randn(1, 20, 2, 16, dtype=dtype)
    every_key = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    assert torch.equal(_decode_attention(q, keys, values, None, 0.25),
                       _decode_attention(q, keys, values, every_key, 0.25))


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [16, 64, 128, 256])  # 64, 128 and 256 have a vector path of their own (AVX-512)
@pytest.mark.parametrize("window", [0, 6])  # 6: a sliding layer's, starting inside a block
def test_the_paged_kernel_reads_each_sequence_through_its_block_table(dtype: torch.dtype, dim: int,
                                                                      window: int) -> None:
    """kernels/attention.cpp against the same reference: scattered, shared and padded blocks in the pool."""
    torch.manual_seed(2)
    b, heads, kv_heads, block, width = 4, 6, 2, 4, 5
    lengths = [1, 5, 17, 20]
    pool_k = torch.full((24, block, kv_heads, dim), 1e4, dtype=dtype)  # blocks nobody's table names hold garbage
    pool_v = torch.full((24, block, kv_heads, dim), -1e4, dtype=dtype)
    tables = torch.zeros(b, width, dtype=torch.long)
    keys = torch.randn(b, width * block, kv_heads, dim, dtype=dtype)
    values = torch.randn(b, width * block, kv_heads, dim, dtype=dtype)
    free = iter(torch.randperm(23).add(1).tolist())
    for i, n in enumerate(lengths):
        for j in range(-(-n // block)):
            tables[i, j] = next(free)
            pool_k[tables[i, j]] = keys[i, j * block:(j + 1) * block]
            pool_v[tables[i, j]] = values[i, j * block:(j + 1) * block]
    q = torch.randn(b, heads, dim, dtype=dtype)
    out = torch.ops.tokenmill.paged_decode_attention(q, pool_k, pool_v, tables, torch.tensor(lengths), dim**-0.5,
                                                     window)
    assert out.shape == q.shape and out.dtype == dtype
    diff = (out.double() - reference(q, keys, values, lengths, dim**-0.5, window)).abs().max().item()
    assert diff < TOLERANCE[dtype], diff
    mask = _key_mask(torch.tensor(lengths), width * block, window)  # torch's path, the same keys
    out = _decode_attention(q, keys, values, mask, dim**-0.5)
    diff = (out.double() - reference(q, keys, values, lengths, dim**-0.5, window)).abs().max().item()
    assert diff < TOLERANCE[dtype], diff


@pytest.mark.parametrize("start", [0, 3, 20])
@pytest.mark.parametrize("n", [1, 9])
def test_a_sliding_window_prefill_sees_the_window_up_to_each_query(start: int, n: int) -> None:
    """_causal_sdpa with a window: query i sees key j where 0 <= i - j < window, on absolute positions (a chunk
    that starts deep into the sequence, or at its beginning; one query or several)."""
    torch.manual_seed(3)
    heads, kv_heads, dim, window = 4, 2, 16, 5
    q = torch.randn(n, heads, dim)
    keys, values = torch.randn(start + n, kv_heads, dim), torch.randn(start + n, kv_heads, dim)
    out = _causal_sdpa(q, keys, values, start, dim**-0.5, window)
    # Each query as one decode row over the keys up to it.
    lengths = [start + i + 1 for i in range(n)]
    expected = reference(q, keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1), lengths, dim**-0.5, window)
    assert (out.double() - expected).abs().max().item() < 1e-5

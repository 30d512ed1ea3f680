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


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(3, 3, 64), (9, 3, 64), (8, 2, 128), (4, 1, 256),
                                                        (10, 2, 80), (7, 1, 48)])
@pytest.mark.parametrize("window", [0, 300])
def test_long_contexts_split_in_chunks_merge_to_the_whole_softmax(heads: int, kv_heads: int, dim: int,
                                                                   window: int) -> None:
    """Keys past one chunk (kernels/attention.cpp's kChunk, 256; kLongChunk, 64, past 512 keys) are attended by
    several tasks whose partial softmaxes merge: lengths just under, at and past chunk edges and split in even chunks
    (300 as two of 150, 513 as nine of 57, 1100 as eighteen of 62), groups of 1 to 5 query heads a KV head (4 and
    more take several passes over the keys), dims the vector paths take and those they leave to plain loops; each
    thread fetching ahead the chunks it takes next, in the row and the next row."""
    torch.manual_seed(4)
    block, lengths = 16, [1, 255, 256, 257, 300, 513, 700, 1100]
    width = -(-max(lengths) // block)
    b = len(lengths)
    keys = torch.randn(b, width * block, kv_heads, dim)
    values = torch.randn(b, width * block, kv_heads, dim)
    # A few keys with scores far above the rest, in one chunk only: the merge must rescale the other chunks' sums.
    keys[6, 600] *= 8
    pool_k = torch.full((b * width + 1, block, kv_heads, dim), 1e4)
    pool_v = torch.full((b * width + 1, block, kv_heads, dim), -1e4)
    tables = (torch.randperm(b * width) + 1).view(b, width)
    for i in range(b):
        pool_k[tables[i]] = keys[i].view(width, block, kv_heads, dim)
        pool_v[tables[i]] = values[i].view(width, block, kv_heads, dim)
    q = torch.randn(b, heads, dim)
    expected = reference(q, keys, values, lengths, dim**-0.5, window)
    out = torch.ops.tokenmill.paged_decode_attention(q, pool_k, pool_v, tables, torch.tensor(lengths), dim**-0.5,
                                                     window)
    assert (out.double() - expected).abs().max().item() < 1e-5
    # Each row alone gives the same bits as in the batch: the chunks depend on its length, not on what runs beside.
    for i in (3, 5):
        alone = torch.ops.tokenmill.paged_decode_attention(q[i:i + 1], pool_k, pool_v, tables[i:i + 1],
                                                           torch.tensor(lengths[i:i + 1]), dim**-0.5, window)
        assert torch.equal(alone[0], out[i])
    # Fetching ahead moves memory, never a number: with it off, the same bits.
    try:
        assert kernels.use_decode_fetch_ahead(False)
        off = torch.ops.tokenmill.paged_decode_attention(q, pool_k, pool_v, tables, torch.tensor(lengths), dim**-0.5,
                                                         window)
    finally:
        assert not kernels.use_decode_fetch_ahead(True)
    assert torch.equal(off, out)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.ops.tokenmill.paged_decode_attention(q.to(dtype), pool_k.to(dtype), pool_v.to(dtype), tables,
                                                         torch.tensor(lengths), dim**-0.5, window)
        low = reference(q.to(dtype), keys.to(dtype), values.to(dtype), lengths, dim**-0.5, window)
        assert (out.double() - low).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 1, 256), (3, 3, 48),
                                                        (4, 2, 40)])
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 70), (5, 33), (130, 100)])
@pytest.mark.parametrize("window", [0, 37])
def test_the_prefill_kernel_attends_each_row_to_its_keys(heads: int, kv_heads: int, dim: int, start: int, n: int,
                                                         window: int) -> None:
    """kernels/attention_prefill.cpp: a prompt chunk of n rows at positions start.. over the pool (a cached prefix
    before it, scattered blocks, garbage past the last key), causal and with a sliding window, against each row as
    a float64 reference over the keys it sees: chunks within one tile of rows and across several, key tiles cut by
    the diagonal and the window, head dims the vector path takes (64, 128, 256, 48 on AVX2) and one it leaves to
    the decode kernel's loops (40); bf16 on AMX tiles and on bf16 pairs (each where the CPU has them; else the path
    below) and on fp32 tiles."""
    torch.manual_seed(5)
    block = 16
    width = -(-(start + n) // block) + 1
    keys = torch.randn(width * block, kv_heads, dim)
    values = torch.randn(width * block, kv_heads, dim)
    keys[start + n:], values[start + n:] = 1e4, float("nan")  # past the last row: never seen (0 x NaN is NaN)
    table = torch.randperm(3 * width)[:width] + 1
    pool_k = torch.full((3 * width + 1, block, kv_heads, dim), float("nan"))
    pool_v = torch.full((3 * width + 1, block, kv_heads, dim), float("nan"))
    pool_k[table], pool_v[table] = keys.view(width, block, kv_heads, dim), values.view(width, block, kv_heads, dim)
    q = torch.randn(n, heads, dim)
    lengths = [start + i + 1 for i in range(n)]
    expected = reference(q, keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1), lengths, dim**-0.5, window)
    out = torch.ops.tokenmill.paged_prefill_attention(q, pool_k, pool_v, table, start, dim**-0.5, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.double() - expected).abs().max().item() < 1e-5
    for dtype, pairs, tiles in ((torch.bfloat16, False, True), (torch.bfloat16, True, False),
                                (torch.bfloat16, False, False), (torch.float16, False, False)):
        out = torch.ops.tokenmill.paged_prefill_attention(q.to(dtype), pool_k.to(dtype), pool_v.to(dtype), table,
                                                          start, dim**-0.5, window, pairs, tiles)
        low = reference(q.to(dtype), keys.to(dtype).expand(n, -1, -1, -1), values.to(dtype).expand(n, -1, -1, -1),
                        lengths, dim**-0.5, window)
        assert (out.double() - low).abs().max().item() < TOLERANCE[dtype] / (1 if pairs or tiles else 4)


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize(("pairs", "tiles"), [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("window", [0, 300])
def test_the_prefill_kernel_follows_scores_that_rise_far_from_tile_to_tile(pairs: bool, tiles: bool,
                                                                          window: int) -> None:
    """Keys whose scores grow by far from one key tile to the next (the softmax's running max must move: on AMX
    tiles it moves only past a margin, and then the values so far shrink), in bf16 against the float64 reference,
    and rows whose every score is far below a later row's."""
    torch.manual_seed(11)
    heads, kv_heads, dim, block, n = 4, 2, 64, 16, 400
    growth = torch.linspace(0.1, 8.0, n)[:, None, None]  # a key's scale, by position
    keys = (torch.randn(n, kv_heads, dim) * growth).bfloat16()
    values = torch.randn(n, kv_heads, dim).bfloat16()
    table = torch.randperm(n // block) + 1
    pool_k = torch.zeros(n // block + 1, block, kv_heads, dim, dtype=torch.bfloat16)
    pool_v = torch.zeros_like(pool_k)
    pool_k[table], pool_v[table] = keys.view(-1, block, kv_heads, dim), values.view(-1, block, kv_heads, dim)
    q = torch.randn(n, heads, dim).bfloat16()
    out = torch.ops.tokenmill.paged_prefill_attention(q, pool_k, pool_v, table, 0, dim**-0.5, window, pairs, tiles)
    expected = reference(q, keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1), list(range(1, n + 1)),
                         dim**-0.5, window)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_the_prefill_kernel_refuses_a_table_too_short_for_its_rows() -> None:
    pool = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(20, 2, 64)
    with pytest.raises(RuntimeError, match="past their block table"):
        torch.ops.tokenmill.paged_prefill_attention(q, pool, pool, torch.tensor([1]), 0, 0.125, 0)
    with pytest.raises(RuntimeError, match="a block outside the pool"):
        torch.ops.tokenmill.paged_prefill_attention(q, pool, pool, torch.tensor([1, 9]), 0, 0.125, 0)

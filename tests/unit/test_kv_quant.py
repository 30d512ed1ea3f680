"""A quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3): the rows as written, the kernels that read them as they
lie against attention over their dequantized values, and the torch path that gathers and dequantizes them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_attention import reference

from tokenmill import backend, kernels
from tokenmill.cache.kv_cache import KVSpec
from tokenmill.engine.tensor_parallel import kv_spec
from tokenmill.errors import ConfigError
from tokenmill.layers import attention, kv_quant
from tokenmill.layers.attention import PagedMetadata, SequenceSlice

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
needs_kernels = pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_row_is_its_numbers_and_their_scale(dtype: torch.dtype) -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0  # a row of zeros: scale 0, numbers 0
    rows = kv_quant.quantize(x, dtype)
    assert rows.shape == (50, 3, 68) and rows.dtype == dtype
    back = kv_quant.dequantize(rows, torch.float32)
    assert torch.equal(back[7, 1], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True)
    scale = rows.view(torch.uint8)[..., 64:].contiguous().view(torch.float32)
    if dtype == torch.int8:
        assert torch.equal(scale, amax / 127)
        assert ((back - x).abs() <= amax / 254 * 1.0001).all()  # half a step of 127 per amax, at most
    else:
        assert torch.equal(scale, amax / 448)
        # e4m3 keeps 3 bits of mantissa: within 2^-4 of each value, or of the smallest normal step at the bottom
        assert ((back - x).abs() <= torch.maximum(x.abs() / 16, amax / 448 * 2**-9) * 1.0001).all()
    assert (back.abs().amax(-1, keepdim=True) - amax).abs().max() <= 1e-6 * amax.max()  # the largest kept


def test_a_bf16_pool_under_fp32_rows_holds_their_bf16_values() -> None:
    """--kv-cache-dtype bf16 with fp32 compute: written rounded to bf16, read back as fp32."""
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    x, slots = torch.randn(5, 2, 64), torch.tensor([16, 17, 40, 41, 63])
    kv_quant.store(pool, slots, x)
    held = kv_quant.readable(pool.view(-1, 2, 64)[slots], torch.float32)
    assert held.dtype == torch.float32 and torch.equal(held, x.bfloat16().float())
    assert kv_quant.dequantize(kv_quant.quantize(x, torch.int8), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_token_takes_about_half_a_bf16_tokens_bytes(dtype: torch.dtype) -> None:
    bf16, quantized = KVSpec(30, 3, 64, torch.bfloat16), KVSpec(30, 3, 64, dtype)
    assert quantized.bytes_per_token == 30 * 2 * 3 * (64 + 4)
    assert bf16.bytes_per_token / quantized.bytes_per_token == pytest.approx(1.88, abs=0.01)


def test_an_fp8_cache_on_a_gpu_without_e4m3_conversions_is_refused_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=64, sliding_layers=(), sliding_window=0)
    on_gpu = SimpleNamespace(config=config, dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(backend, "gpu_kernels", lambda device: True)
    for capability, fp8 in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert kv_spec(on_gpu, "int8").dtype == torch.int8  # type: ignore[arg-type]
        if fp8:
            assert kv_spec(on_gpu, "fp8_e4m3").dtype == torch.float8_e4m3fn  # type: ignore[arg-type]
        else:
            with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_e4m3 on this GPU: .* sm_89 or newer"):
                kv_spec(on_gpu, "fp8_e4m3")  # type: ignore[arg-type]
    monkeypatch.setattr(backend, "gpu_kernels", lambda device: False)  # the torch path converts e4m3 anywhere
    assert kv_spec(on_gpu, "fp8").dtype == torch.float8_e4m3fn  # type: ignore[arg-type]
    assert kv_spec(on_gpu, "auto").dtype == torch.bfloat16  # type: ignore[arg-type]


def _pool(dtype: torch.dtype, keys: torch.Tensor, values: torch.Tensor, block_size: int = 16
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's pool holding one sequence's keys and values [n, kv heads, dim] in shuffled blocks (block 0 the null
    one), and its table."""
    n, kv_heads, dim = keys.shape
    blocks = -(-n // block_size)
    table = torch.randperm(blocks) + 1
    shape = (blocks + 1, block_size, kv_heads, kv_quant.row_width(dtype, dim))
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = table.repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
    kv_quant.store(k_cache, slots, keys)
    kv_quant.store(v_cache, slots, values)
    return k_cache, v_cache, table


def _held(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """What the pool holds for the sequence, dequantized, [n, kv heads, dim]."""
    return kv_quant.readable(cache[table].flatten(0, 1)[:n], torch.float32)


@needs_kernels
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 128), (3, 3, 48)])
@pytest.mark.parametrize("window", [0, 37])
def test_the_kernels_read_a_quantized_pool_as_its_values(dtype: torch.dtype, q_dtype: torch.dtype, heads: int,
                                                         kv_heads: int, dim: int, window: int) -> None:
    """600 keys: the decode kernel splits them in chunks and merges; the prefill kernel's rows see the cached prefix
    and their own chunk."""
    torch.manual_seed(0)
    n = 600
    keys, values = torch.randn(n, kv_heads, dim) * 2, torch.randn(n, kv_heads, dim)
    k_cache, v_cache, table = _pool(dtype, keys, values)
    held_k, held_v = _held(k_cache, table, n), _held(v_cache, table, n)
    assert not torch.equal(held_k, keys)  # quantized, not kept
    tolerance = 1e-5 if q_dtype == torch.float32 else 3e-2
    q = torch.randn(2, heads, dim).to(q_dtype)
    lengths = [n, 301]
    out = torch.ops.tokenmill.paged_decode_attention(q, k_cache, v_cache, table.repeat(2, 1), torch.tensor(lengths),
                                                     0.125, window)
    want = reference(q, held_k.expand(2, -1, -1, -1), held_v.expand(2, -1, -1, -1), lengths, 0.125, window)
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=tolerance)
    start, rows = 450, 150
    q = torch.randn(rows, heads, dim).to(q_dtype)
    out = torch.ops.tokenmill.paged_prefill_attention(q, k_cache, v_cache, table, start, 0.125, window)
    want = reference(q, held_k.expand(rows, -1, -1, -1), held_v.expand(rows, -1, -1, -1),
                     list(range(start + 1, start + rows + 1)), 0.125, window)
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_write_the_bits_torch_writes(dtype: torch.dtype, qkv_dtype: torch.dtype) -> None:
    """rope_store_kv (the prefill's and the fused decode layer's write) against kv_quant.store on the same keys: the
    same numbers and scales, bit for bit (kernels/cpu.h's store_row). A rotation by 0 or by pi keeps the keys
    exact (a rotation's own rounding is the compiler's to fuse)."""
    torch.manual_seed(1)
    heads, kv_heads, dim, n = 9, 3, 64, 40
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim) * 3).to(qkv_dtype)
    angle = torch.randint(0, 2, (n, dim // 2)) * torch.pi
    cos, sin = angle.cos().round(), angle.sin().round()
    shape = (8, 16, kv_heads, dim + 4)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.randperm(7 * 16)[:n] + 16
    q = torch.ops.tokenmill.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    parts = qkv.float().view(n, -1, dim)
    k = parts[:, heads:heads + kv_heads]
    rotated = torch.cat([k[..., :32] * cos[:, None] - k[..., 32:] * sin[:, None],
                         k[..., 32:] * cos[:, None] + k[..., :32] * sin[:, None]], dim=-1)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kv_quant.store(want_k, slots, rotated)
    kv_quant.store(want_v, slots, parts[:, heads + kv_heads:])
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert q.shape == (n, heads, dim) and q.dtype == qkv_dtype


@needs_kernels
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_torchs_path_reads_a_quantized_pool_as_the_kernels_do(dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of two decodes and a prefill chunk through attention(): the kernels' answer and the torch path's
    (gathered blocks dequantized, SDPA), the same within fp32's noise; both wrote the same pool."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lengths = [40, 75, 30]  # the third: a chunk of 12 rows after 18 cached tokens
    tables = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    slices = [SequenceSlice(0, 39, 1), SequenceSlice(1, 74, 1), SequenceSlice(2, 18, 12)]
    history = [torch.randn(length, kv_heads, dim) for length in lengths]  # what the earlier steps wrote

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (12, block_size, kv_heads, dim + 4)
        k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        for table, keys in zip(tables, history, strict=True):
            slots = torch.tensor(table).repeat_interleave(block_size)[:len(keys)] * block_size + \
                torch.arange(len(keys)) % block_size
            kv_quant.store(k_cache, slots, keys)
            kv_quant.store(v_cache, slots, keys.flip(-1))
        new = torch.cat([history[0][-1:], history[1][-1:], history[2][18:]])
        slots = torch.tensor([3 * 16 + 7, 8 * 16 + 10, *range(10 * 16 + 2, 10 * 16 + 14)])
        width = 5
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]])
        meta = PagedMetadata(k_layers=(k_cache,), v_layers=(v_cache,), slot_mapping=slots, num_decodes=2,
                             decode_tables=padded.flatten(), decode_lengths=torch.tensor(lengths[:2]),
                             prefills=[(slices[2], torch.tensor(tables[2]))],
                             prefill_kernel=backend.cpu_kernels(torch.device("cpu")))
        out = attention.attention(0, torch.ones(14, heads, dim), new, new.flip(-1), meta, 0.125)
        return out, k_cache

    by_kernels, pool = step()
    monkeypatch.setattr(backend, "cpu_kernels", lambda device: False)
    by_torch, torch_pool = step()
    assert torch.equal(pool.view(torch.uint8), torch_pool.view(torch.uint8))
    torch.testing.assert_close(by_torch, by_kernels, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_a_pool_of_a_dtype_the_rows_cannot_read_is_refused_by_every_op() -> None:
    """bf16 rows over an fp16 pool (neither theirs nor quantized), and k and v pools of two dtypes."""
    q, slots = torch.randn(2, 4, 64).bfloat16(), torch.tensor([16, 17])
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    tables, lengths = torch.tensor([[1], [1]]), torch.tensor([3, 5])
    said = "the KV pool's dtype .* is not one .* rows read"
    with pytest.raises(RuntimeError, match=said):
        torch.ops.tokenmill.paged_decode_attention(q, pool, pool, tables, lengths, 0.125, 0)
    with pytest.raises(RuntimeError, match=said):
        torch.ops.tokenmill.paged_prefill_attention(q, pool, pool, torch.tensor([1]), 0, 0.125, 0)
    with pytest.raises(RuntimeError, match=said):
        torch.ops.tokenmill.rope_store_kv(torch.randn(2, 8 * 64).bfloat16(), torch.ones(2, 32), torch.zeros(2, 32),
                                          pool, pool.clone(), slots, 4, 2)
    with pytest.raises(RuntimeError, match="the k and v pools must share a dtype"):
        torch.ops.tokenmill.paged_decode_attention(q, pool.bfloat16(), pool, tables, lengths, 0.125, 0)

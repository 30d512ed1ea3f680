"""The Triton kernels of the CUDA path (kernels/gpu.py) against plain PyTorch: on a GPU where there is one
(TOKENMILL_TEST_DEVICE=cuda), else on the CPU through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). Skipped where Triton is not installed."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers import count_gpu_kernels, random_blocks, without_pdl_waits, write_tiny_gguf  # noqa: E402

from tokenmill import backend  # noqa: E402
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache  # noqa: E402
from tokenmill.config import WeightPlan
from tokenmill.kernels import gpu  # noqa: E402
from tokenmill.layers import kv_quant  # noqa: E402
from tokenmill.layers.attention import SequenceSlice, _attend_paged, _causal_sdpa  # noqa: E402
from tokenmill.layers.linear import linear_of, row_matmul_takes  # noqa: E402
from tokenmill.layers.quantized import GpuQuantizedLinear, QuantizedWeight  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tokenmill.loader import load_model  # noqa: E402
from tokenmill.loader.gguf_blocks import QUANTIZED_TYPES, quantized_weight  # noqa: E402
from tokenmill.models import llama as llama_module  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 3e-2  # bf16: a rounding or two of values of order 1


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Each row's keys gathered through its table, one softmax per head, in fp32."""
    b, heads, _ = q.shape
    block_size, group = k_cache.shape[1], heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(b):
        n = torch.arange(int(lengths[i]))
        n = n[max(len(n) - window, 0):] if window else n
        blocks = tables[i].cpu()[n // block_size]
        keys, values = k_cache.cpu()[blocks, n % block_size].float(), v_cache.cpu()[blocks, n % block_size].float()
        for h in range(heads):
            weights = ((q[i, h].cpu().float() @ keys[:, h // group].T) * scale).softmax(-1)
            out[i, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "width", "window"), [
    (9, 3, 64, 40, 0),  # SmolLM2's heads; 640 keys: split in 3
    (4, 1, 32, 5, 0),  # one split
    (8, 2, 64, 30, 100),  # a sliding window, across splits
    (4, 1, 256, 20, 50),  # Gemma 3's wide heads: 16-key tiles, a window
])
def test_paged_decode_attention_matches_gathered_softmax(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                                          width: int, window: int, device: str) -> None:
    torch.manual_seed(0)
    b, block_size = 3, 16
    blocks = b * width + 1
    k_cache = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    tables = (torch.randperm(blocks - 1)[:b * width].view(b, width) + 1)  # scattered blocks, never the null one
    lengths = torch.tensor([width * block_size, 1, width * block_size // 2 + 7])
    q = torch.randn(b, heads, dim).to(dtype)
    scale = 1 / math.sqrt(dim)
    out = gpu.paged_decode_attention(*(t.to(device) for t in (q, k_cache, v_cache, tables, lengths)), scale, window)
    expected = reference_decode(q, k_cache, v_cache, tables, lengths, scale, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), expected, atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dim", [32, 256])  # 256: Gemma 3's, in narrower key tiles
def test_paged_prefill_attention_matches_causal_attention_over_the_prefix(dtype: torch.dtype, window: int, dim: int,
                                                                          device: str) -> None:
    """Three chunks in one launch: a prompt from position 0, a chunk after a cached prefix of 37 tokens, and one of
    70 rows (three programs) after 5; each row sees the keys up to its own position (the window's last ones)."""
    torch.manual_seed(4)
    heads, kv_heads, block_size = 6, 2, 16
    chunks = [(0, 9), (37, 20), (5, 70)]  # (first position, rows)
    width = 6
    blocks = len(chunks) * width + 1
    k_cache = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    tables = torch.randperm(blocks - 1)[:len(chunks) * width].view(len(chunks), width) + 1
    q = torch.randn(sum(n for _, n in chunks), heads, dim).to(dtype)
    rows = [0, 9, 29, 99]
    block_seq, block_row = gpu.prefill_blocks([n for _, n in chunks])
    assert (block_seq, block_row) == ([0, 1, 2, 2, 2], [0, 0, 0, 32, 64])
    meta = [torch.tensor(v) for v in ([start for start, _ in chunks], rows, block_seq, block_row)]
    out = gpu.paged_prefill_attention(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                                      *(t.to(device) for t in meta), dim**-0.5, window)
    scale = dim**-0.5
    for i, (start, n) in enumerate(chunks):
        keys = k_cache[tables[i]].reshape(-1, kv_heads, dim)[:start + n]
        values = v_cache[tables[i]].reshape(-1, kv_heads, dim)[:start + n]
        expected = _causal_sdpa(q[rows[i]:rows[i + 1]].float(), keys.float(), values.float(), start, scale, window)
        torch.testing.assert_close(out[rows[i]:rows[i + 1]].cpu().float(), expected, atol=tolerance(dtype), rtol=0)


def test_decode_splits_grow_with_the_context_and_stop_where_the_batch_fills_the_gpu() -> None:
    assert gpu.decode_splits(1, 3, 256) == 1
    assert gpu.decode_splits(1, 3, 8192) == gpu.MAX_SPLITS
    assert gpu.decode_splits(2, 3, 640) == 3
    assert gpu.decode_splits(256, 3, 8192) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual(dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    out = gpu.rms_norm(x.to(device), weight.to(device), 1e-5)
    torch.testing.assert_close(out.cpu().float(), F.rms_norm(x.float(), (576,), weight.float(), 1e-5),
                               atol=tolerance(dtype), rtol=tolerance(dtype))
    stream = x.clone().to(device)  # the kernel writes the sum into it
    out = gpu.rms_norm(stream, weight.to(device), 1e-5, residual.to(device))
    total = x.float() + residual.float()
    torch.testing.assert_close(stream.cpu().float(), total, atol=tolerance(dtype), rtol=tolerance(dtype))
    torch.testing.assert_close(out.cpu().float(), F.rms_norm(total, (576,), weight.float(), 1e-5),
                               atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * 1536).to(dtype)
    gate, up = gate_up.float().split(1536, dim=-1)
    out = gpu.silu_mul(gate_up.to(device))
    torch.testing.assert_close(out.cpu().float(), F.silu(gate) * up, atol=tolerance(dtype), rtol=tolerance(dtype))


def prologue_reference(x: torch.Tensor, prologue: str, norm: torch.Tensor, residual: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What row_matmul multiplies (rounded to x's dtype, as the op it replaces stores it), and the stream."""
    dtype = x.dtype
    if prologue in ("silu_mul", "gelu_mul"):
        gate, up = x.float().chunk(2, dim=-1)
        act = F.silu(gate) if prologue == "silu_mul" else F.gelu(gate, approximate="tanh")
        return (act * up).to(dtype), None
    stream = (x.float() + residual.float()).to(dtype) if prologue == "add_norm" else None
    if prologue == "none":
        return x, None
    source = x if stream is None else stream
    return F.rms_norm(source.float(), (x.shape[1],), norm.float(), eps).to(dtype), stream


def quantized(qtype: QType, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    return quantized_weight(random_blocks(qtype, rows, cols, seed), qtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("weight_type", "rows", "cols"), [
    ("dense", 1, 200),  # within one 1024-wide pass
    ("dense", 1, 1500),  # past it
    ("Q5_1", 3, 800),  # quantized (5 bits, mins), three rows: passes of 256 columns, the last one partial
])
@pytest.mark.parametrize("prologue", ["none", "norm", "add_norm", "silu_mul", "gelu_mul"])
def test_row_matmul_with_each_prologue(dtype: torch.dtype, weight_type: str, rows: int, cols: int, prologue: str,
                                       device: str) -> None:
    """Outputs past one tile (4 wide, 32 in the interpreter), not a multiple of it; a bias where the q|k|v projection
    has one (Qwen's)."""
    torch.manual_seed(3)
    n_out, eps = 70, 1e-6
    x = torch.randn(rows, 2 * cols if prologue.endswith("_mul") else cols).to(dtype)
    if weight_type == "dense":
        weight = (torch.randn(n_out, cols) / cols**0.5).to(dtype)
        dense, on_device = weight.float(), weight.to(device)
    else:
        packed = quantized(QType[weight_type], n_out, cols)
        dense, on_device = packed.dequantize(), packed.gpu_rows(torch.device(device))
    bias = torch.randn(n_out).to(dtype) if prologue in ("none", "add_norm") else None
    norm, residual = torch.randn(cols).to(dtype), torch.randn(rows, cols).to(dtype)
    a, stream = prologue_reference(x, prologue, norm, residual, eps)
    expected = a.float() @ dense.T + (0 if bias is None else bias.float())
    fused: dict = {"norm": norm.to(device), "eps": eps} if "norm" in prologue else {}
    if prologue == "add_norm":
        fused["residual"] = residual.to(device)
    x_in = x.to(device)
    out, got_stream = gpu.row_matmul(x_in, on_device, None if bias is None else bias.to(device), prologue, **fused)
    scale = expected.abs().max()  # a quantized weight's products are larger than the dense one's
    torch.testing.assert_close(out.cpu().float() / scale, expected / scale, atol=tolerance(dtype),
                               rtol=tolerance(dtype))
    assert out.dtype == dtype and out.shape == (rows, n_out)
    torch.testing.assert_close(x_in.cpu(), x, atol=0, rtol=0)  # x is read, never written
    if stream is None:
        assert got_stream is None
    else:
        assert got_stream is not None
        torch.testing.assert_close(got_stream.cpu().float(), stream.float(), atol=tolerance(dtype),
                                   rtol=tolerance(dtype))


QUANTIZED_TYPES_BY_NAME = sorted(QUANTIZED_TYPES, key=lambda t: t.name)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES_BY_NAME, ids=lambda t: t.name)
def test_quantized_rows_hold_the_values_gguf_decodes(qtype: QType, device: str) -> None:
    """Each type in the GPU's layout, in as many bytes a weight as the CPU's, dequantized whole and row by row (an
    embedding's lookup) to the CPU layout's values, which are gguf's (test_quantized.py)."""
    weight = quantized(qtype, 40, 256)
    rows = weight.gpu_rows(torch.device(device))
    expected = weight.dequantize()
    assert rows.shape == (40, 256) and rows.q.numel() == 40 * 256 * weight.bits // 8
    # fp32 products and sums: at most a rounding apart (a GPU fuses the multiply and the add of the min)
    torch.testing.assert_close(rows.dequantize(torch.float32).cpu(), expected, atol=0, rtol=1e-6)
    index = torch.tensor([39, 0, 7, 0])
    looked_up = rows.dequantize(torch.bfloat16, index.to(device))
    assert looked_up.dtype == torch.bfloat16
    torch.testing.assert_close(looked_up.cpu().float(), expected[index], atol=0, rtol=1 / 128)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES_BY_NAME, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8])
def test_row_matmul_multiplies_each_quantized_type(qtype: QType, rows: int, device: str) -> None:
    weight = quantized(qtype, 40, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out, stream = gpu.row_matmul(x.to(device), weight.gpu_rows(torch.device(device)))
    expected = x.double() @ weight.dequantize().double().T
    scale = expected.abs().max()
    torch.testing.assert_close(out.cpu().double() / scale, expected / scale, atol=1e-6, rtol=1e-5)
    assert stream is None


@pytest.mark.parametrize(("weight_type", "rows", "cols", "prologue"), [
    ("dense", 1, 1500, "silu_mul"),  # two passes of 1,024 columns: the second's weights load after the wait
    ("Q4_1", 3, 320, "add_norm"),  # passes of 256 columns
    ("Q6_K", 8, 256, "norm"),  # the 6-bit planes; 8 rows: passes of 128
])
def test_row_matmul_with_its_first_weights_loaded_before_its_wait_gives_the_same_products(
        weight_type: str, rows: int, cols: int, prologue: str, device: str, monkeypatch) -> None:
    """Launched with PDL (gpu.pdl_ready), row_matmul loads its first pass's weights before it waits for the kernel
    before, and decodes them after: its products and stream are the plain launch's. Triton's interpreter has no
    griddepcontrol: there the wait is a no-op, and the loads' new order is what runs."""
    if device == "cpu":
        without_pdl_waits(monkeypatch)
    elif not gpu.pdl_ready(torch.device(device)):
        pytest.skip("programmatic dependent launch does not run on this GPU")
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * cols if prologue == "silu_mul" else cols, generator=generator).to(torch.bfloat16)
    residual, norm = torch.randn(rows, cols, generator=generator), torch.randn(cols, generator=generator)
    if weight_type == "dense":
        weight: torch.Tensor | gpu.QuantizedRows = torch.randn(40, cols, generator=generator).to(torch.bfloat16)
        weight = weight.to(device)  # type: ignore[union-attr]
    else:
        weight = quantized(QType[weight_type], 40, cols, seed=rows).gpu_rows(torch.device(device))
    fused: dict = {"norm": norm.to(device, torch.bfloat16), "eps": 1e-6} if "norm" in prologue else {}
    if prologue == "add_norm":
        fused["residual"] = residual.to(device, torch.bfloat16)
    results = []
    for pdl in (False, True):
        with gpu._pdl_forced(pdl=pdl):
            results.append(gpu.row_matmul(x.to(device), weight, None, prologue, **fused))
    exact = {} if device == "cuda" else {"atol": 0, "rtol": 0}  # a GPU's compiler may order the sums otherwise
    torch.testing.assert_close(results[1][0], results[0][0], **exact)
    if prologue == "add_norm":
        torch.testing.assert_close(results[1][1], results[0][1], **exact)


def test_row_matmul_takes_one_row_of_a_dense_weight_and_up_to_8_of_a_quantized_one(monkeypatch) -> None:
    """On a GPU (as here through the interpreter): one row of a dense weight, up to 8 of a quantized one; more rows,
    the kernels off, or the switch off: not."""
    monkeypatch.setattr(gpu, "runs", lambda x: True)
    assert gpu.row_matmul_runs(torch.empty(1, 4))
    assert not gpu.row_matmul_runs(torch.empty(2, 4))
    assert gpu.row_matmul_runs(torch.empty(8, 4), quantized=True)
    assert not gpu.row_matmul_runs(torch.empty(9, 4), quantized=True)
    # the layers' question, of their Linears (the norm or SwiGLU before it fused in where it is yes)
    dense, kept = nn.Linear(32, 8), GpuQuantizedLinear(quantized(QType.Q4_0, 8, 32).gpu_rows(torch.device("cpu")), None)
    assert row_matmul_takes(dense, torch.empty(1, 32)) and not row_matmul_takes(dense, torch.empty(2, 32))
    assert row_matmul_takes(kept, torch.empty(8, 32)) and not row_matmul_takes(kept, torch.empty(9, 32))
    gpu.use_row_matmul(False)
    try:
        assert not gpu.row_matmul_runs(torch.empty(1, 4))
        assert not gpu.row_matmul_runs(torch.empty(1, 4), quantized=True)
    finally:
        gpu.use_row_matmul(True)
    monkeypatch.setattr(gpu, "runs", lambda x: False)
    assert not gpu.row_matmul_runs(torch.empty(1, 4))
    assert not gpu.row_matmul_runs(torch.empty(1, 4), quantized=True)


def test_a_quantized_linear_on_the_gpu_runs_few_rows_in_row_matmul_and_more_on_its_dequantized_matrix(
        monkeypatch, device: str) -> None:
    """Up to 8 rows: row_matmul on the quantized weights; 9: the matrix dequantized for the matmul, or the dense copy
    where there is one (no kernel at all)."""
    launched = count_gpu_kernels(monkeypatch)
    weight = quantized(QType.Q4_K, 24, 256)
    bias = torch.randn(24)
    layer = GpuQuantizedLinear(weight.gpu_rows(torch.device(device)), bias.to(device))
    x = torch.randn(9, 256)
    expected = x @ weight.dequantize().T + bias
    for rows, kernel in ((8, "row_matmul"), (9, "dequantize")):
        launched.clear()
        torch.testing.assert_close(layer(x[:rows].to(device)).cpu(), expected[:rows], atol=1e-4, rtol=1e-5)
        assert launched == [kernel]
    layer.dense = linear_of(weight.dequantize().to(device), bias.to(device))
    launched.clear()
    torch.testing.assert_close(layer(x.to(device)).cpu(), expected, atol=1e-4, rtol=1e-5)
    assert launched == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_rotates_queries_and_keys_and_writes_the_pool_at_the_slots(dtype: torch.dtype,
                                                                                 device: str) -> None:
    torch.manual_seed(3)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    cos, sin = RotaryEmbedding(dim, 10000.0, 128)(torch.tensor([3, 17, 50, 51, 99]))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    k_cache = torch.zeros(8, 16, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([16, 17, 40, 41, 127])
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    q = gpu.rope_store_kv(qkv.to(device), cos.to(device), sin.to(device), k_dev, v_dev, slots.to(device), heads,
                          kv_heads)
    q_part, k_part, v_part = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    keys, values = k_dev.cpu().view(-1, kv_heads, dim), v_dev.cpu().view(-1, kv_heads, dim)
    tol = tolerance(dtype)
    torch.testing.assert_close(q.cpu().float(), apply_rotary(q_part.reshape(tokens, heads, dim), (cos, sin)).float(),
                               atol=tol, rtol=tol)
    torch.testing.assert_close(keys[slots].float(),
                               apply_rotary(k_part.reshape(tokens, kv_heads, dim), (cos, sin)).float(),
                               atol=tol, rtol=tol)
    assert torch.equal(values[slots], v_part.reshape(tokens, kv_heads, dim))
    written = keys.abs().sum((1, 2)).nonzero().flatten()
    assert written.tolist() == sorted(slots.tolist())  # nothing beside the slots


KV_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("kv", KV_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_writes_a_quantized_pool_as_kv_quant_does(kv: torch.dtype, dtype: torch.dtype,
                                                                device: str) -> None:
    """A quantized pool's rows (--kv-cache-dtype int8, fp8_e4m3): the rotated key (as a pool of the compute dtype
    gets it) and the value, as layers/kv_quant.py's quantize writes them, bit for bit (numbers and scale); the
    queries as with that pool; nothing beside the slots."""
    torch.manual_seed(3)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    cos, sin = RotaryEmbedding(dim, 10000.0, 128)(torch.tensor([3, 17, 50, 51, 99]))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    qkv[1, -dim:] = 0  # a row of zeros: scale 0, numbers 0
    pools = [torch.zeros(8, 16, kv_heads, kv_quant.row_width(kv, dim), dtype=kv, device=device) for _ in "kv"]
    slots = torch.tensor([16, 17, 40, 41, 127])
    q = gpu.rope_store_kv(qkv.to(device), cos.to(device), sin.to(device), *pools, slots.to(device), heads, kv_heads,
                          kv_quant.largest(kv))
    v_part = qkv[:, -kv_heads * dim:].reshape(tokens, kv_heads, dim)
    plain = [torch.zeros(8, 16, kv_heads, dim, dtype=dtype, device=device) for _ in "kv"]
    expected_q = gpu.rope_store_kv(qkv.to(device), cos.to(device), sin.to(device), *plain, slots.to(device), heads,
                                   kv_heads)
    assert torch.equal(q.cpu(), expected_q.cpu())
    keys = plain[0].cpu().view(-1, kv_heads, dim)[slots]  # rotated as a pool of the compute dtype has them
    for pool, rows in zip(pools, (keys, v_part), strict=True):
        written = pool.cpu().view(torch.uint8).view(-1, kv_heads, dim + 4)
        assert torch.equal(written[slots], kv_quant.quantize(rows, kv).view(torch.uint8))
        assert written.sum((1, 2)).nonzero().flatten().tolist() == sorted(slots.tolist())


def quantized_pools(kv: torch.dtype, blocks: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values stored in a quantized pool of kv, [blocks, 16, kv heads, dim + 4]."""
    return tuple(kv_quant.quantize(torch.randn(blocks, 16, kv_heads, dim), kv) for _ in "kv")  # type: ignore[return-value]


@pytest.mark.parametrize("kv", KV_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "window"), [(20, 0), (20, 50)])  # 320 keys: two splits
def test_paged_decode_attention_reads_a_quantized_pool(kv: torch.dtype, dtype: torch.dtype, width: int, window: int,
                                                       device: str) -> None:
    """Each key and value its numbers times its row's scale: the softmax over the pool as layers/kv_quant.py reads
    it, within the compute dtype's rounding (the kernel rounds them to it before its products)."""
    torch.manual_seed(1)
    b, heads, kv_heads, dim = 3, 9, 3, 64
    blocks = b * width + 1
    k_cache, v_cache = quantized_pools(kv, blocks, kv_heads, dim)
    tables = torch.randperm(blocks - 1)[:b * width].view(b, width) + 1
    lengths = torch.tensor([width * 16, 1, width * 8 + 7])
    q = torch.randn(b, heads, dim).to(dtype)
    out = gpu.paged_decode_attention(*(t.to(device) for t in (q, k_cache, v_cache, tables, lengths)), dim**-0.5,
                                     window)
    expected = reference_decode(q, kv_quant.dequantize(k_cache, torch.float32),
                                kv_quant.dequantize(v_cache, torch.float32), tables, lengths, dim**-0.5, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), expected, atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("kv", KV_DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("window", [0, 20])
def test_paged_prefill_attention_reads_a_quantized_pool(kv: torch.dtype, window: int, device: str) -> None:
    """A chunk after a cached prefix of 37 tokens and one from position 0, over a quantized pool: causal attention
    over its values as layers/kv_quant.py reads them."""
    torch.manual_seed(4)
    heads, kv_heads, dim, width = 6, 2, 32, 6
    chunks = [(37, 20), (0, 40)]
    k_cache, v_cache = quantized_pools(kv, len(chunks) * width + 1, kv_heads, dim)
    tables = torch.randperm(len(chunks) * width)[:len(chunks) * width].view(len(chunks), width) + 1
    q = torch.randn(60, heads, dim)
    rows = [0, 20, 60]
    block_seq, block_row = gpu.prefill_blocks([n for _, n in chunks])
    meta = [torch.tensor(v) for v in ([start for start, _ in chunks], rows, block_seq, block_row)]
    out = gpu.paged_prefill_attention(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                                      *(t.to(device) for t in meta), dim**-0.5, window)
    keys_all, values_all = (kv_quant.dequantize(c, torch.float32) for c in (k_cache, v_cache))
    for i, (start, n) in enumerate(chunks):
        keys = keys_all[tables[i]].reshape(-1, kv_heads, dim)[:start + n]
        values = values_all[tables[i]].reshape(-1, kv_heads, dim)[:start + n]
        expected = _causal_sdpa(q[rows[i]:rows[i + 1]], keys, values, start, dim**-0.5, window)
        torch.testing.assert_close(out[rows[i]:rows[i + 1]].cpu(), expected, atol=1e-5, rtol=0)


def test_the_prefill_batch_of_a_step_drives_the_kernel_to_the_per_chunk_result(device: str) -> None:
    """PagedKVCache's batch (built on CUDA in place of the per-chunk tables) for a step of two decodes and two
    chunks, one after a cached prefix, on the CPU: the kernel over it gives the torch path's attention. (On a GPU
    prepare builds the batch itself; tests/gpu runs it there.)"""
    if device != "cpu":
        pytest.skip("compares the CPU's per-chunk path with the batch")
    torch.manual_seed(5)
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = PagedKVCache(spec, torch.device("cpu"), num_blocks=40, block_size=16)
    lengths = {0: 50, 1: 20, 2: 100, 3: 33}
    for seq_id, n in lengths.items():
        assert cache.reserve(seq_id, n, n)
    cache.k.normal_()
    cache.v.normal_()
    slices = [SequenceSlice(0, 49, 1), SequenceSlice(1, 19, 1), SequenceSlice(2, 40, 60), SequenceSlice(3, 0, 33)]
    meta = metadata.prepare(cache, slices)
    assert meta.prefill_batch is None and len(meta.prefills) == 2  # the CPU's way
    batch = metadata._prefill_batch(cache, cache.full, slices[2:])
    assert batch.starts.tolist() == [40, 0] and batch.rows.tolist() == [0, 60, 93]
    assert batch.block_seq.tolist() == [0, 0, 1, 1] and batch.block_row.tolist() == [0, 32, 0, 32]
    q = torch.randn(95, 4, 32)
    torch_path = _attend_paged(0, q, meta, 32**-0.5, 0)
    meta.prefill_batch, meta.prefills = batch, []
    torch.testing.assert_close(_attend_paged(0, q, meta, 32**-0.5, 0)[2:], torch_path[2:], atol=1e-5, rtol=0)


def test_every_kernel_runs_at_start_and_a_failing_one_falls_back_to_torch(device: str, monkeypatch, caplog) -> None:
    """ready(): each kernel once, in fp32 and bf16, on this device; an error means torch's ops, said in one line."""
    assert gpu.ready(torch.device(device))
    gpu.ready.cache_clear()

    def broken(*args, **kwargs):
        raise RuntimeError("no such instruction\nmore detail")

    monkeypatch.setattr(gpu, "silu_mul", broken)
    try:
        assert not gpu.ready(torch.device(device))
        assert "GPU kernels unavailable" in caplog.text and "no such instruction" in caplog.text
        assert "more detail" not in caplog.text
    finally:
        gpu.ready.cache_clear()


def test_a_gguf_for_a_gpu_stays_quantized_where_the_kernels_run_and_gets_dense_copies_within_a_budget(
        tmp_path: Path, monkeypatch, caplog, device: str) -> None:
    """On CUDA (its decisions here; its layout on the test device, the CPU's tensors without a GPU): quantized where
    the GPU kernels run, not for a mixture of experts; without a budget no dense copies, with one every matrix has its
    copy."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(gpu, "serves", lambda device: True)
    assert backend.keeps_quantized(cuda, experts=False) and not backend.keeps_quantized(cuda, experts=True)
    monkeypatch.setattr(gpu, "serves", lambda device: False)
    assert not backend.keeps_quantized(cuda, experts=False)
    monkeypatch.setattr(gpu, "serves", lambda device: device.type == "cuda")
    monkeypatch.setattr(llama_module, "on_device", lambda weight, device: weight.gpu_rows(device))
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q8_0)
    for budget, copies in ((0, False), (2**30, True)):
        with caplog.at_level(logging.INFO):
            loaded = load_model(str(path), WeightPlan(dtype="float32", device=device, dense_budget=budget,
                                                      prepack=False))
        layers = [m for m in loaded.model.modules() if isinstance(m, GpuQuantizedLinear)]
        assert layers and all((m.dense is not None) == copies for m in layers)
        assert ("longer ones dequantize each matrix" in caplog.text) != copies
        caplog.clear()

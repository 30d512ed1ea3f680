"""Weights kept in GGUF's quantization: the layout holds every value gguf decodes, and the C++ kernel computes
x @ W.T as its activation quantization says it should; without the kernels everything falls back to dense."""

from __future__ import annotations

import logging
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from helpers import our_logits, random_blocks, write_tiny_gguf
from torch import nn

from tokenmill import kernels
from tokenmill.config import WeightPlan
from tokenmill.errors import ConfigError
from tokenmill.layers.quantized import DENSE_FROM_ROWS, PAIR_ORDER, QuantizedLinear, QuantizedWeight
from tokenmill.loader import load_model
from tokenmill.loader.gguf_blocks import QUANTIZED_TYPES, quantized_weight
from tokenmill.models import registry

TYPES = sorted(QUANTIZED_TYPES, key=lambda t: t.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_layout_holds_exactly_what_gguf_decodes(qtype: QType) -> None:
    raw = random_blocks(qtype, 6, 512)
    weight = quantized_weight(raw, qtype)
    expected = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32))
    assert weight.shape == (6, 512)
    # fp16 scales where the file's are fp16 fields themselves (the kernel reads less); K-quants' products fp32
    half = qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)
    assert weight.scales.dtype == (torch.float16 if half else torch.float32)
    # Kept in the fewest bits that hold them: at one row the kernel's time is the bytes it reads.
    bits = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q4_K: 4, QType.Q6_K: 6, QType.Q8_0: 8, QType.Q2_K: 4,
            QType.Q3_K: 4}.get(qtype, 5)  # Q2_K and Q3_K's 2 and 3 bits in 4: the layouts have no 2 or 3
    assert weight.bits == bits and weight.qweight.numel() == 16 * 512 * bits // 8
    assert torch.equal(weight.dequantize(), expected)
    order = torch.tensor([4, 0, 5])
    assert torch.equal(weight.rows(order).dequantize(), expected[order])



def emulated(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes: x rounded to int8 per block of 32 (scale max|x| / 127), times the weights, exactly."""
    rows, width = x.shape
    blocks = x.view(rows, width // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks * torch.where(scale > 0, 1 / scale, 0)), 0)
    return (q * scale).view(rows, width).double() @ weight.dequantize().double().T


def test_stacked_parts_keep_their_values_whatever_their_scales_dtype() -> None:
    """A fused projection of parts in one layout but scales of two dtypes (Q4_1's fp16, Q4_K's fp32) takes fp32."""
    parts = [quantized_weight(random_blocks(t, rows, 256, seed=rows), t)
             for t, rows in ((QType.Q4_1, 20), (QType.Q4_K, 12), (QType.Q4_1, 5))]
    stacked = QuantizedWeight.stack(parts)
    assert stacked.scales.dtype == torch.float32 and stacked.shape == (37, 256)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = QuantizedWeight.stack([parts[0], parts[2]])
    assert same.scales.dtype == torch.float16
    assert torch.equal(same.dequantize(), torch.cat([parts[0].dequantize(), parts[2].dequantize()]))


@pytest.mark.parametrize(("types", "layout"), [
    ((QType.Q5_0, QType.Q5_0), (5, 16, 32, False)),  # one layout: kept
    ((QType.Q5_0, QType.Q8_0), (8, 0, 32, False)),  # a Q4_K_M file's query beside its value (Gemma 3)
    ((QType.Q4_K, QType.Q6_K, QType.Q4_0), (8, 0, 16, True)),  # a Llama Q4_K_M's: Q6_K's scales per 16, Q4_K's mins
])
def test_parts_of_different_layouts_stack_in_the_8_bit_layout_that_holds_them(types: tuple[QType, ...],
                                                                               layout: tuple[int, ...]) -> None:
    parts = [quantized_weight(random_blocks(t, 8 + i, 256, seed=i), t) for i, t in enumerate(types)]
    stacked = QuantizedWeight.stack(parts)
    assert stacked.layout() == layout
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


needs_kernels = pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
serves_quantized = pytest.mark.skipif(not (kernels.load() and kernels.has_vector_kernels()),
                                      reason="GGUF weights stay quantized where the AVX2 kernels build")


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_dequantize_kernel_gives_the_layouts_values(qtype: QType) -> None:
    """The C++ dequantization (long steps over the dense-copy budget) equals the torch one bit for bit."""
    weight = quantized_weight(random_blocks(qtype, 6, 512, seed=3), qtype)
    for dtype in (torch.float32, torch.bfloat16):
        dense = torch.ops.tokenmill.dequantize(weight.qweight, weight.scales, weight.mins, weight.sub, weight.zero,
                                               6, dtype)
        assert dense.dtype == dtype and torch.equal(dense, weight.dequantize(dtype))
        rows = torch.tensor([5, 0, 5, 3])  # an embedding's lookup: any order, repeats
        looked_up = torch.ops.tokenmill.dequantize(weight.qweight, weight.scales, weight.mins, weight.sub,
                                                   weight.zero, 6, dtype, rows)
        assert torch.equal(looked_up, weight.dequantize(dtype, rows=rows))
    for outside in ([6], [-1]):  # a row outside the matrix is an error, not a read past it
        with pytest.raises(RuntimeError, match="outside the matrix"):
            torch.ops.tokenmill.dequantize(weight.qweight, weight.scales, weight.mins, weight.sub, weight.zero, 6,
                                           torch.float32, torch.tensor(outside))


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
# The kernel takes activation rows 8 at a time (whole and partial tiles), in blocks of 256 KiB of them (1,100 rows:
# three blocks, the last a partial one: 480 rows each of 544 columns, 512 of 512).
@pytest.mark.parametrize("rows", [1, 8, 19, 1100])
def test_the_kernel_computes_the_product(qtype: QType, rows: int) -> None:
    # The AVX-512 path takes blocks of 32 in pairs: an odd count (where the type's blocks allow) ends on a single.
    cols = 512 if GGML_QUANT_SIZES[qtype][0] > 32 else 544
    weight = quantized_weight(random_blocks(qtype, 40, cols, seed=rows), qtype)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, 64:96] = 0  # an all-zero activation block (scale 0)
    out = QuantizedLinear(weight, None)(x)
    expected = emulated(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, 40)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    exact = x.double() @ weight.dequantize().double().T  # and the activations' rounding costs little
    assert (out.double() - exact).norm() <= 0.02 * exact.norm()


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_the_kernels_integer_sums_hold_at_the_codes_extremes(qtype: QType, rows: int) -> None:
    """Every weight at its type's largest code (Q8_0: -128, the largest in magnitude), every activation at +-127 (a
    block's values alike): the kernels' narrow partial sums (AVX2's int16 pairs, several chunks of them added before
    widening) stay exact."""
    fill = 0x80 if qtype == QType.Q8_0 else 0xFF
    weight = quantized_weight(random_blocks(qtype, 24, 512, fill=fill), qtype)
    signs = torch.where(torch.rand(rows, 16, generator=torch.Generator().manual_seed(rows)) < 0.5, -1.0, 1.0)
    signs[0] = 1.0  # row 0: every block's codes +127, the largest sums; the other rows mix the signs by block
    x = signs.repeat_interleave(32, dim=1) * 0.75
    out = QuantizedLinear(weight, None)(x)
    expected = emulated(x, weight)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@needs_kernels
def test_the_kernel_adds_the_bias_and_keeps_bf16() -> None:
    weight = quantized_weight(random_blocks(QType.Q4_K, 16, 256), QType.Q4_K)
    bias = torch.randn(16)
    x = torch.randn(3, 256)
    with_bias = QuantizedLinear(weight, bias)
    assert torch.allclose(with_bias(x), QuantizedLinear(weight, None)(x) + bias)
    plain = QuantizedLinear(weight, None)
    out = plain(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, plain(x.bfloat16().float()).bfloat16())  # computed in fp32, rounded once


@needs_kernels
def test_float_out_gives_bf16_rows_their_sums_unrounded() -> None:
    """The output head's logits: bf16 rows, fp32 sums as they are (the fp32 rows' result), where the plain call
    rounds them to bf16."""
    plain = QuantizedLinear(quantized_weight(random_blocks(QType.Q8_0, 48, 256), QType.Q8_0), None)
    x = torch.randn(5, 256).bfloat16()
    logits = plain(x, float_out=True)
    assert logits.dtype == torch.float32 and torch.equal(logits, plain(x.float()))
    assert not torch.equal(logits, logits.bfloat16().float())
    assert torch.equal(plain(x), logits.bfloat16())


@serves_quantized
def test_a_bf16_models_quantized_head_gives_fp32_logits_unrounded(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q8_0, hidden=256)
    model = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu")).model
    assert isinstance(model.lm_head, QuantizedLinear)
    hidden = torch.randn(3, 256).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and torch.equal(logits, model.lm_head(hidden.float()))


@needs_kernels
def test_steps_that_dequantize_the_matrix_add_the_bias_too() -> None:
    """A Linear with a bias (Qwen2's q, k and v) in steps of dequantize_from_rows rows or more, which multiply by the
    dequantized matrix rather than run the kernel: the bias is added there as on the kernel's path."""
    weight = quantized_weight(random_blocks(QType.Q4_K, 16, 256), QType.Q4_K)
    bias = 10 + torch.randn(16, generator=torch.Generator().manual_seed(1))
    linear = QuantizedLinear(weight, bias)
    linear.dequantize_from_rows = 8
    for rows in (7, 8):  # the kernel's path, then the dequantized matrix's
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        without = QuantizedLinear(weight, None)
        without.dequantize_from_rows = 8
        assert torch.allclose(linear(x), without(x) + bias, rtol=1e-6, atol=1e-5)
    dense = x @ weight.dequantize().T + bias
    assert torch.allclose(linear(x), dense, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each row is quantized and reduced on its own, in a fixed order: its result is the same in any batch."""
    weight = quantized_weight(random_blocks(QType.Q4_1, 64, 512), QType.Q4_1)
    x = torch.randn(9, 512)
    linear = QuantizedLinear(weight, None)
    batched = linear(x)
    assert all(torch.equal(batched[i], linear(x[i:i + 1])[0]) for i in range(9))


@serves_quantized
def test_a_gguf_is_served_quantized_and_tracks_its_dense_twin(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_1, hidden=256)
    kept = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    dense = load_model(str(path), WeightPlan(dtype="float32", device="cpu", quantized=False))
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in kept.model.modules())
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    ids = list(range(3, 250, 9))
    ours, reference = our_logits(kept, ids), our_logits(dense, ids)
    # Random weights of std 0.2 make sharp logits; the real model's bound is in tests/model/test_fidelity.py.
    assert (ours - reference).norm() <= 0.1 * reference.norm()  # measured 0.052
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_without_kernels_a_gguf_loads_dense_with_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    # As on a machine that has a compiler and ninja and built the kernels once (so no "building" line comes first).
    monkeypatch.setattr(kernels.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    built = tmp_path / "tokenmill_kernels_0"
    built.mkdir()
    (built / f"{built.name}.so").touch()
    monkeypatch.setattr(kernels, "build_directory", lambda: built)
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q8_0, hidden=256)
    ids = list(range(3, 250, 9))
    kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO):
            loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
            plain = our_logits(loaded, ids)  # torch's norms too
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    notes = [r.getMessage() for r in caplog.records if r.name == "tokenmill.kernels"]
    assert notes == ["C++ kernels unavailable (Error building extension: g++: command not found): plain PyTorch "
                     "paths, quantized weights dequantized at load"]
    if kernels.load():  # the same numbers as the dense path with the kernels' norms
        dense = load_model(str(path), WeightPlan(dtype="float32", device="cpu", quantized=False))
        # torch's norms and RoPE against the kernels': logits of up to 13 apart by up to 1.3e-4 (measured at every
        # level of a Zen 4: scalar's loops add in the plainest order)
        assert torch.allclose(plain, our_logits(dense, ids), atol=3e-4)


@serves_quantized
@pytest.mark.parametrize("budget", [0, 2**30])
def test_many_row_steps_take_the_dense_copy_where_the_budget_allows(budget: int, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu", dense_budget=budget))
    linear = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(linear, QuantizedLinear) and (linear.dense is not None) == (budget > 0)
    for rows in (DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS):
        x = torch.randn(rows, linear.weight.shape[1])
        dense = x @ linear.weight.dequantize().T
        kernel = emulated(x, linear.weight).float()
        expected = dense if budget and rows >= DENSE_FROM_ROWS else kernel
        assert torch.allclose(linear(x), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def pretend_cpu_flags(flags: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's flags as tokenmill/cpu.py reads them: AVX2 and FMA, and these (the kernels stay the build's)."""
    helpers.pretend_cpu_flags(f"fpu avx2 fma {flags}", tmp_path, monkeypatch)


@serves_quantized
@pytest.mark.parametrize(("flags", "dtype", "dense"), [("avx512f avx512_bf16 avx512_vnni", "bfloat16", False),
                                                       ("avx512f amx_bf16 amx_tile", "bfloat16", True),
                                                       ("avx512f amx_bf16 amx_tile", "float32", False)])
def test_by_default_dense_copies_are_made_for_bf16_on_amx_only(flags: str, dtype: str, dense: bool, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Elsewhere the quantized kernel is as fast as the matmul library at every row count measured."""
    pretend_cpu_flags(flags, tmp_path, monkeypatch)
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    loaded = load_model(str(path), WeightPlan(dtype=dtype, device="cpu", prepack=False, dense_budget=None))
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all((m.dense is not None) == dense for m in quantized)


@serves_quantized
def test_on_amx_a_model_over_the_automatic_budget_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    pretend_cpu_flags("avx512f amx_bf16 amx_tile", tmp_path, monkeypatch)
    monkeypatch.setattr(registry, "AUTO_DENSE_BUDGET", 1 << 20)  # a 1 MiB budget, which the copies exceed
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.registry"):
        loaded = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", prepack=False, dense_budget=None))
    assert all(m.dense is None for m in loaded.model.modules() if isinstance(m, QuantizedLinear))
    assert "over the budget of 1 MiB" in caplog.text and "AMX only" not in caplog.text


@serves_quantized
def test_over_the_budget_long_steps_dequantize_each_matrix_for_its_matmul(tmp_path: Path) -> None:
    """Without dense copies, steps of dequantize_from_rows rows or more multiply by a transient dequantized matrix
    (the kernel's 8-bit activations round otherwise: the two results are told apart); deterministic mode never."""
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu", dense_budget=0, dequantize_from_rows=64))
    linear = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(linear, QuantizedLinear) and linear.dense is None and linear.dequantize_from_rows == 64
    for rows in (63, 64):
        x = torch.randn(rows, linear.weight.shape[1], generator=torch.Generator().manual_seed(rows))
        dense = x @ linear.weight.dequantize().T
        kernel = emulated(x, linear.weight).float()
        assert not torch.allclose(dense, kernel, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))
        expected = dense if rows >= 64 else kernel
        assert torch.allclose(linear(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    deterministic = load_model(str(path), WeightPlan(dtype="float32", device="cpu", dense_budget=0,
                                                     dequantize_from_rows=64, deterministic=True))
    assert all(m.dequantize_from_rows == 0 for m in deterministic.model.modules() if isinstance(m, QuantizedLinear))


needs_tiles = pytest.mark.skipif(not kernels.has_tiles(), reason="no AMX tiles here (Sapphire Rapids and later)")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, tiles_from_rows: int) -> torch.Tensor:
    return torch.ops.tokenmill.quantized_linear(x, weight.qweight, weight.scales, weight.mins, weight.sub,
                                                weight.zero, weight.out_features, tiles_from_rows)


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "out"), [(1, 48), (17, 40), (40, 64), (70, 16)])
def test_the_tiles_compute_the_bf16_product(qtype: QType, rows: int, out: int) -> None:
    """On AMX tiles the weights and activations are rounded to bf16, as a dense bf16 copy's matmul rounds them,
    and summed in fp32. Rows: one tile part full, two, several passes over a panel; out: 3 groups of 16 rows (a
    panel of one), a partial group, a single one."""
    weight = quantized_weight(random_blocks(qtype, out, 512, seed=rows), qtype)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    tiles = quantized_linear(x, weight, 1)
    expected = x.bfloat16().double() @ weight.dequantize(torch.bfloat16).double().T
    assert tiles.shape == (rows, out)
    assert (tiles.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    # and not the integer kernel's product, whose activations are rounded to 8 bits
    integer = quantized_linear(x, weight, 0).double()
    assert (integer - expected).abs().max() > 1e-3 * expected.abs().max()


@needs_tiles
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q6_K, QType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "out"), [(17, 40), (70, 48)])
def test_bf16_rows_on_the_tiles_give_the_fp32_rows_result_rounded(qtype: QType, rows: int, out: int) -> None:
    """A bf16 model's rows go to the tiles as they are and come back as bf16 (no conversion to fp32 and back): the
    same bits as the fp32 path's result rounded, partial tiles and groups included."""
    weight = quantized_weight(random_blocks(qtype, out, 512, seed=rows), qtype)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = quantized_linear(x, weight, 1)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, quantized_linear(x.float(), weight, 1).bfloat16())


def bf16_matrix(out: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, width, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("out", [40, 64])
def test_bf16_weights_keep_their_values_in_the_kernels_layout(out: int) -> None:
    """Every bf16 value where the kernels and the tiles read it (16 chunks of pairs a block); the rows an embedding
    looks up and the C++ dequantization (dense copies) give them back. out: a partial group, whole ones."""
    w = bf16_matrix(out, 96)
    weight = QuantizedWeight.from_dense(w)
    assert weight.bits == 16 and weight.shape == (out, 96) and weight.qweight.shape == (-(-out // 16), 3, 16, 16, 4)
    assert weight.nbytes == 16 * -(-out // 16) * 96 * 2
    assert torch.equal(weight.dequantize(torch.bfloat16), w)
    rows = torch.tensor([out - 1, 0, 17])
    assert torch.equal(weight.dequantize(torch.float32, rows=rows), w[rows].float())
    assert torch.equal(QuantizedLinear(weight, None).dense_weight(torch.bfloat16), w)
    # chunk c of a block holds weights PAIR_ORDER[2c] and PAIR_ORDER[2c + 1] of each of the group's 16 rows
    pairs = weight.qweight.view(torch.bfloat16)[0, 1]  # [16 chunks, 16 rows, 2]: group 0, block 1
    assert torch.equal(pairs[5, 3], w[3, 32 + PAIR_ORDER[10:12]])


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("rows", [1, 8, 19, 300])  # 300: blocks of 128 rows (256 KiB), the last a partial one
@pytest.mark.parametrize("out", [40, 64])
def test_the_kernel_multiplies_bf16_weights_in_fp32(rows: int, out: int) -> None:
    """fp32 rows times the bf16 weights, each widened exactly, summed in fp32: x @ W.T to fp32's rounding, with no
    rounding of the activations (which the integer kernel's int8 and the tiles' bf16 would show)."""
    w = bf16_matrix(out, 512, seed=rows)
    weight = QuantizedWeight.from_dense(w)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ w.double().T
    got = quantized_linear(x, weight, 0)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "fp32"])
@pytest.mark.parametrize("rows", [1, 5, 8, 19, 300])
@pytest.mark.parametrize("out", [40, 64, 300])  # 300: sets of 4 groups at few rows, the last of 3 and a partial one
def test_bf16_rows_on_bf16_weights_are_the_exact_products_summed_in_fp32(rows: int, out: int, pairs: bool) -> None:
    """A bf16 model's rows, as they are, times its bf16 weights (on bf16 pairs, vdpbf16ps, where the CPU has
    AVX512-BF16 and pairs asks for them, else each widened to fp32): every product exact, summed in fp32, rounded
    once to bf16; with 19 rows, tiles of 8 rows and a partial one; 300: blocks of rows."""
    w = bf16_matrix(out, 512, seed=rows)
    weight = QuantizedWeight.from_dense(w)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = x.double() @ w.double().T
    args = (weight.qweight, weight.scales, None, 32, 0, out, 0, False)
    got = torch.ops.tokenmill.quantized_linear(x, *args, False, pairs)
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    # fp32 sums of 512 exact products, then one rounding to bf16 (2^-9 of the value)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * exact.abs().max()).all()
    assert torch.equal(got[:1], torch.ops.tokenmill.quantized_linear(x[:1], *args, False, pairs))  # whatever beside
    # widened to fp32, the fp32 rows' kernel's sums to the bit; on the pairs, sums of their own order
    sums = torch.ops.tokenmill.quantized_linear(x, *args, True, pairs)
    widened = torch.ops.tokenmill.quantized_linear(x.float(), *args, False, pairs)
    assert torch.equal(sums, widened) == (not pairs or "avx512_bf16" not in kernels.built_with())


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "fp32"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp32_rows_of_a_bf16_model_multiply_as_their_bf16_rounding(rows: int, pairs: bool) -> None:
    """bf16_rows (the fused decode layer's, for a bf16 model): fp32 rows on bf16 weights give the sums of the rows
    rounded to bf16, the sums a bf16 model's rows get op by op (here: the same bits, once rounded to bf16), not the
    fp32 rows' own products; on bf16 pairs or widened to fp32 alike."""
    w = bf16_matrix(48, 512, seed=rows)
    weight = QuantizedWeight.from_dense(w)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    args = (weight.qweight, weight.scales, None, 32, 0, 48, 0)
    rounded = torch.ops.tokenmill.quantized_linear(x, *args, True, pairs=pairs)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded.bfloat16(), torch.ops.tokenmill.quantized_linear(x.bfloat16(), *args, pairs=pairs))
    exact = x.double() @ w.double().T
    assert ((torch.ops.tokenmill.quantized_linear(x, *args).double() - exact).abs().max()
            < (rounded.double() - exact).abs().max())


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("rows", [3, 20])  # a tile of few rows, and of many
def test_bf16_sums_and_rows_round_to_nearest_even_as_torch_rounds(rows: int) -> None:
    """Sums that fall exactly halfway between two bf16 (1 + k 2^-8 for odd k: one rounds down to even, the next up),
    infinities and NaN: the bf16 sums are torch's rounding of the fp32 sums; and fp32 rows rounded to bf16 before
    their products (bf16_rows) are torch's rounding of the rows, a NaN whose payload would carry into the sign
    included."""
    halves = torch.tensor([k * 2.0**-8 for k in (1, 3, 5, 7, -1, -3)] + [float("inf"), float("nan")])
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    w[:, 0], w[torch.arange(16), 1 + torch.arange(16)] = 1, 1  # output o: x[0] + x[1 + o]
    weight = QuantizedWeight.from_dense(w)
    x = torch.zeros(rows, 64)
    x[:, 0] = 1
    x[:, 1:17] = halves[torch.arange(rows * 16) % len(halves)].view(rows, 16)
    args = (weight.qweight, weight.scales, None, 32, 0, 16, 0)
    sums = torch.ops.tokenmill.quantized_linear(x.bfloat16(), *args, False, pairs=False)
    expected = (x.bfloat16().float() @ w.float().T).bfloat16()
    assert sums.isnan().any() and torch.equal(sums.isnan(), expected.isnan())
    assert torch.equal(sums.nan_to_num(), expected.nan_to_num())
    ties = torch.ones(rows, 64) + halves[torch.arange(rows * 64) % 6].view(rows, 64)  # 1 + k 2^-8: not bf16 values
    ties[0, 5] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # a NaN whose rounding carries
    identity = QuantizedWeight.from_dense(torch.eye(64, dtype=torch.bfloat16))
    rounded = torch.ops.tokenmill.quantized_linear(ties, identity.qweight, identity.scales, None, 32, 0, 64, 0, True,
                                                   pairs=False)
    assert rounded[0].isnan().all()  # times the identity's zeros too
    assert torch.equal(rounded[1:], ties[1:].bfloat16().float())


@needs_tiles
@pytest.mark.parametrize(("rows", "out"), [(1, 48), (17, 40), (40, 64), (70, 16), (300, 40)])
def test_the_tiles_read_bf16_weights_where_they_lie(rows: int, out: int) -> None:
    """The 16-bit layout is the tiles' own: the product of the activations rounded to bf16 and the weights, fp32
    sums, with panels of two groups, one, and a partial one; 300 rows: blocks of 256 (256 KiB of tiles), the last
    a partial one."""
    w = bf16_matrix(out, 512, seed=rows)
    weight = QuantizedWeight.from_dense(w)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    expected = x.bfloat16().double() @ w.double().T
    tiles = quantized_linear(x, weight, 1)
    assert (tiles.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (quantized_linear(x, weight, 0).double() - expected).abs().max() > 1e-4 * expected.abs().max()
    # a bf16 model's rows in and out as bf16: the fp32 rows' result rounded
    assert torch.equal(quantized_linear(x.bfloat16(), weight, 1), tiles.bfloat16())


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_a_malformed_bf16_weight_is_refused() -> None:
    weight = QuantizedWeight.from_dense(bf16_matrix(16, 64))
    x = torch.randn(1, 64)
    for scales, shift, zero in ((torch.ones(1, 2, 16), None, 0), (weight.scales, torch.ones(1, 2, 16), 0),
                                (weight.scales, None, 8)):
        with pytest.raises(RuntimeError, match="bf16 weights are uint8 of 16 chunks a block"):
            torch.ops.tokenmill.quantized_linear(x, weight.qweight, scales, shift, 32, zero, 16, 0)
    with pytest.raises(RuntimeError, match="a matrix of no inputs"):
        torch.ops.tokenmill.quantized_linear(x[:, :0], weight.qweight[:, :0].contiguous(), weight.scales, None, 32, 0,
                                             16, 0)


@needs_tiles
def test_steps_of_tiles_from_rows_rows_or_more_take_the_tiles() -> None:
    weight = quantized_weight(random_blocks(QType.Q4_0, 32, 256), QType.Q4_0)
    for rows, expected_from in ((23, 0), (24, 1), (30, 1)):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(quantized_linear(x, weight, 24), quantized_linear(x, weight, expected_from))


@needs_tiles
def test_a_bf16_model_on_amx_runs_its_long_steps_on_the_tiles_without_dense_copies(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)

    def tiles_and_copies(**options: object) -> set[tuple[int, bool]]:
        plan = WeightPlan(device="cpu", prepack=False, dense_budget=None, **options)  # type: ignore[arg-type]
        loaded = load_model(str(path), plan)
        return {(m.tiles_from_rows, m.dense is not None) for m in loaded.model.modules()
                if isinstance(m, QuantizedLinear)}

    assert tiles_and_copies(dtype="bfloat16", tiles_from_rows=None) == {(registry.AUTO_TILES_FROM_ROWS, False)}
    assert tiles_and_copies(dtype="bfloat16", tiles_from_rows=40) == {(40, False)}
    assert tiles_and_copies(dtype="bfloat16", tiles_from_rows=0) == {(0, True)}  # off: the dense copies, as before
    assert tiles_and_copies(dtype="float32", tiles_from_rows=None) == {(0, False)}  # fp32 keeps fp32 products
    assert tiles_and_copies(dtype="bfloat16", tiles_from_rows=None, deterministic=True) == {(0, False)}
    with pytest.raises(ConfigError, match="--amx-from-rows -1"):
        tiles_and_copies(dtype="bfloat16", tiles_from_rows=-1)


@serves_quantized
def test_without_tiles_a_bf16_model_says_why_and_keeps_the_other_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A CPU with AMX flags whose build or OS gives no tiles: the dense copies of before, and one log line."""
    pretend_cpu_flags("avx512f amx_bf16 amx_tile", tmp_path, monkeypatch)
    monkeypatch.setattr(kernels, "has_tiles", lambda: False)
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.registry"):
        loaded = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", prepack=False, dense_budget=None,
                                                  tiles_from_rows=24))
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.tiles_from_rows == 0 and m.dense is not None for m in quantized)
    assert "AMX tiles unused: this CPU or build has none" in caplog.text


@needs_kernels
def test_a_cpu_without_avx2_gets_dense_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels, "has_vector_kernels", lambda: False)  # a CPU without AVX2 and FMA
    with caplog.at_level(logging.INFO):
        loaded = load_model(str(write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)),
                            WeightPlan(dtype="float32", device="cpu"))
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    assert any("lacks AVX2/FMA: GGUF weights dequantized at load" in r.getMessage() for r in caplog.records)


@serves_quantized
def test_a_quantized_matrix_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    """A crafted file whose quantized k projection has its dimensions swapped (same count, whole blocks per row):
    a clear error at load. (Rows that are not whole blocks, gguf's reader refuses itself.)"""
    import struct

    from gguf import GGUFReader

    from tokenmill.errors import ModelFormatError

    tensor = "blk.0.attn_k.weight"
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype=QType.Q4_0, hidden=256)
    info = next(t for t in GGUFReader(path).tensors if t.name == tensor)
    data = bytearray(path.read_bytes())
    dims_at = info.field.offset + 8 + len(tensor.encode()) + 4  # name length, name, number of dimensions
    cols, rows = struct.unpack_from("<QQ", data, dims_at)
    struct.pack_into("<QQ", data, dims_at, rows, cols)
    (tmp_path / "crafted.gguf").write_bytes(data)
    with pytest.raises(ModelFormatError, match=r"checkpoint shape \(\d+, \d+\), model expects"):
        load_model(str(tmp_path / "crafted.gguf"), WeightPlan(dtype="float32", device="cpu"))

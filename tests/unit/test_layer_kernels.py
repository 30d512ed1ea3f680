"""The decoder layer's C++ pieces (kernels/rope.cpp) compute what the torch ops they replace compute, and a decode
step through the fused layer (kernels/layer.cpp) gives the per-op layer's hidden states bit for bit in fp32 (and
within bf16's rounding on a bf16 model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from helpers import tiny_metadata, tiny_tensors, write_gguf

from tokenmill import kernels
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import PagedKVCache
from tokenmill.cache.sizing import KVSpec
from tokenmill.config import WeightPlan
from tokenmill.layers.attention import SequenceSlice
from tokenmill.layers.quantized import DENSE_FROM_ROWS, QuantizedLinear
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.loader import LoadedModel, load_model

pytestmark = pytest.mark.skipif(not kernels.load() or not kernels.has_vector_kernels(),
                                reason="the C++ kernels do not build here, or GGUF weights load dense")
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_rotates_q_and_k_and_writes_k_and_v_to_their_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 5, 6, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, sin = RotaryEmbedding(dim, 10000.0, 512)(torch.tensor([0, 3, 7, 100, 511]))
    k_cache = torch.full((4, 16, kv_heads, dim), 7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, 7.0)
    slots = torch.tensor([1, 17, 63, 0, 40])
    q = torch.ops.tokenmill.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert q.dtype == dtype and q.shape == (n, heads, dim)
    assert torch.allclose(q.float(), apply_rotary(q_ref.reshape(n, heads, dim), (cos, sin)).float(),
                          atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    k_pool, v_pool = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    assert torch.allclose(k_pool[slots].float(), apply_rotary(k_ref.reshape(n, kv_heads, dim), (cos, sin)).float(),
                          atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(v_pool[slots], v_ref.reshape(n, kv_heads, dim))  # values are copied, not rotated
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (k_pool[untouched] == 7).all() and (v_pool[untouched] == 7).all()


def test_rope_store_kv_refuses_a_slot_outside_the_pool() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="a slot outside the pool"):
        torch.ops.tokenmill.rope_store_kv(torch.randn(1, 24), torch.ones(1, 4), torch.zeros(1, 4), k_cache,
                                          torch.zeros_like(k_cache), torch.tensor([8]), 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_up(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(3, 2 * 40) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = torch.ops.tokenmill.silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (3, 40)
    assert torch.allclose(out.float(), F.silu(gate) * up, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_is_the_tanh_gelu_of_the_gate_times_up(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(3, 2 * 300) * 4).to(dtype)  # past one chunk of 256
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = torch.ops.tokenmill.gelu_tanh_mul(gate_up)
    assert out.dtype == dtype and out.shape == (3, 300)
    torch.testing.assert_close(out.float(), F.gelu(gate, approximate="tanh") * up, atol=4 * TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def write_model(path: Path, qtype: QType, bias: bool, bf16_values_but: str | None = None) -> Path:
    """The tiny Llama of the tests (hidden 256, 4 heads of 64, 2 KV heads), quantized; with q/k/v biases (Qwen2's
    projections) when asked; bf16_values_but: dense, every tensor rounded to bf16 values (as a bf16 checkpoint's)
    but the one of that name."""
    tensors = tiny_tensors(256)
    if bias:
        rng = np.random.default_rng(1)
        for i in range(2):
            for name, rows in (("q", 256), ("k", 128), ("v", 128)):
                tensors[f"blk.{i}.attn_{name}.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
    if bf16_values_but is not None:
        tensors = {name: value if name == bf16_values_but else torch.from_numpy(value).bfloat16().float().numpy()
                   for name, value in tensors.items()}
    return write_gguf(path, "qwen2" if bias else "llama", tiny_metadata(256), tensors, qtype=qtype)


def new_cache(loaded: LoadedModel, num_blocks: int = 32, sliding: bool = False,
              kv_dtype: torch.dtype | None = None, sliding_blocks: int | None = None) -> PagedKVCache:
    """sliding: the model's sliding-window layers in a pool of their own (of sliding_blocks, else num_blocks), which
    lets go of the blocks a window has passed; kv_dtype: the pool's (the model's where None)."""
    c = loaded.config
    return PagedKVCache(KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or loaded.dtype, c.sliding_layers,
                               c.sliding_window), loaded.device, num_blocks=num_blocks, block_size=16,
                        sliding_blocks=(sliding_blocks or num_blocks) if sliding else 0)


PROMPTS = [list(range(3, 40)), [5, 9, 11], list(range(100, 120))]


def fused_steps(loaded: LoadedModel) -> list[int]:
    """The rows of each step loaded's model runs through the fused layers, recorded from now on."""
    runs: list[int] = []
    run_fused = loaded.model.model._decode_fused
    loaded.model.model._decode_fused = lambda *args: runs.append(args[0].shape[0]) or run_fused(*args)
    return runs


def load_fused_and_per_op(path: Path) -> tuple[LoadedModel, LoadedModel]:
    """The model at path in fp32, with and without the fused decode layers."""
    fused = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    per_op = load_model(str(path), WeightPlan(dtype="float32", device="cpu", fused_decode=False))
    assert fused.model.model.fused_decode is not None and per_op.model.model.fused_decode is None
    return fused, per_op


def assert_fused_decode_steps_equal_per_op(fused: LoadedModel, per_op: LoadedModel) -> None:
    """Three decode steps of PROMPTS, each through the fused layers, bit for bit the per-op layers' hidden states."""
    runs = fused_steps(fused)
    for ours, reference in zip(decode_steps(fused, PROMPTS, 3), decode_steps(per_op, PROMPTS, 3), strict=True):
        assert torch.equal(ours, reference)
    assert len(runs) == 3  # the decode steps, not the prefills


def decode_steps(loaded: LoadedModel, prompts: list[list[int]], steps: int,
                 cache: PagedKVCache | None = None, first: int = 0) -> list[torch.Tensor]:
    """Prefill each prompt on its own, then `steps` decode steps of every sequence together (one new token each,
    ragged lengths, several KV blocks) in `cache` (a new one if None), as sequences first, first + 1...; the hidden
    states of each decode step."""
    cache = cache or new_cache(loaded)
    model = loaded.model
    out = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts, start=first):
            assert cache.reserve(i, len(prompt), len(prompt) + steps)
            meta = metadata.prepare(cache, [SequenceSlice(i, 0, len(prompt))])
            model(torch.tensor(prompt), torch.arange(len(prompt)), meta)
        for step in range(steps):
            slices = [SequenceSlice(i, len(p) + step, 1) for i, p in enumerate(prompts, start=first)]
            for i, p in enumerate(prompts, start=first):
                assert cache.reserve(i, len(p) + step + 1, len(p) + steps, len(p) + step)
            ids = torch.tensor([(7 * step + i) % 250 + 3 for i in range(len(prompts))])
            positions = torch.tensor([s.start for s in slices])
            out.append(model(ids, positions, metadata.prepare(cache, slices)))
    return out


@pytest.mark.parametrize(("qtype", "bias"), [(QType.Q4_1, False), (QType.Q4_0, False), (QType.Q8_0, False),
                                             (QType.Q6_K, False), (QType.Q4_K, True)],
                         ids=lambda v: v.name if isinstance(v, QType) else f"bias={v}")
def test_the_fused_decode_layer_equals_the_per_op_layer(tmp_path: Path, qtype: QType, bias: bool) -> None:
    """Bit for bit: both run the same loops (norm, quantized matmul, RoPE, paged attention, SiLU) on the same
    values. Q4_1: a shift per block; Q4_0: a zero point; Q8_0: int8 without shift; Q6_K: 16 weights a scale;
    Q4_K with q/k/v biases."""
    fused, per_op = load_fused_and_per_op(write_model(tmp_path / "m.gguf", qtype, bias))
    assert (fused.model.model.layers[0].self_attn.qkv_proj.bias is not None) == bias
    assert_fused_decode_steps_equal_per_op(fused, per_op)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_the_fused_decode_layer_writes_and_reads_a_quantized_pool_as_the_per_op_layer(tmp_path: Path,
                                                                                       kv_dtype: torch.dtype) -> None:
    """--kv-cache-dtype int8 / fp8_e4m3: the same bits in the pools and in the hidden states."""
    fused, per_op = load_fused_and_per_op(write_model(tmp_path / "m.gguf", QType.Q4_1, False))
    runs = fused_steps(fused)
    caches = [new_cache(loaded, kv_dtype=kv_dtype) for loaded in (fused, per_op)]
    for ours, reference in zip(decode_steps(fused, PROMPTS, 3, caches[0]), decode_steps(per_op, PROMPTS, 3, caches[1]),
                               strict=True):
        assert torch.equal(ours, reference)
    assert len(runs) == 3
    assert caches[0].k.dtype == kv_dtype and caches[0].k.shape[-1] == 64 + 4
    for pool in ("k", "v"):
        assert torch.equal(getattr(caches[0], pool).view(torch.uint8), getattr(caches[1], pool).view(torch.uint8))


def write_normed_model(path: Path, architecture: str, qtype: QType) -> Path:
    """The tiny model (hidden 256, 4 heads of 64, 2 KV heads) with per-head q/k norms: as Qwen3, or as Gemma 3 (six
    layers: five sliding over 8 keys and a global one, two RoPE bases; norms of the attention's and the MLP's
    outputs; GeGLU; scaled embeddings)."""
    gemma = architecture == "gemma3"
    layers = 6 if gemma else 2
    tensors = tiny_tensors(256, layers=layers)
    rng = np.random.default_rng(2)
    norms = ["attn_q_norm", "attn_k_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else [])
    for i in range(layers):
        for name in norms:
            size = 64 if name in ("attn_q_norm", "attn_k_norm") else 256
            tensors[f"blk.{i}.{name}.weight"] = (1 + 0.3 * rng.standard_normal(size)).astype(np.float32)
    metadata = tiny_metadata(256) | {"block_count": layers, "attention.key_length": 64, "attention.value_length": 64}
    if gemma:
        metadata["attention.sliding_window"] = 8
    return write_gguf(path, architecture, metadata, tensors, qtype=qtype)


@pytest.mark.parametrize(("architecture", "qtype"), [("gemma3", QType.Q8_0), ("gemma3", QType.Q4_K),
                                                     ("qwen3", QType.Q4_0)], ids=lambda v: getattr(v, "name", v))
def test_gemma3_and_qwen3_decode_through_the_fused_layer(tmp_path: Path, architecture: str, qtype: QType) -> None:
    """Per-head q/k norms, a window, GeGLU and the output norms in the fused layer, bit for bit against the per-op
    layers (which norm the heads in place and take the same RoPE and GeGLU loops): prompts past the window, both RoPE
    tables. Bit for bit matters: a matmul that rounds its inputs to int8 (Q8_0 here) turned the 1e-7 between torch's
    GeGLU and the kernel's into 1e-3 at the next layer."""
    fused, per_op = load_fused_and_per_op(write_normed_model(tmp_path / "m.gguf", architecture, qtype))
    assert fused.config.qk_norm and fused.config.qk_norm_per_head
    if architecture == "gemma3":
        assert fused.config.sliding_layers == (True,) * 5 + (False,)
    assert_fused_decode_steps_equal_per_op(fused, per_op)
    if architecture == "gemma3":  # the sliding layers in a pool of their own: the same bits, the passed blocks gone
        models = (fused, per_op)
        caches = [new_cache(loaded, sliding=True) for loaded in models]
        runs = fused_steps(fused)
        states = [decode_steps(loaded, PROMPTS, 3, cache) for loaded, cache in zip(models, caches, strict=True)]
        for ours, theirs, full in zip(*states, decode_steps(per_op, PROMPTS, 3), strict=True):
            assert torch.equal(ours, full) and torch.equal(theirs, full)
        assert len(runs) == 3 and all(cache.sliding.tables[0][0] == 0 for cache in caches)  # 37 tokens: block 0 out


def test_the_stacked_layers_give_the_bits_of_one_call_a_layer(tmp_path: Path) -> None:
    """decode_layers (every layer in one call) against decode_layer called a layer at a time: the same bits, on
    Gemma 3's sliding layers in a pool of their own and its global ones in another, both RoPE tables."""
    path = write_normed_model(tmp_path / "m.gguf", "gemma3", QType.Q4_K)
    stacked = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    one_by_one = load_model(str(path), WeightPlan(dtype="float32", device="cpu", stacked_decode=False))
    assert stacked.model.model.decode_stack is not None and one_by_one.model.model.decode_stack is None
    assert stacked.model.model.decode_stack.windows == [8] * 5 + [0]
    runs = fused_steps(stacked), fused_steps(one_by_one)
    # A sliding pool of 10 blocks: the later sequences get in it blocks its window let go of, other ids than theirs in
    # the full pool (a layer that read the other pool's tables would read other keys, or past its pool).
    caches = [new_cache(loaded, sliding=True, sliding_blocks=10) for loaded in (stacked, one_by_one)]
    states = [decode_steps(loaded, PROMPTS, 3, cache) + decode_steps(loaded, PROMPTS, 3, cache, first=len(PROMPTS))
              for loaded, cache in zip((stacked, one_by_one), caches, strict=True)]
    for ours, theirs in zip(*states, strict=True):
        assert torch.equal(ours, theirs)
    assert [len(r) for r in runs] == [6, 6]
    assert caches[0].full.tables[5] != caches[0].sliding.tables[5]


@pytest.mark.parametrize("tiles", [0, 2], ids=["kernel", "tiles"])
def test_a_bf16_model_decodes_through_the_fused_layer_on_fp32_rows_and_its_bf16_pool(tmp_path: Path,
                                                                                      tiles: int) -> None:
    """The fused layer widens a bf16 model's residual stream to fp32 and reads and writes its bf16 KV pool: its
    decode steps' hidden states and the keys and values they write stay within bf16's rounding of the fp32 model's
    (one ulp of the largest hidden state is ~0.008), as close as the per-op bf16 layers' are; so with its matrices
    on AMX tiles (steps of 2 rows or more here)."""
    if tiles and not kernels.has_tiles():
        pytest.skip("no AMX tiles here")
    path = write_model(tmp_path / "m.gguf", QType.Q4_K, bias=True)
    exact = load_model(str(path), WeightPlan(dtype="float32", device="cpu", fused_decode=False))
    fused = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", tiles_from_rows=tiles))
    per_op = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", fused_decode=False,
                                              tiles_from_rows=tiles))
    assert fused.model.model.fused_decode is not None
    if tiles:  # the tiles' products are not the integer kernel's
        kernel = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu"))
        assert not torch.equal(decode_steps(kernel, PROMPTS, 1)[0], decode_steps(fused, PROMPTS, 1)[0])
    runs = fused_steps(fused)
    models = (fused, per_op, exact)
    caches = [new_cache(loaded) for loaded in models]
    states = [decode_steps(loaded, PROMPTS, 3, cache) for loaded, cache in zip(models, caches, strict=True)]
    assert len(runs) == 3 and all(h.dtype == torch.bfloat16 for h in states[0])
    for ours, theirs, reference in zip(*states, strict=True):
        error, per_op_error = ((h.float() - reference).abs().max().item() for h in (ours, theirs))
        assert error < 0.02 and error <= 1.25 * per_op_error
    for pool in ("k", "v"):
        error, per_op_error = ((getattr(c, pool).float() - getattr(caches[2], pool)).abs().max().item()
                               for c in caches[:2])
        assert error <= 1.25 * per_op_error, pool


def kept_bits(loaded: LoadedModel) -> dict[str, int]:
    """The bits a weight of each matrix the kernels run (16: bf16 values)."""
    return {name: m.weight.bits for name, m in loaded.model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize(("tiles", "pairs"), [(0, "on"), (0, "off"), (None, "auto")],
                         ids=["kernel-pairs", "kernel-fp32", "tiles"])
def test_a_dense_bf16_model_runs_the_kernels_on_its_bf16_weights(tmp_path: Path, tiles: int | None,
                                                                 pairs: str) -> None:
    """A dense model of bf16 weights (a Hugging Face folder's) in bf16: every matrix, the tied output head's too,
    kept in the kernels' 16-bit layout; decode steps through the fused layer. Its hidden states and logits are
    within bf16's rounding of the fp32 model of the same weights, as close as oneDNN's bf16 matmuls op by op
    (--no-bf16-kernels) come (errors of a few percent: the tiny random model amplifies the activations'
    rounding). pairs: bf16 rows on bf16 pairs or widened to fp32 (--bf16-pair-matmul); tiles: on AMX, every step's
    matmuls on tiles read from the weights (the default there)."""
    if tiles is None and not kernels.has_tiles():
        pytest.skip("no AMX tiles here")
    path = write_model(tmp_path / "m.gguf", QType.F32, bias=True, bf16_values_but="")
    exact = load_model(str(path), WeightPlan(dtype="float32", device="cpu", fused_decode=False, bf16_kernels=False))
    ours = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", tiles_from_rows=tiles, dense_budget=None,
                                            bf16_pair_matmul=pairs))
    onednn = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", bf16_kernels=False))
    assert set(kept_bits(ours).values()) == {16} and len(kept_bits(ours)) == 2 * 4 + 1  # 4 a layer, and the head
    assert ours.model.model.fused_decode is not None and ours.model.model.fused_decode_below is None
    kept = [m for m in ours.model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.dense is None for m in kept)  # no second copy
    assert {m.tiles_from_rows for m in kept} == {1 if tiles is None else 0}  # on AMX from one row by default
    assert pairs == "auto" or {m.pairs for m in kept} == {pairs == "on"}
    assert not kept_bits(exact) and not kept_bits(onednn) and onednn.model.model.fused_decode is None
    runs = fused_steps(ours)
    models = (ours, onednn, exact)
    states = [decode_steps(loaded, PROMPTS, 3) for loaded in models]
    with torch.inference_mode():  # as the engine runs them (an AVX2 CPU's bf16 head is a plain Linear)
        logits = [[loaded.model.compute_logits(h) for h in steps] for loaded, steps in zip(models, states, strict=True)]
    hidden = [[h.float() for h in steps] for steps in states]
    assert len(runs) == 3
    for got, onednn_got, reference in (hidden, logits):
        error, onednn_error = (max((g - r).abs().max().item() for g, r in zip(steps, reference, strict=True))
                               for steps in (got, onednn_got))
        assert error <= 1.5 * onednn_error and onednn_error < 0.1 * max(r.abs().max().item() for r in reference)


def test_an_fp32_model_keeps_in_bf16_only_the_matrices_whose_values_are_bf16_ones(tmp_path: Path) -> None:
    """fp32 weights that are bf16 values (a bf16 checkpoint loaded in fp32) run the kernels on half the bytes and
    compute the same (fp32 products, only the order of the sums differs from oneDNN's); a matrix of other values
    stays dense, and then its layer op by op."""
    path = write_model(tmp_path / "m.gguf", QType.F32, bias=False, bf16_values_but="blk.1.ffn_down.weight")
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    assert set(kept_bits(loaded).values()) == {16} and len(kept_bits(loaded)) == 2 * 4 + 1 - 1
    assert "model.layers.1.mlp.down_proj" not in kept_bits(loaded) and loaded.model.model.fused_decode is None
    reference = load_model(str(path), WeightPlan(dtype="float32", device="cpu", bf16_kernels=False))
    # Two fp32 orders of the same sums drift apart over the steps: measured 0.4-1.2e-5 of the largest value (AVX2 and
    # AVX-512 builds, Zen 4); rows rounded to bf16 before the products: 1-8e-2.
    for ours, theirs in zip(decode_steps(loaded, PROMPTS, 3), decode_steps(reference, PROMPTS, 3), strict=True):
        assert (ours - theirs).abs().max() <= 3e-5 * theirs.abs().max()


@pytest.mark.parametrize("budget", [0, 2**30])
def test_decode_steps_run_fused_unless_dense_copies_take_them(tmp_path: Path, budget: int) -> None:
    """Dense copies (where the budget allows) run steps of DENSE_FROM_ROWS rows or more; without them every decode
    step, however many rows, runs the fused layer."""
    path = write_model(tmp_path / "m.gguf", QType.Q4_0, bias=False)
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu", dense_budget=budget))
    runs = fused_steps(loaded)
    for rows in (DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS, 3 * DENSE_FROM_ROWS):
        decode_steps(loaded, [[5 + i, 9] for i in range(rows)], 1, new_cache(loaded, num_blocks=rows))
    assert runs == ([DENSE_FROM_ROWS - 1] if budget else [DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS, 3 * DENSE_FROM_ROWS])


def test_a_layer_it_cannot_run_keeps_the_per_op_path(tmp_path: Path) -> None:
    """Dense weights the kernels do not take (a GGUF loaded with --no-quantized-weights in fp32: values no bf16 holds)
    have no fused layer, nor has deterministic bf16 (its fp32 residual stream would round otherwise than the per-op
    layers of a mixed step)."""
    path = write_model(tmp_path / "m.gguf", QType.Q4_1, bias=False)
    assert load_model(str(path), WeightPlan(dtype="float32", device="cpu",
                                            quantized=False)).model.model.fused_decode is None
    deterministic = load_model(str(path), WeightPlan(dtype="bfloat16", device="cpu", deterministic=True))
    assert deterministic.model.model.fused_decode is None


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("dtype", "tiles"), [("float32", 0), ("bfloat16", 2)], ids=["fp32", "bf16"])
def test_the_kernels_give_the_same_bits_on_one_thread_and_on_three(tmp_path: Path, dtype: str, tiles: int,
                                                                   restore_threads: None) -> None:
    """The C++ kernels split their rows, (sequence, KV head) tasks and tile panels over torch's threads, each with
    scratch of its own: the split changes no bit. The suite runs its workers on one thread each (scripts/dev.sh),
    so this is where the split is exercised. 40 sequences: each kernel's work spans several of its chunks; bf16
    puts the prefills' matrices on the AMX tiles where the CPU has them. (It catches a race on shared scratch by
    chance, not by construction: the two such races tried, in the attention and tile kernels, both failed it.)"""
    if tiles and not kernels.has_tiles():
        tiles = 0
    path = write_model(tmp_path / "m.gguf", QType.Q4_K, bias=True)
    loaded = load_model(str(path), WeightPlan(dtype=dtype, device="cpu", tiles_from_rows=tiles))
    assert loaded.model.model.fused_decode is not None
    prompts = [[3 + (5 * i + j) % 240 for j in range(3 + i % 20)] for i in range(40)]
    runs = fused_steps(loaded)
    states = {}
    for threads in (1, 3):
        torch.set_num_threads(threads)
        states[threads] = decode_steps(loaded, prompts, 2, new_cache(loaded, num_blocks=128))
    assert runs == [40] * 4  # the decode steps ran the fused layer, not dense copies
    assert all(torch.equal(a, b) for a, b in zip(states[1], states[3], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fan_in", "outs"), [((64), (64, 32, 32)), (37, (300,)), (96, (17, 530))])
def test_lora_add_adds_each_rows_own_adapters_product(dtype: torch.dtype, fan_in: int, outs: tuple[int, ...]) -> None:
    """kernels/lora.cpp: each row its own slot's B (A x) per part, nothing for a row of slot -1; shapes whose tails
    the vector loops do not cover."""
    generator = torch.Generator().manual_seed(0)
    slots, rank, parts, rows = 3, 4, len(outs), 11
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    a = torch.randn(slots * parts * rank, fan_in, generator=generator).to(dtype)
    b = [torch.randn(slots * rank, out, generator=generator).to(dtype) for out in outs]
    y = torch.randn(rows, sum(outs), generator=generator).to(dtype)
    row_slots = torch.tensor([0, -1, 2, 2, 1, 0, -1, 2, 2, 2, 1])
    expected = y.float().clone()
    for i, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for p, part in enumerate(b):
            shrunk = a[(slot * parts + p) * rank:(slot * parts + p + 1) * rank].float() @ x[i].float()
            expected[i, offset:offset + part.shape[1]] += shrunk @ part[slot * rank:(slot + 1) * rank].float()
            offset += part.shape[1]
    before = y.clone()
    torch.ops.tokenmill.lora_add(y, x, row_slots, a, b, rank)
    assert torch.equal(y[1], before[1]) and torch.equal(y[6], before[6])  # no adapter: untouched
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]  # the output's rounding
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_lora_add_refuses_a_slot_outside_the_factors() -> None:
    a, b = torch.zeros(8, 16), [torch.zeros(8, 16)]  # two slots of rank 4
    with pytest.raises(RuntimeError, match="a slot out of range"):
        torch.ops.tokenmill.lora_add(torch.zeros(1, 16), torch.zeros(1, 16), torch.tensor([2]), a, b, 4)
    with pytest.raises(RuntimeError, match="each b must be"):
        torch.ops.tokenmill.lora_add(torch.zeros(1, 16), torch.zeros(1, 16), torch.tensor([0]), a,
                                     [torch.zeros(7, 16)], 4)

"""The CUDA path's Python, run here: the engine with every GPU kernel (kernels/gpu.py) where a GPU server takes them,
the kernels running in Triton's interpreter on the CPU's tensors. test_gpu_kernels.py checks each kernel alone; this
checks what feeds them in a real step (the block tables, the prefill batch, the pool's layout, the decode graphs'
static buffers) and what their callers do with the results, against the torch ops, on a Llama and a Gemma 3 with
sliding windows, with chunked prefills after shared prefixes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from helpers import (
    assert_no_live_blocks,
    count_gpu_kernels,
    counted,
    generate,
    save_two_layer_gemma3,
    start_engine,
    without_pdl_waits,
    write_tiny_gguf,
)

from tokenmill.config import WeightPlan
from tokenmill.engine.graphs import DecodeGraphs
from tokenmill.kernels import gpu
from tokenmill.layers.quantized import GpuQuantizedLinear
from tokenmill.loader import LoadedModel, load_model
from tokenmill.models import llama as llama_module
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not gpu.available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter (on a GPU, tests/gpu runs the real thing)")

SHARED = list(range(3, 36))  # 33 tokens: two full blocks the prefix cache shares, and one more
PROMPTS = [SHARED + [50, 51], [9, 8, 7], SHARED + list(range(60, 70)), list(range(100, 120))]
# Few decode steps: the interpreter's cost is per launch, and each pair's longer answer still ends in one-row steps
PARAMS = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=8, ignore_eos=True)]


def load(path: Path) -> LoadedModel:
    """fp32 dense weights in plain Linears, no fused CPU decode layers: the layers a GPU runs, op for op."""
    return load_model(str(path), WeightPlan(dtype="float32", device="cpu", quantized=False, fused_decode=False,
                                            prepack=False))


def run(loaded: LoadedModel, graphs: bool = False, row_matmul: bool = True, pdl: bool = True,
        kv: str = "auto") -> list[list[int]]:
    """PROMPTS' tokens: 16-token steps, so prompts are chunked and share steps with decodes; the last two prompts
    arrive after the first two finished, so they start from the cached prefix; each pair's longer answer ends in
    steps of its one row. kv: --kv-cache-dtype."""
    engine = start_engine(loaded, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=0,
                          gpu_row_matmul=row_matmul, gpu_pdl=pdl, kv_cache_dtype=kv)
    if graphs:  # the static-buffer step CUDA graphs replay, run eagerly
        engine.runner.graphs = DecodeGraphs(loaded.model, engine.kv_cache, 4, engine.max_model_len, capture=False)
    try:
        tokens = generate(engine, PROMPTS[:2], PARAMS[:2]) + generate(engine, PROMPTS[2:], PARAMS[2:])
        assert counted(engine.metrics.prefix_hits) >= 32
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    return tokens


@pytest.fixture
def on_triton(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every op that takes a GPU kernel on CUDA takes it here; gives the names of the kernels launched."""
    return count_gpu_kernels(monkeypatch)


@pytest.fixture(scope="module")
def llama(tiny_gguf: Path) -> LoadedModel:
    return load(tiny_gguf)


@pytest.fixture(scope="module")
def llama_tokens(llama: LoadedModel) -> list[list[int]]:
    return run(llama)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A sliding layer over 8 keys (the prompts run past it) and a global one, with Gemma 3's 256-wide heads."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gemma3-gpu-path")
    save_two_layer_gemma3(path, head_dim=256)
    return load(path)


EVERY_KERNEL = {"decode_attention", "prefill_attention", "rms_norm", "silu_mul", "rope_store_kv"}


@pytest.mark.parametrize(("row_matmul", "pdl"), [(True, True), (False, False)])
def test_llama_steps_and_the_decode_graphs_static_step_through_the_gpu_kernels(llama, llama_tokens, on_triton,
                                                                              monkeypatch, row_matmul: bool,
                                                                              pdl: bool) -> None:
    """Decode steps in the graphs' static buffers, whose tables are as wide as the context (512 keys): split keys
    and their combine; prompt chunks, mixed steps and prefix hits op by op; one-row steps through row_matmul
    (the norms and SwiGLU fused in), where it is on. Where gpu.pdl_ready's probe passed, every kernel launches
    with programmatic dependent launch unless --no-gpu-pdl, row_matmul loading its first weights before its wait
    (a no-op here: the interpreter has no griddepcontrol); the tokens stay the plain launches' (llama_tokens)."""
    monkeypatch.setattr(gpu, "pdl_ready", lambda device: True)
    without_pdl_waits(monkeypatch)
    launches: list[bool] = []
    options = gpu._pdl_options

    def recorded(device):
        launches.append(options(device).get("launch_pdl", False))
        return options(device)

    monkeypatch.setattr(gpu, "_pdl_options", recorded)
    assert run(llama, graphs=True, row_matmul=row_matmul, pdl=pdl) == llama_tokens
    assert set(on_triton) == EVERY_KERNEL | {"combine_splits"} | ({"row_matmul"} if row_matmul else set())
    assert len(launches) == len(on_triton) and set(launches) == {pdl}


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_through_the_gpu_kernels_keeps_the_cpu_kernels_tokens(llama, monkeypatch,
                                                                                  kv: str) -> None:
    """--kv-cache-dtype int8 / fp8_e4m3: rope_store_kv writes the rows the CPU's kernels write (each as
    layers/kv_quant.py does), the attention kernels read them, decodes in the decode graphs' static step (split keys,
    as wide as the context) and prompt chunks after prefix hits: the CPU kernels' tokens under the same KV dtype.
    (Op-by-op decodes share those kernels: the test above runs them on a bf16 pool.)"""
    expected = run(llama, kv=kv)
    launched = count_gpu_kernels(monkeypatch)
    assert run(llama, graphs=True, kv=kv) == expected
    assert {"decode_attention", "prefill_attention", "rope_store_kv"} <= set(launched)


def test_gemma3_sliding_windows_through_the_gpu_kernels(gemma, monkeypatch) -> None:
    """Decode steps op by op, tables as wide as the batch's longest: one split."""
    expected = run(gemma)
    launched = count_gpu_kernels(monkeypatch)
    assert run(gemma) == expected
    assert set(launched) == EVERY_KERNEL - {"silu_mul"} | {"row_matmul"}  # GeGLU: torch's ops, or row_matmul's prologue


# Steps of 16 rows (the first prompt's first chunk), 7 (its last 4 beside the second prompt), 2 and 1 (decodes)
QUICK_PROMPTS = [list(range(3, 23)), [9, 8, 7]]
QUICK_PARAMS = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=3, temperature=0.8, seed=5, ignore_eos=True)]


def quick_run(loaded: LoadedModel) -> list[list[int]]:
    engine = start_engine(loaded, max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    try:
        return generate(engine, QUICK_PROMPTS, QUICK_PARAMS)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def q4_1_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A Q4_1 GGUF, and the tokens of its values loaded dense (torch's ops)."""
    folder = tmp_path_factory.mktemp("q4_1")
    twin = load(write_tiny_gguf(folder / "twin.gguf", qtype=GGMLQuantizationType.Q4_1, dequantized=True))
    return write_tiny_gguf(folder / "q.gguf", qtype=GGMLQuantizationType.Q4_1), quick_run(twin)


def test_gguf_weights_kept_quantized_on_the_gpu_give_their_dense_twins_tokens(q4_1_files, on_triton,
                                                                               monkeypatch) -> None:
    """The GGUF in the GPU's quantized layout (gpu.QuantizedRows): steps of up to 8 rows through row_matmul on the
    quantized weights, the 16-row one and the embedding lookups through the dequantize kernel."""
    path, expected = q4_1_files
    monkeypatch.setattr(llama_module, "on_device", lambda weight, device: weight.gpu_rows(device))  # as on CUDA
    kept = load_model(str(path), WeightPlan(dtype="float32", device="cpu", fused_decode=False, prepack=False))
    assert isinstance(kept.model.model.layers[0].mlp.down_proj, GpuQuantizedLinear)
    assert quick_run(kept) == expected
    assert {"row_matmul", "dequantize"} <= set(on_triton)

"""What feeds the CUDA graphs of decode steps (engine/graphs.py): static buffers, batches padded to a captured size,
padding rows kept out of every sequence's KV. On the CPU the same static-buffer step runs eagerly (capture=False);
tests/gpu/ captures and replays real graphs on a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import assert_no_live_blocks, generate, save_two_layer_gemma3

from tokenmill import kernels
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine import builder
from tokenmill.engine.engine import Engine
from tokenmill.engine.graphs import DecodeGraphs, graph_sizes
from tokenmill.kernels import gpu
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the padded tables are read by the decode kernels")

PROMPTS = [[1, 5, 9, 200, 17], [3] * 40, list(range(10, 90)), [7, 7, 8], list(range(100, 131))]
PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=33, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)] * 2 + [
          SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> LoadedModel:
    return load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu"))


def test_graph_sizes() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def run(loaded: LoadedModel, max_graph_batch: int | None, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, Engine]:
    """The PROMPTS' tokens, with decode graphs up to max_graph_batch (None: none), and the batch sizes that
    replayed."""
    engine = Engine(EngineConfig(max_num_seqs=8, prefix_caching=False), loaded)
    engine.start()  # builds the pool; no request yet, so the runner can take the graphs
    replayed: list[int] = []
    if max_graph_batch is not None:
        graphs = DecodeGraphs(loaded.model, engine.kv_cache, max_graph_batch, engine.max_model_len, capture=False)
        run_graph = graphs.run

        def counting(input_ids, positions, seq_ids):
            replayed.append(len(input_ids))
            return run_graph(input_ids, positions, seq_ids)

        monkeypatch.setattr(graphs, "run", counting)
        engine.runner.graphs = graphs
    try:
        tokens = generate(engine, PROMPTS, PARAMS)
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    return tokens, replayed, engine


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A sliding layer over 8 keys, in a KV pool of its own, and a global layer."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gemma3-graphs")
    save_two_layer_gemma3(path, head_dim=32)
    return load_model(str(path), WeightPlan(dtype="float32", device="cpu"))


@pytest.mark.parametrize("model", ["tiny", "gemma"])
def test_a_padded_static_step_gives_the_tokens_of_the_eager_step(model, request, monkeypatch) -> None:
    loaded = request.getfixturevalue(model)
    eager, _, _ = run(loaded, None, monkeypatch)
    padded, replayed, engine = run(loaded, 8, monkeypatch)
    assert padded == eager
    assert set(replayed) == {5, 4, 2}  # every decode step, as requests finish after 9, 20 and 33 tokens (5 pads to 8)
    kv = engine.kv_cache
    assert len(kv.pools) == (2 if model == "gemma" else 1)
    for pool in kv.pools:
        assert not pool.k[:, 0].any() and not pool.v[:, 0].any()  # the null block, read by padding rows, still zero
        # The scratch block took the padding rows' K/V (token 0: Gemma's padding token, whose embedding is zero).
        assert pool.k[:, -1].any() or model == "gemma"


def test_batches_past_the_largest_graph_run_op_by_op(tiny, monkeypatch) -> None:
    eager, _, _ = run(tiny, None, monkeypatch)
    mixed, replayed, _ = run(tiny, 2, monkeypatch)
    assert mixed == eager
    assert set(replayed) == {2}  # 5 and 4 sequences decode op by op


def test_the_static_tables_are_as_wide_as_the_longest_context(tiny) -> None:
    engine = Engine(EngineConfig(max_num_seqs=4), tiny)
    engine.start()
    engine.stop()
    graphs = DecodeGraphs(tiny.model, engine.kv_cache, 4, engine.max_model_len, capture=False)
    assert graphs.tables.shape == (1, 4, -(-engine.max_model_len // engine.kv_cache.block_size))  # one pool
    assert graphs.size_for(3) == 4 and graphs.size_for(1) == 1 and graphs.size_for(5) is None
    assert torch.equal(graphs.inputs[3], torch.full((4,), engine.kv_cache.scratch_slot))  # all padding at first


def test_graphs_only_on_cuda_with_the_kernels_and_never_for_a_mixture_of_experts(tiny, monkeypatch) -> None:
    """A MoE layer reads each expert's token count on the host (layers/moe.py), which a graph cannot capture: its
    decode steps run op by op, as without the Triton kernels or with --enforce-eager."""
    monkeypatch.setattr(builder, "DecodeGraphs", lambda *args: "graphs")
    ready = {"cuda": True}
    monkeypatch.setattr(gpu, "ready", lambda device: ready[device.type])
    engine = Engine(EngineConfig(max_num_seqs=4), tiny)
    engine.start()  # builds the paged pool the graphs would use
    engine.stop()

    def graphs(loaded, config=engine.config):
        return builder.decode_graphs(config, loaded, engine.kv_cache, engine.max_model_len)

    on_cuda = dataclasses.replace(tiny, device=torch.device("cuda"))
    assert graphs(on_cuda) == "graphs"
    assert graphs(tiny) is None
    moe = dataclasses.replace(tiny.config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert graphs(dataclasses.replace(on_cuda, config=moe)) is None
    ready["cuda"] = False
    assert graphs(on_cuda) is None
    ready["cuda"] = True
    assert graphs(on_cuda, dataclasses.replace(engine.config, enforce_eager=True)) is None

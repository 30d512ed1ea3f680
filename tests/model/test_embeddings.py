"""Embeddings from the engine (the prompt's final hidden states, pooled and L2-normalized) against transformers'
on the same random weights: last and mean pooling, prompts prefilled in chunks, in a batch, after prefix-cache
hits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_no_live_blocks, counted, hf_configs, save_random_hf_model, start_engine

from tokenmill.config import WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import SequenceOutput
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
# The 1st and 4th share 49 tokens; the 5th is two whole blocks (a repeat takes one from the cache, never the last).
PROMPTS = [list(range(3, 200, 3)), list(range(7, 40)), [5, 9, 11], list(range(3, 150, 3)), list(range(40, 72))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_random_hf_model(folder, hf_configs()["llama3-rope"])
    return folder


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))


def reference(folder: Path, ids: list[int], pooling: str) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)


def embed(engine: Engine, prompts: list[list[int]], generate: list[list[int]] = ()) -> list[SequenceOutput]:
    """Submit every prompt at once (they share steps), after the `generate` prompts (60 tokens each, their
    outputs not returned), and wait for every sequence to finish; each embedding has one output."""
    outputs: dict[int, list[SequenceOutput]] = {}
    done = threading.Event()
    total = len(prompts) + len(generate)

    def sink(out: SequenceOutput) -> None:
        outputs.setdefault(out.seq_id, []).append(out)
        if sum(o[-1].finish_reason is not None for o in outputs.values()) == total:
            done.set()

    for p in generate:
        engine.add(p, SamplingParams(max_tokens=60, ignore_eos=True), sink)
    ids = [engine.add(p, SamplingParams(max_tokens=1), sink, embed=True) for p in prompts]
    assert done.wait(60)
    assert all(len(outputs[i]) == 1 and outputs[i][0].finish_reason == "stop" and outputs[i][0].token_ids == []
               for i in ids)
    return [outputs[i][0] for i in ids]


def assert_matches(outs: list[SequenceOutput], expected: list[torch.Tensor]) -> None:
    for out, ref in zip(outs, expected, strict=True):
        assert (torch.tensor(out.embedding) - ref).abs().max().item() < 1e-5
        assert abs(torch.tensor(out.embedding).norm().item() - 1) < 1e-6


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_in_chunks_in_a_batch_and_after_cache_hits(
        folder: Path, loaded: LoadedModel, pooling: str) -> None:
    expected = [reference(folder, p, pooling) for p in PROMPTS]
    # 16 tokens a step: the long prompts prefill in several chunks, beside the short ones
    engine = start_engine(loaded, pooling=pooling, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    try:
        together = embed(engine, PROMPTS)
        alone = [embed(engine, [p])[0] for p in PROMPTS]  # now the prompts' blocks are in the prefix cache
        assert_matches(together, expected)
        assert_matches(alone, expected)
        # last pooling takes prefix-cache hits; a mean needs every position, so it computes the whole prompt
        hits = [out.cached_tokens for out in alone]
        assert hits == ([0] * 5 if pooling == "mean" else [64, 32, 0, 48, 16])
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_preempted_embeddings_recompute_to_the_same_vectors(folder: Path, loaded: LoadedModel, pooling: str) -> None:
    """KV memory for 10 blocks of 16 tokens: two generating sequences grow until the newest running sequences
    (embeddings halfway through their prompts, 8 tokens a step) are preempted and start again from the start."""
    expected = [reference(folder, p, pooling) for p in PROMPTS]
    engine = start_engine(loaded, pooling=pooling, max_num_batched_tokens=8, long_prefill_token_threshold=0,
                          kv_cache_memory=str(10 * 16 * 512), block_size=16)
    try:
        generate = [list(range(5, 45)), list(range(6, 46))]
        assert_matches(embed(engine, PROMPTS, generate), expected)
        assert counted(engine.metrics.preemptions) > 0
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_an_aborted_embedding_sends_no_vector_and_frees_its_blocks(loaded: LoadedModel) -> None:
    engine = start_engine(loaded, max_num_batched_tokens=4, long_prefill_token_threshold=0)
    try:
        outputs: list[SequenceOutput] = []
        done = threading.Event()

        def sink(out: SequenceOutput) -> None:
            outputs.append(out)
            done.set()

        engine.abort(engine.add(PROMPTS[0], SamplingParams(max_tokens=1), sink, embed=True))  # 17 steps to go
        assert done.wait(60)
        assert [(o.finish_reason, o.embedding) for o in outputs] == [("abort", None)]
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_an_embedding_shares_the_step_with_generation(loaded: LoadedModel) -> None:
    engine = start_engine(loaded)
    try:
        finished = threading.Event()
        texts: list[SequenceOutput] = []

        def sink(out: SequenceOutput) -> None:
            texts.append(out)
            if out.finish_reason is not None:
                finished.set()

        engine.add([3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True), sink)
        vectors = embed(engine, PROMPTS[:2])
        assert finished.wait(60) and sum(len(o.token_ids) for o in texts) == 20
        assert all(o.embedding is None for o in texts)
        assert [len(v.embedding or []) for v in vectors] == [loaded.config.hidden_size] * 2
    finally:
        engine.stop()

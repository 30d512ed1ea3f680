"""--deterministic on the real model: a request's tokens (64, greedy and seeded) are the same alone, inside a batch
of 31 random neighbours arriving at random steps, after prefix-cache hits, with its prompt prefilled in chunks, and
after a preemption — in fp32 and bf16. Without the flag the same request's numbers do depend on how it ran (the test
at the end shows it), which is why the mode exists."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from helpers import assert_no_live_blocks, counted, generate, start_engine, submit

from tokenmill import kernels
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import AttentionPaths, KVSpec, PagedKVCache
from tokenmill.config import WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.layers.attention import SequenceSlice
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.load(), reason="deterministic mode needs the C++ kernels")]

TOKENS = 64
PROMPT = (
    "The lighthouse keeper had lived alone on the island for eleven years when the bottle washed up on the rocks "
    "below the tower. It was green glass, sealed with wax, and inside it a letter written in a careful hand on paper "
    "that had gone the colour of weak tea. He carried it up the spiral stairs, set it on the table beside the lamp, "
    "and for a long time he only looked at it. Then he broke the seal and began to read:"
)
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
TARGETS = (GREEDY, SEEDED)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest, smollm_path: Path) -> LoadedModel:
    """The default model as a user serves it (weights kept quantized, the default budget for dense copies), built
    for the mode."""
    return load_model(str(smollm_path), WeightPlan(dtype=request.param, device="cpu", dense_budget=2**30,
                                                   deterministic=True))


@pytest.fixture(scope="module")
def prompt(model: LoadedModel) -> list[int]:
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > 64  # so that chunks of 64 split it
    return ids


@pytest.fixture(scope="module")
def alone(model: LoadedModel, prompt: list[int]) -> list[list[int]]:
    """Each target request alone on a fresh engine with nothing cached: the answer every other run must give."""
    engine = start_engine(model, deterministic=True, prefix_caching=False)
    try:
        answers = [generate(engine, [prompt], [params])[0] for params in TARGETS]
    finally:
        engine.stop()
    assert answers[0] != answers[1]  # the seeded request really samples
    return answers


def run_targets(model: LoadedModel, prompt: list[int], **config) -> tuple[list[list[int]], Engine]:
    engine = start_engine(model, deterministic=True, **config)
    try:
        return generate(engine, [prompt, prompt], list(TARGETS)), engine
    finally:
        engine.stop()


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_prompt_prefilled_in_chunks_gives_the_same_tokens(model, prompt, alone, chunk) -> None:
    answers, _ = run_targets(model, prompt, max_num_batched_tokens=chunk, prefix_caching=False)
    assert answers == alone


def test_prefix_cache_hits_give_the_same_tokens(model, prompt, alone) -> None:
    engine = start_engine(model, deterministic=True)
    try:
        generate(engine, [prompt[: len(prompt) // 2]], [SamplingParams(max_tokens=1)])  # half the prompt cached
        half_cached = generate(engine, [prompt, prompt], list(TARGETS))
        hits = counted(engine.metrics.prefix_hits)
        whole_cached = generate(engine, [prompt, prompt], list(TARGETS))  # all but the last partial block
        assert counted(engine.metrics.prefix_hits) - hits >= 2 * (len(prompt) - 15)
    finally:
        engine.stop()
    assert hits >= 2 * (len(prompt) // 2 - 15)
    assert half_cached == alone
    assert whole_cached == alone


def _neighbour(rng: random.Random, vocab: int) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
    params = SamplingParams(max_tokens=rng.randint(1, 64), temperature=rng.choice([0.0, 0.7, 1.3]),
                            top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, rng.randrange(1000)]),
                            presence_penalty=rng.choice([0.0, 0.5]), ignore_eos=True)
    return prompt, params


async def _arrive(engine: Engine, prompt: list[int], params: SamplingParams, delay: float) -> list[int]:
    await asyncio.sleep(delay)
    ids: list[int] = []
    async for out in submit(engine, prompt, params):
        ids += out.token_ids
    return ids


def test_thirty_one_random_neighbours_arriving_at_random_steps_change_nothing(model, prompt, alone) -> None:
    rng = random.Random(7)
    vocab = model.config.vocab_size
    # Each target shares its steps with 31 others: the other target and 30 random requests (prompts of random
    # tokens and lengths, random sampling), arriving over the first ~two seconds, some before the targets.
    arrivals = [(prompt, params, 0.4) for params in TARGETS]
    arrivals += [(*_neighbour(rng, vocab), rng.uniform(0.0, 2.0)) for _ in range(30)]
    engine = start_engine(model, deterministic=True)

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(_arrive(engine, *a) for a in arrivals)))

    try:
        answers = asyncio.run(run())
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    assert answers[:2] == alone


def test_preempted_and_resumed_requests_give_the_same_tokens(model, prompt, alone) -> None:
    # KV memory for one and a half targets' worth of blocks of 16 tokens: the newer one is preempted on the way and
    # recomputes its prompt and answer so far when the other has finished.
    block_bytes = 16 * KVSpec(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim,
                              model.dtype).bytes_per_token
    blocks = 3 * -(-(len(prompt) + TOKENS) // 16) // 2
    engine = start_engine(model, deterministic=True, kv_cache_memory=str(blocks * block_bytes), block_size=16,
                          prefix_caching=False)
    try:
        answers = generate(engine, [prompt, prompt], list(TARGETS))
        assert counted(engine.metrics.preemptions) > 0
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    assert answers == alone


def _last_logits(loaded: LoadedModel, ids: list[int], chunk: int) -> torch.Tensor:
    """The logits after the whole prompt, prefilled chunk tokens at a time."""
    c = loaded.config
    cache = PagedKVCache(KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, loaded.dtype), loaded.device,
                         num_blocks=len(ids) // 16 + 1, block_size=16,
                         paths=AttentionPaths(per_row=loaded.deterministic))
    assert cache.reserve(0, len(ids), len(ids))
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            meta = metadata.prepare(cache, [SequenceSlice(0, start, n)])
            hidden = loaded.model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), meta)
        return loaded.model.compute_logits(hidden[-1:])[0]


def test_without_the_flag_chunking_changes_the_numbers(smollm, model, prompt) -> None:
    """Why the mode exists: by default (here the fp32 reference build) a whole prompt's rows and a chunk of 7's run
    the matmul library and torch's attention in other shapes, and the last position's logits differ in their bits.
    In the mode they are the same bits."""
    assert not torch.equal(_last_logits(smollm, prompt, len(prompt)), _last_logits(smollm, prompt, 7))
    assert torch.equal(_last_logits(model, prompt, len(prompt)), _last_logits(model, prompt, 7))

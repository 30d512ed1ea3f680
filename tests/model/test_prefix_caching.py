"""The prefix cache on the real model: the same tokens with and without it, and the reuse it reports. Prefixes
ending on and inside blocks of every kind run in deterministic mode (`smollm_exact`: a hit's rows are the bits a
miss computes); the default kernels' prefill over a cached prefix, under eviction and across a chat's turns, on the
dense fp32 reference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import assert_no_live_blocks, counted, generate, start_engine, submit

from tokenmill.config import WeightPlan
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant. Answer with care, cite what you know, and say so when you do not "
          "know. Keep answers short unless asked otherwise. Today we discuss the geography of Europe, its rivers, "
          "its mountains and its capitals, from Lisbon to Helsinki, from Dublin to Athens, and the seas that "
          "border it: the Atlantic, the Mediterranean, the North Sea and the Baltic.")


def greedy(tokens: int = 6) -> SamplingParams:
    """By default a few tokens: a wrong block reused, or a cached prefix's KV off, moves the first ones already."""
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def run_one_by_one(smollm: LoadedModel, prompts: list[list[int]], **config) -> tuple[list[list[int]], object]:
    engine = start_engine(smollm, **config)
    try:
        outs = [generate(engine, [p], [greedy()])[0] for p in prompts]
        return outs, engine
    finally:
        engine.stop()


def test_same_tokens_with_and_without_the_cache_for_prefixes_of_many_lengths(smollm_exact: LoadedModel) -> None:
    base = smollm_exact.tokenizer.encode(SYSTEM)
    assert len(base) > 64
    # shared prefixes ending on and inside blocks of 16, each followed by its own question
    prompts = [base[:n] + smollm_exact.tokenizer.encode(f" Question {n}: which river?") for n in
               (5, 15, 16, 17, 31, 32, 33, 47, 48, 64, len(base))]
    prompts += [prompts[-1], prompts[3]]  # exact repeats: everything but the last token is cached
    cached, engine = run_one_by_one(smollm_exact, prompts)
    uncached, _ = run_one_by_one(smollm_exact, prompts, prefix_caching=False)
    assert cached == uncached
    assert counted(engine.metrics.prefix_hits) >= 16 * 20  # later prompts reuse the earlier ones' blocks
    assert engine.kv_cache.prefix_cache.num_blocks > 0 and engine.kv_cache.usage() == 0


def test_a_chat_turn_reuses_the_previous_turn(smollm: LoadedModel) -> None:
    engine = start_engine(smollm)
    try:
        history = smollm.tokenizer.encode(SYSTEM + " Which is the longest river of Europe?")
        answer = generate(engine, [history], [greedy()])[0]
        turn2 = history + answer + smollm.tokenizer.encode(" And the second longest?")
        before = counted(engine.metrics.prefix_hits)
        generate(engine, [turn2], [greedy()])
        # the whole first turn (prompt and answer) was cached at finish, up to its last full block
        assert counted(engine.metrics.prefix_hits) - before == (len(history) + len(answer) - 1) // 16 * 16
    finally:
        engine.stop()


def test_concurrent_requests_with_a_shared_prefix_under_pool_pressure(smollm: LoadedModel) -> None:
    base = smollm.tokenizer.encode(SYSTEM)
    prompts = [base + smollm.tokenizer.encode(f" Tell me about city number {i}.") for i in range(8)]
    params = [greedy(12) for _ in prompts]  # 12 tokens: the answers' own blocks are part of what crowds the pool
    reference = generate_with(smollm, prompts, params, prefix_caching=False)
    # 12 blocks of 16: the shared 4 and room for about 2 requests' own; the 8 requests cache ~28 blocks in all
    engine = start_engine(smollm, kv_cache_memory=str(12 * 16 * 46080), block_size=16)
    try:
        assert generate(engine, prompts, params) == reference
        tree = engine.kv_cache.prefix_cache
        first = prompts[0] + reference[0]
        assert len(tree.match(first[:-1])[0]) < (len(first) - 1) // 16  # evicted to make room for later requests
        assert generate(engine, prompts[:2], params[:2]) == reference[:2]
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_exact_repeats_of_whole_blocks(tiny_gguf: Path) -> None:
    """A prompt of exactly 1, 2 or 8 blocks, sent again: all but its last block comes from the cache (the last
    token must run for its logits), and the answer is the one computed without the cache."""
    tiny = load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu"))
    prompts = [[(7 * i + n) % 250 for i in range(16 * n)] for n in (1, 2, 8)]
    cached = start_engine(tiny, block_size=16)
    plain = start_engine(tiny, block_size=16, prefix_caching=False)
    try:
        for prompt in prompts:
            expected = run_one(plain, prompt)
            assert run_one(cached, prompt) == (expected[0], 0)
            assert run_one(cached, prompt) == (expected[0], len(prompt) - 16)
        assert_no_live_blocks(cached)
    finally:
        cached.stop()
        plain.stop()


def run_one(engine, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the cache supplied."""

    async def collect() -> tuple[list[int], int]:
        ids, cached = [], -1
        async for out in submit(engine, prompt, greedy()):
            ids += out.token_ids
            cached = out.cached_tokens
        return ids, cached

    return asyncio.run(collect())


def generate_with(smollm: LoadedModel, prompts, params, **config) -> list[list[int]]:
    engine = start_engine(smollm, **config)
    try:
        return generate(engine, prompts, params)
    finally:
        engine.stop()

"""The prefix cache on the real model: the same tokens with and without it, and the reuse it reports."""

from __future__ import annotations

import pytest
from helpers import generate, start_engine

from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant. Answer with care, cite what you know, and say so when you do not "
          "know. Keep answers short unless asked otherwise. Today we discuss the geography of Europe, its rivers, "
          "its mountains and its capitals, from Lisbon to Helsinki, from Dublin to Athens, and the seas that "
          "border it: the Atlantic, the Mediterranean, the North Sea and the Baltic.")


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run_one_by_one(smollm: LoadedModel, prompts: list[list[int]], **config) -> tuple[list[list[int]], object]:
    engine = start_engine(smollm, **config)
    try:
        outs = [generate(engine, [p], [greedy()])[0] for p in prompts]
        return outs, engine
    finally:
        engine.stop()


def test_same_tokens_with_and_without_the_cache_for_prefixes_of_many_lengths(smollm: LoadedModel) -> None:
    base = smollm.tokenizer.encode(SYSTEM)
    assert len(base) > 64
    # shared prefixes ending on and inside blocks of 16, each followed by its own question
    prompts = [base[:n] + smollm.tokenizer.encode(f" Question {n}: which river?") for n in
               (5, 15, 16, 17, 31, 32, 33, 47, 48, 64, len(base))]
    prompts += [prompts[-1], prompts[3]]  # exact repeats: everything but the last token is cached
    cached, engine = run_one_by_one(smollm, prompts)
    uncached, _ = run_one_by_one(smollm, prompts, prefix_caching=False)
    assert cached == uncached
    sched = engine.scheduler
    assert sched.prefix_hit_tokens >= 16 * 20  # later prompts reuse the earlier ones' blocks
    assert engine.kv_cache.prefix_cache.num_blocks > 0 and engine.kv_cache.usage() == 0


def test_a_chat_turn_reuses_the_previous_turn(smollm: LoadedModel) -> None:
    engine = start_engine(smollm)
    try:
        history = smollm.tokenizer.encode(SYSTEM + " Which is the longest river of Europe?")
        answer = generate(engine, [history], [greedy()])[0]
        turn2 = history + answer + smollm.tokenizer.encode(" And the second longest?")
        before = engine.scheduler.prefix_hit_tokens
        generate(engine, [turn2], [greedy()])
        # the whole first turn (prompt and answer) was cached at finish, up to its last full block
        assert engine.scheduler.prefix_hit_tokens - before == (len(history) + len(answer) - 1) // 16 * 16
    finally:
        engine.stop()


def test_concurrent_requests_with_a_shared_prefix_under_pool_pressure(smollm: LoadedModel) -> None:
    base = smollm.tokenizer.encode(SYSTEM)
    prompts = [base + smollm.tokenizer.encode(f" Tell me about city number {i}.") for i in range(8)]
    params = [greedy() for _ in prompts]
    reference = generate_with(smollm, prompts, params, prefix_caching=False)
    # a pool of 24 blocks: the cache must give way (evict) rather than starve the requests
    engine = start_engine(smollm, kv_cache_memory=str(24 * 16 * 46080), block_size=16)
    try:
        assert generate(engine, prompts, params) == reference
        assert generate(engine, prompts[:2], params[:2]) == reference[:2]
        assert engine.kv_cache.usage() == 0
    finally:
        engine.stop()


def generate_with(smollm: LoadedModel, prompts, params, **config) -> list[list[int]]:
    engine = start_engine(smollm, **config)
    try:
        return generate(engine, prompts, params)
    finally:
        engine.stop()

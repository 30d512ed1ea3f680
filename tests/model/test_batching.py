"""Continuous batching on the real model: a request's tokens do not depend on its batch, its layout or preemption
(on the dense fp32 reference: the default kernels' many-row paths), and a request that fails ends alone (in
deterministic mode on the served weights, `smollm_exact`, where the engine's bookkeeping is what is checked)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import assert_no_live_blocks, assert_preempted_to, generate, our_logits, start_engine, submit

from tokenmill.engine import engine as engine_module
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine import Engine
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import RequestError
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press begins",
    "List five fruits:",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom far away, there lived a young princess who loved to read books about "
    "dragons, knights and distant lands. Every evening she would",
    "Translate to French: Good morning, how are you?",
    "The three laws of thermodynamics are",
    "Q: What is the boiling point of water?\nA:",
    "Roses are red, violets are blue,",
]
TOKENS = 24


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def prompt_ids(smollm: LoadedModel) -> list[list[int]]:
    return [smollm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(smollm: LoadedModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    engine = start_engine(smollm)
    try:
        return [generate(engine, [ids], [greedy()])[0] for ids in prompt_ids]
    finally:
        engine.stop()


def run_batch(smollm: LoadedModel, prompt_ids: list[list[int]], params=None, **config) -> list[list[int]]:
    engine = start_engine(smollm, **config)
    try:
        return generate(engine, prompt_ids, params or [greedy() for _ in prompt_ids])
    finally:
        assert engine.kv_cache.num_sequences == 0
        engine.stop()


def test_greedy_alone_equals_greedy_in_a_mixed_batch(smollm, prompt_ids, alone) -> None:
    # A small budget: long prompts prefill in chunks while the short ones already decode.
    batched = run_batch(smollm, prompt_ids, max_num_batched_tokens=24, long_prefill_token_threshold=8)
    assert batched == alone


def test_contiguous_kv_gives_the_same_tokens(smollm, prompt_ids, alone) -> None:
    assert run_batch(smollm, prompt_ids, kv="contiguous") == alone


def test_preemption_recomputes_to_the_same_tokens(smollm, prompt_ids, alone) -> None:
    # KV memory for ~10 blocks of 16 tokens: eight sequences of up to ~70 tokens must take turns.
    assert_preempted_to(smollm, prompt_ids, greedy(), alone, kv_cache_memory=str(10 * 16 * 46080), block_size=16)


def test_seeded_sampling_does_not_depend_on_the_batch(smollm_exact, prompt_ids) -> None:
    params = [SamplingParams(max_tokens=TOKENS, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompt_ids))]
    solo = run_batch(smollm_exact, prompt_ids[:1], params[:1])
    assert run_batch(smollm_exact, prompt_ids, params)[0] == solo[0]


def test_a_request_that_raises_fails_alone(smollm_exact, prompt_ids, monkeypatch) -> None:
    engine = start_engine(smollm_exact)
    sampler = engine.sampler

    def flaky(logits, seqs):
        if any(s.params.seed == 666 for s in seqs):
            raise RuntimeError("boom")
        return sampler(logits, seqs)

    monkeypatch.setattr(engine, "sampler", flaky)
    try:
        params = [greedy() for _ in prompt_ids]
        params[3] = SamplingParams(max_tokens=TOKENS, seed=666)
        outs = generate(engine, prompt_ids, params)
        assert outs[3] == [] and all(len(o) == TOKENS for i, o in enumerate(outs) if i != 3)
        assert_no_live_blocks(engine)
        assert generate(engine, prompt_ids[:1], [greedy()])[0]  # still serving
    finally:
        engine.stop()


async def _collect(engine: Engine, prompts: list[list[int]],
                   params: list[SamplingParams]) -> list[list[SequenceOutput]]:
    """Every output of each sequence, submitted at once; a sequence never finished fails the test."""
    streams = [submit(engine, p, sp) for p, sp in zip(prompts, params, strict=True)]

    async def outputs(stream) -> list[SequenceOutput]:
        return [out async for out in stream]

    return list(await asyncio.wait_for(asyncio.gather(*(outputs(s) for s in streams)), timeout=120))


@pytest.mark.parametrize("fails_at", ["a middle token", "the last token"])
def test_a_request_whose_text_fails_to_decode_fails_alone(smollm_exact, prompt_ids, monkeypatch, fails_at: str) -> None:
    """A tokenizer's error on one sequence's tokens (the tokenizers library's stream raised on stray bytes) ends
    that request with an error, also where the step had just finished it, not the engine loop."""
    add_token = IncrementalDetokenizer.add_token
    calls = {"count": 0}

    def failing(self, token_id: int) -> None:
        if "no such text" in self._stop:
            calls["count"] += 1
            if calls["count"] == (3 if fails_at == "a middle token" else TOKENS):
                raise RuntimeError("Invalid prefix encountered while decoding stream")
        add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", failing)
    engine = start_engine(smollm_exact)
    try:
        params = [greedy() for _ in prompt_ids]
        params[2] = greedy(stop=["no such text"])
        outs = asyncio.run(_collect(engine, prompt_ids, params))
        assert outs[2][-1].finish_reason == "error" and outs[2][-1].error
        assert all(o[-1].finish_reason == "length" for i, o in enumerate(outs) if i != 2)
        assert_no_live_blocks(engine)
        assert generate(engine, prompt_ids[:1], [greedy()])[0]  # still serving
    finally:
        engine.stop()


def test_an_output_that_cannot_be_built_or_delivered_ends_its_sequence_alone(smollm_exact, prompt_ids,
                                                                            monkeypatch) -> None:
    """An output that raises while it is built (its prompt logprobs here) ends that request with an error; a sink
    that raises (the loop of a reader that left, closed) ends its sequence unseen. Before, either stopped the
    engine loop for every request."""
    prompt_logprobs = OutputProcessor._prompt_logprobs

    def failing(seq):
        if seq.params.seed == 666:
            raise RuntimeError("boom")
        return prompt_logprobs(seq)

    monkeypatch.setattr(OutputProcessor, "_prompt_logprobs", staticmethod(failing))
    engine = start_engine(smollm_exact)
    try:
        delivered = []

        def closed(out: SequenceOutput) -> None:
            delivered.append(out)
            raise RuntimeError("Event loop is closed")

        engine.add(prompt_ids[0], greedy(), closed)
        params = [greedy() for _ in prompt_ids]
        params[1] = greedy(seed=666)
        outs = asyncio.run(_collect(engine, prompt_ids, params))
        assert outs[1][-1].finish_reason == "error" and outs[1][-1].error
        assert all(o[-1].finish_reason == "length" for i, o in enumerate(outs) if i != 1)
        assert len(delivered) == 1 and delivered[0].finish_reason is None  # given one output, then ended
        assert_no_live_blocks(engine)
        assert engine.num_unfinished == 0  # each counted out once
        assert generate(engine, prompt_ids[:1], [greedy()])[0]  # still serving
    finally:
        engine.stop()


def test_a_sequence_that_cannot_be_added_fails_alone(smollm_exact, prompt_ids, monkeypatch) -> None:
    """A sequence the engine cannot set up (here its random stream fails; a seed past 64 bits once did) ends with
    an error output and is counted out; the ones added beside it run, and the engine keeps serving. Before, the
    engine loop died on it and the server stopped."""
    seeded = engine_module.seeded_generator

    def failing(seed: int, device: torch.device) -> torch.Generator:
        if seed == 666:
            raise ValueError("Overflow when unpacking long long")
        return seeded(seed, device)

    monkeypatch.setattr(engine_module, "seeded_generator", failing)
    engine = start_engine(smollm_exact)
    try:
        params = [greedy() for _ in prompt_ids]
        params[1] = greedy(seed=666)
        outs = asyncio.run(_collect(engine, prompt_ids, params))
        assert len(outs[1]) == 1 and outs[1][0].finish_reason == "error" and outs[1][0].error
        assert outs[1][0].prompt_tokens == len(prompt_ids[1])
        assert all(o[-1].finish_reason == "length" for i, o in enumerate(outs) if i != 1)
        assert engine.num_unfinished == 0
        assert_no_live_blocks(engine)
        assert generate(engine, prompt_ids[:1], [greedy()])[0]  # still serving
    finally:
        engine.stop()


def test_prompt_logprobs_are_the_models_over_chunks_and_prefix_cache_hits(smollm, prompt_ids) -> None:
    """Each prompt token's logprob under the logits of the position before it and the top 3 there, as a whole
    prefill gives them, though the prompt runs in chunks of 16 and the same prompt's blocks sit in the prefix
    cache (a cached position has no logits: such a request computes its whole prompt). With the first output."""
    prompt = prompt_ids[3]  # 36 tokens
    expected = our_logits(smollm, prompt).log_softmax(-1)
    engine = start_engine(smollm, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    try:
        generate(engine, [prompt], [greedy()])
        assert engine.kv_cache.prefix_cache.num_blocks >= 2  # its blocks are cached
        params = [greedy(prompt_logprobs=3), greedy(prompt_logprobs=0)]
        outs = asyncio.run(_collect(engine, [prompt, prompt], params))
    finally:
        engine.stop()
    for out, k in zip(outs, (3, 0), strict=True):
        entries = out[0].prompt_logprobs
        assert entries is not None and all(o.prompt_logprobs is None for o in out[1:])
        assert [e.token_id for e in entries] == prompt[1:]
        for position, entry in enumerate(entries):
            row = expected[position]
            assert abs(entry.logprob - float(row[prompt[position + 1]])) < 1e-4
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()[:k]


def test_a_request_that_can_never_fit_is_refused_before_it_queues(smollm_exact, prompt_ids) -> None:
    engine = start_engine(smollm_exact, kv_cache_memory=str(4 * 16 * 46080), block_size=16)  # 64 tokens in all
    try:
        with pytest.raises(RequestError, match="64 tokens"):
            submit(engine, prompt_ids[3], SamplingParams(max_tokens=40))
        with pytest.raises(RequestError, match="maximum context length"):
            submit(engine, prompt_ids[0], SamplingParams(max_tokens=9000))
        assert generate(engine, [prompt_ids[1]], [greedy()])[0]  # what fits still runs
    finally:
        engine.stop()

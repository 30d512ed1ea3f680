"""A stop string inside a run of accepted proposals, on the real model: the tokens after it are dropped, and with
them their place in the sequence's progress (num_computed_tokens), so what the sequence leaves in the prefix cache
is its answer's KV and a later request sharing that prefix answers as a fresh engine does."""

from __future__ import annotations

import asyncio

import pytest
from helpers import assert_no_live_blocks, counted, start_engine, submit

from tokenmill.engine.engine import Engine
from tokenmill.engine.request import Sequence
from tokenmill.engine.scheduler import ScheduledSequence, Scheduler, TextStop
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.slow

FOX = ("Repeat after me three times: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
       "the lazy dog. The quick brown fox")


def answer(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str | None, int]:
    """One request's token ids, text, finish reason and cached prompt tokens."""
    async def one() -> tuple[list[int], str, str | None, int]:
        tokens, text, reason, cached = [], "", None, 0
        async for out in submit(engine, prompt, params):
            tokens, text, reason, cached = tokens + out.token_ids, text + out.text, out.finish_reason, out.cached_tokens
        return tokens, text, reason, cached

    return asyncio.run(one())


def test_a_stop_string_inside_an_accepted_run_counts_no_dropped_token_as_computed(
        smollm_exact: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer copies its prompt, so " over" ends it inside a run of accepted proposals: the tokens after it are
    dropped, and the sequence's computed tokens are its kept ones (the stop token's KV, an accepted proposal's, is
    computed). A second request, its prompt the first's with the answer and more, reuses those blocks and answers
    as an engine that never speculated nor cached."""
    stops: list[tuple[int, int, int]] = []  # (tokens dropped, num_computed_tokens, num_tokens) after each stop
    update = Scheduler.update

    def recording(self: Scheduler, plan: list[ScheduledSequence], new_tokens: list[list[int]],
                  text: TextStop | None = None) -> list[Sequence]:
        sampling = [item.seq for item in plan if item.samples]
        before = [len(seq.output_ids) for seq in sampling]
        finished = update(self, plan, new_tokens, text)
        for seq, n, tokens in zip(sampling, before, new_tokens, strict=True):
            if seq in finished and seq.finish_reason == "stop":
                stops.append((n + len(tokens) - len(seq.output_ids), seq.num_computed_tokens, seq.num_tokens))
        return finished

    monkeypatch.setattr(Scheduler, "update", recording)
    fox = smollm_exact.tokenizer.encode(FOX)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    engine = start_engine(smollm_exact, speculative="ngram")
    try:
        tokens, text, reason, _ = answer(engine, fox, SamplingParams(max_tokens=24, temperature=0.0, stop=[" over"]))
        assert (text, reason) == (" jumps", "stop") and counted(engine.metrics.spec_accepted_tokens) > 0
        [(dropped, computed, total)] = stops
        assert dropped > 0, "the stop string fell at the end of a step, not inside an accepted run"
        assert computed == total == len(fox) + len(tokens)
        follow = fox + tokens + smollm_exact.tokenizer.encode(" over the lazy dog. And now say it once more:")
        shared = answer(engine, follow, greedy)
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    fresh_engine = start_engine(smollm_exact, prefix_caching=False)
    try:
        fresh = answer(fresh_engine, follow, greedy)
    finally:
        fresh_engine.stop()
    assert shared[3] >= 16  # the follow-up did read the blocks the stopped sequence left
    assert shared[:3] == fresh[:3]

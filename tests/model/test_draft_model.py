"""Speculative decoding with a draft model (engine/draft.py) on tiny random models: its guesses are the draft's
greedy tokens, it runs only what changed since its last guess, it gives up the KV of sequences not asking when its
pool is short, and whatever it guesses the tokens are those of plain decoding (the real model: tests/model/
test_speculative.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import (
    add_and_abort,
    assert_no_live_blocks,
    counted,
    generate,
    our_logits,
    start_engine,
    write_tiny_gguf,
)

from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.config import WeightPlan
from tokenmill.engine.draft import DraftModelProposer
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import Sequence
from tokenmill.errors import ConfigError
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 7, list(range(40, 90)), [100, 101] * 9]


@pytest.fixture(scope="module")
def target(tiny_gguf: Path) -> LoadedModel:
    return load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of the same vocabulary with other weights: a draft that guesses mostly wrong."""
    return write_tiny_gguf(tmp_path_factory.mktemp("other") / "other.gguf", seed=1)


def greedy_continuation(model: LoadedModel, tokens: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(our_logits(model, tokens + out)[-1].argmax()))
    return out


def assert_draft_pool_free(engine: Engine) -> None:
    draft = engine.proposer
    assert isinstance(draft, DraftModelProposer)
    assert draft.kv_cache.pool.num_free == draft.kv_cache.pool.num_blocks and not draft.held


def sequence(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=prompt, params=SamplingParams(max_tokens=32), detokenizer=None,
                    sink=lambda _: None)


def test_a_draft_of_the_models_own_weights_is_always_right_and_another_changes_no_token(
        target, tiny_gguf, other_gguf, monkeypatch) -> None:
    """Greedy and seeded sampling, 5 sequences in one batch: the tokens of plain decoding with either draft. The
    model's own weights as its draft: every greedy guess accepted, and the draft runs each token about once (what
    its KV holds is kept from one guess to the next, not run again)."""
    greedy = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    sampled = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    fed = []
    step = DraftModelProposer._step

    def counting(self, feeds):
        fed.append(sum(len(tokens) for _, tokens, _ in feeds))
        return step(self, feeds)

    monkeypatch.setattr(DraftModelProposer, "_step", counting)
    engine = start_engine(target)
    try:
        plain = generate(engine, PROMPTS, greedy, timeout=10), generate(engine, PROMPTS, sampled, timeout=10)
    finally:
        engine.stop()
    for draft, rate in ((tiny_gguf, (0.99, 1.0)), (other_gguf, (0.0, 0.5))):
        engine = start_engine(target, speculative="draft", draft_model=str(draft), dtype="float32",
                              speculative_max_seqs=8)
        try:
            fed.clear()
            assert generate(engine, PROMPTS, greedy, timeout=10) == plain[0]
            accepted, proposed = counted(engine.metrics.spec_accepted_tokens), counted(engine.metrics.spec_draft_tokens)
            assert proposed > 100 and rate[0] <= accepted / proposed <= rate[1]
            if draft == tiny_gguf:  # every token of each sequence once, and the last guesses
                assert sum(fed) <= sum(len(p) + 40 + 4 for p in PROMPTS)
            assert generate(engine, PROMPTS, sampled, timeout=10) == plain[1]
            assert_no_live_blocks(engine)
            assert_draft_pool_free(engine)
        finally:
            engine.stop()


def test_the_draft_runs_only_what_changed_and_gives_way_when_its_pool_is_short(target) -> None:
    """Its guesses are its greedy tokens; after a rejected guess it runs from there (the stale KV overwritten); a
    sequence not asking gives up its blocks to one that asks; when those asking do not fit, one goes without."""
    c = target.config
    cache = PagedKVCache(KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, target.dtype), target.device, 3, 16)
    draft = DraftModelProposer(target, cache, target.tokenizer.vocab_size)
    a, b = sequence(0, list(range(60, 80))), sequence(1, list(range(120, 140)))
    guesses = draft.propose([a], [4])[0]
    assert guesses == greedy_continuation(target, a.prompt_ids, 4)
    assert draft.held[0] == (len(a.prompt_ids), guesses[:3])  # the prompt and the guesses it ran, all but the last
    wrong = (guesses[2] + 1) % 256
    a.output_ids = guesses[:2] + [wrong]  # two guesses accepted, the third rejected: the target chose another
    again = draft.propose([a], [3])[0]
    assert again == greedy_continuation(target, a.tokens(0, a.num_tokens), 3)
    assert draft.held[0] == (a.num_tokens, again[:2])  # it ran again from the rejected guess's position on
    # The first guess rejected, then steps without proposals (the acceptance gate pausing the sequence): the next
    # proposal runs from the rejected guess on, not from where the draft's KV ended (it held stale guesses there).
    a.output_ids += [(again[0] + 1) % 256, 5, 6, 7]
    assert draft.propose([a], [3])[0] == greedy_continuation(target, a.tokens(0, a.num_tokens), 3)
    assert draft.propose([b], [4])[0] == greedy_continuation(target, b.prompt_ids, 4)  # a gave way: 3 blocks
    assert 0 not in draft.held and cache.blocks_of(0) == 0
    both = draft.propose([a, b], [4, 4])  # a needs 2 blocks, b holds 2 of 3
    assert both[0] == [] and both[1] == greedy_continuation(target, b.prompt_ids, 4)
    draft.finish(b)
    draft.finish(a)
    assert cache.pool.num_free == 3 and not draft.held


def test_aborted_and_preempted_draft_streams_leave_no_block_behind(target, tiny_gguf) -> None:
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine = start_engine(target, speculative="draft", draft_model=str(tiny_gguf), dtype="float32")
    try:
        add_and_abort(engine, PROMPTS, greedy)
        assert_no_live_blocks(engine)
        assert_draft_pool_free(engine)
    finally:
        engine.stop()
    plain = start_engine(target, kv_cache_memory=str(10 * 16 * 512))
    try:
        expected = generate(plain, PROMPTS, [greedy] * len(PROMPTS), timeout=10)
    finally:
        plain.stop()
    engine = start_engine(target, speculative="draft", draft_model=str(tiny_gguf), dtype="float32",
                          speculative_max_seqs=8, kv_cache_memory=str(10 * 16 * 512))  # 10 blocks: they take turns
    try:
        assert generate(engine, PROMPTS, [greedy] * len(PROMPTS), timeout=10) == expected
        assert counted(engine.metrics.preemptions) > 0 and counted(engine.metrics.spec_accepted_tokens) > 0
        assert_no_live_blocks(engine)
        assert_draft_pool_free(engine)
    finally:
        engine.stop()


def test_a_draft_must_be_named_and_share_the_vocabulary(target, tiny_gguf, smollm_path) -> None:
    with pytest.raises(ConfigError, match="needs --draft-model"):
        start_engine(target, speculative="draft")
    with pytest.raises(ConfigError, match="--speculative draft only"):
        start_engine(target, speculative="ngram", draft_model=str(tiny_gguf))
    with pytest.raises(ConfigError, match=rf"^--draft-model {re.escape(str(smollm_path))}: its vocabulary is not the "
                                          r"model's \(a draft's tokens must mean what the model's do\)$"):
        start_engine(target, speculative="draft", draft_model=str(smollm_path))


def test_a_draft_trained_on_a_shorter_context_still_drafts(tiny_gguf, tmp_path) -> None:
    """The draft serves the target's context even past its own (its guesses only get worse there); only the
    --max-model-len a user asks of the model is held to the model's training."""
    target = load_model(str(write_tiny_gguf(tmp_path / "long.gguf", context_length=1024)), WeightPlan(dtype="float32",
                                                                                                      device="cpu"))
    greedy = [SamplingParams(max_tokens=16, ignore_eos=True)] * 2  # at most --speculative-max-seqs, so it drafts
    plain = start_engine(target)
    try:
        expected = generate(plain, PROMPTS[:2], greedy, timeout=10)
    finally:
        plain.stop()
    engine = start_engine(target, speculative="draft", draft_model=str(tiny_gguf), dtype="float32")  # 512 tokens
    try:
        assert engine.max_model_len == 1024
        assert generate(engine, PROMPTS[:2], greedy, timeout=10) == expected
        assert counted(engine.metrics.spec_draft_tokens) > 0
        before = counted(engine.metrics.spec_draft_tokens)
        long = [3 + i % 200 for i in range(600)]  # past the draft's own 512 positions
        generate(engine, [long], greedy[:1], timeout=10)
        assert engine.proposer is not None and counted(engine.metrics.spec_draft_tokens) > before
    finally:
        engine.stop()

def test_a_draft_model_that_fails_turns_speculation_off_and_the_requests_go_on(target, tiny_gguf, monkeypatch,
                                                                                caplog) -> None:
    greedy = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2
    engine = start_engine(target)
    try:
        expected = generate(engine, PROMPTS[:2], greedy, timeout=10)
    finally:
        engine.stop()

    def failing(self, feeds):
        raise RuntimeError("the draft's forward failed")

    monkeypatch.setattr(DraftModelProposer, "_step", failing)
    engine = start_engine(target, speculative="draft", draft_model=str(tiny_gguf), dtype="float32")
    try:
        assert generate(engine, PROMPTS[:2], greedy, timeout=10) == expected
        assert engine.proposer is None and "speculation is off" in caplog.text
    finally:
        engine.stop()

"""The scheduling policy, without a model: admission by free blocks, chunked prefill, preemption and resume."""

from __future__ import annotations

import pytest
import torch

from tokenmill.cache.kv_cache import ContiguousKVCache, KVSpec, PagedKVCache
from tokenmill.config import EngineConfig
from tokenmill.engine.request import Sequence, Status
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling import SamplingParams

BLOCK = 4
# The smallest KV shape: the caches' tensors are a few floats, their bookkeeping is the real one.
TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
CPU = torch.device("cpu")


def make(seq_id: int, prompt_len: int, max_tokens: int = 8, prompt: list[int] | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=prompt or [1] * prompt_len,
                    params=SamplingParams(max_tokens=max_tokens), detokenizer=None, sink=lambda _: None)


def test_a_sequence_s_tokens_from_its_prompt_its_output_and_across_both() -> None:
    seq = make(0, 0, prompt=[10, 11, 12])
    seq.output_ids = [20, 21]
    every = [10, 11, 12, 20, 21]
    assert [seq.tokens(a, b) for a, b in [(0, 2), (3, 5), (4, 5), (1, 4), (0, 5)]] == [
        every[a:b] for a, b in [(0, 2), (3, 5), (4, 5), (1, 4), (0, 5)]]


def new_scheduler(kv, attention_crossover: int = 0, **config) -> Scheduler:
    """No long-prompt cap unless a test sets one."""
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=0, long_prefill_chunk=0)
    return Scheduler(EngineConfig(**{**defaults, **config}), kv, max_model_len=4096,
                     attention_crossover=attention_crossover)


def run(sched: Scheduler, plan) -> None:
    """What the engine does after a successful step: token 5 for whoever reached the end."""
    sched.update(plan, [[5] for item in plan if item.samples])


def step(sched: Scheduler) -> list[tuple[int, int]]:
    """Schedule and run one step; the plan as (seq id, tokens)."""
    plan = sched.schedule()
    run(sched, plan)
    return [(p.seq.seq_id, p.num_tokens) for p in plan]


def scheduler(num_blocks: int = 100, prefix_caching: bool = False, **config) -> tuple[Scheduler, PagedKVCache]:
    kv = PagedKVCache(TINY, CPU, num_blocks, BLOCK, prefix_caching)
    return new_scheduler(kv, **config), kv


def test_admits_by_free_blocks_and_seq_cap() -> None:
    sched, kv = scheduler(num_blocks=6, max_num_seqs=2)
    for i in range(3):
        sched.add(make(i, 8))  # 2 blocks each
    plan = sched.schedule()
    assert [(p.seq.seq_id, p.num_tokens) for p in plan] == [(0, 8), (1, 8)]  # the cap of 2 sequences
    assert kv.pool.num_used == 4 and len(sched.waiting) == 1
    sched2, kv2 = scheduler(num_blocks=5)
    for i in range(3):
        sched2.add(make(i, 8))
    assert [p.seq.seq_id for p in sched2.schedule()] == [0, 1]  # the third prompt's 2 blocks do not fit
    assert sched2.waiting[0].seq_id == 2 and kv2.pool.num_free == 1


def test_long_prompt_is_chunked_beside_decodes_within_the_budget() -> None:
    sched, _ = scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8, long_prefill_chunk=6)
    short = make(0, 4)
    sched.add(short)
    run(sched, sched.schedule())
    long = make(1, 40)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 40:
        plan = sched.schedule()
        assert sum(p.num_tokens for p in plan) <= 16
        assert plan[0].seq is short and plan[0].num_tokens == 1  # the decode is never starved
        chunks.append(next(p.num_tokens for p in plan if p.seq is long))
        run(sched, plan)
    assert chunks == [6] * 6 + [4]  # capped while the short one decodes
    alone, _ = scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8, long_prefill_chunk=6)
    lone = make(2, 40)
    alone.add(lone)
    chunks = []
    while lone.num_computed_tokens < 40:
        plan = alone.schedule()
        chunks.append(plan[0].num_tokens)
        run(alone, plan)
    assert chunks == [16, 16, 8]  # nobody decodes: the whole budget


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    sched, _ = scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    sched.add(make(0, 10))
    sched.add(make(1, 10))
    assert [(p.seq.seq_id, p.num_tokens) for p in sched.schedule()] == [(0, 10)]  # the second does not fit
    big, _ = scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    big.add(make(0, 40))
    assert [p.num_tokens for p in big.schedule()] == [40]  # larger than the budget: runs alone, whole


@pytest.mark.parametrize("prompt_len", [40, 14])
def test_without_chunked_prefill_the_first_prompt_waiting_runs_alone_if_it_fits_no_step_beside_decodes(
        prompt_len: int) -> None:
    """Larger than the budget (40), or than what the decodes leave of it (14 beside 4 decodes of 16): the first
    prompt in the queue runs alone, the decodes waiting one step. It used to wait for a step nobody decodes in,
    while later, shorter prompts overtook it and kept the decodes going (an audit's long prompt waited 29 s)."""
    sched, _ = scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    decoders = [make(i, 2, max_tokens=50) for i in range(4)]
    for seq in decoders:
        sched.add(seq)
    step(sched)
    sched.add(make(9, prompt_len))
    sched.add(make(10, 2))  # a short prompt behind it: it never runs before the long one
    alone = step(sched)
    assert alone[0] == (9, prompt_len) and all(seq_id >= 9 for seq_id, _ in alone)  # what is left of the budget
    assert step(sched)[:5] == [(0, 1), (1, 1), (2, 1), (3, 1), (9, 1)]  # the decodes go on
    short, _ = scheduler(num_blocks=10, max_num_batched_tokens=16, chunked_prefill=False)
    for i in range(2):
        short.add(make(i, 12))
    assert step(short) + step(short) == [(0, 12), (0, 1), (1, 12)]
    short.add(make(9, 20))  # no KV room for it beside the decodes: it waits, and nobody overtakes it
    short.add(make(10, 3))
    assert step(short) == [(0, 1), (1, 1)]


def test_preempts_the_newest_and_resumes_it_first() -> None:
    sched, kv = scheduler(num_blocks=6)
    seqs = [make(i, 7, max_tokens=8) for i in range(3)]  # 2 blocks each: the pool is full after admission
    for s in seqs:
        sched.add(s)
    run(sched, sched.schedule())
    assert kv.pool.num_free == 0
    late = make(3, 4)
    sched.add(late)
    run(sched, sched.schedule())  # each needs an 8th token slot: still inside block 2
    plan = sched.schedule()  # the 9th token needs a third block: the newest (2) is preempted
    assert sched.stats.preemptions >= 1
    assert seqs[2].status == Status.WAITING and seqs[2].num_computed_tokens == 0
    assert list(sched.waiting)[:2] == [seqs[2], late]  # preempted work resumes before new work
    assert {p.seq.seq_id for p in plan} <= {0, 1}
    for _ in range(200):
        if not sched.has_work():
            break
        run(sched, sched.schedule())
        for s in list(sched.running):
            if len(s.output_ids) >= s.max_tokens:
                sched.finish(s, "length")
    assert all(len(s.output_ids) >= s.max_tokens for s in seqs)
    assert kv.pool.num_free == 6 and kv.tables == {}


def test_finish_frees_running_and_waiting() -> None:
    sched, kv = scheduler(max_num_seqs=1)
    a, b = make(0, 4), make(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")
    sched.finish(a, "stop")
    sched.finish(a, "stop")  # idempotent
    assert kv.pool.num_used == 0 and not sched.has_work()
    assert a.status == b.status == Status.FINISHED and a.finish_reason == "stop"


def test_a_failed_batch_is_rerun_one_sequence_at_a_time() -> None:
    sched, kv = scheduler()
    seqs = [make(i, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    sched.isolate([p.seq for p in plan])
    assert kv.pool.num_used == 0
    alone = sched.schedule()
    assert len(alone) == 1 and alone[0].num_tokens == 4
    run(sched, alone)
    sched.finish(sched.schedule()[0].seq, "error")  # the next suspect fails alone: only it is failed
    rest = sched.schedule()
    assert len(rest) == 1
    run(sched, rest)
    assert not sched.isolated and len(sched.schedule()) == 2  # back to normal batching


def test_long_prompts_share_the_cap_and_short_ones_go_whole() -> None:
    sched, _ = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10, long_prefill_chunk=8)
    first = make(0, 4)
    sched.add(first)
    run(sched, sched.schedule())
    longs = [make(i, 30) for i in range(1, 4)]
    for s in longs:
        sched.add(s)
    sched.add(short := make(9, 6))
    plan = sched.schedule()
    assert any(p.seq is short and p.num_tokens == 6 for p in plan)  # a short prompt is not held back
    while any(s.num_computed_tokens < 30 for s in longs):
        long_work = sum(p.num_tokens for p in plan
                        if p.seq in longs and p.seq.num_tokens - p.seq.num_computed_tokens > 1)
        assert long_work <= 8  # the long prompts share the cap, to their last token
        run(sched, plan)
        plan = sched.schedule()


def test_a_long_prompt_chunk_shrinks_as_its_context_grows() -> None:
    sched, _ = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4, long_prefill_chunk=16,
                         attention_crossover=32)
    sched.add(first := make(0, 2, max_tokens=1000))
    run(sched, sched.schedule())
    sched.add(long := make(1, 200))
    chunks = []
    while long.num_computed_tokens < 100:
        plan = sched.schedule()
        chunks.append(next(p.num_tokens for p in plan if p.seq is long))
        run(sched, plan)
    # 16 / (1 + context / 32): 16 at context 0, 10 at 16 (16 * 32 / 48), ... ever smaller, never zero
    assert chunks[0] == 16 and chunks[1] == 10 and chunks == sorted(chunks, reverse=True) and min(chunks) >= 1
    assert first.output_ids  # the decoder kept decoding


def test_a_prompt_goes_whole_up_to_the_budget_and_a_two_token_prompt_is_not_a_decode() -> None:
    sched, _ = scheduler(max_num_batched_tokens=16)
    sched.add(make(0, 2))
    assert step(sched) == [(0, 2)]
    sched.add(make(1, 15))
    assert step(sched) == [(0, 1), (1, 15)]  # 1 decode + 15 prompt tokens: exactly the budget
    unchunked, _ = scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    unchunked.add(make(0, 2))
    step(unchunked)
    unchunked.add(make(1, 15))
    assert step(unchunked) == [(0, 1), (1, 15)]  # whole prompts only, and this one fits exactly


def test_decodes_lead_the_batch() -> None:
    sched, _ = scheduler(max_num_batched_tokens=6)
    sched.add(make(0, 8))
    assert step(sched) == [(0, 6)]
    sched.add(make(1, 1))
    assert step(sched) == [(1, 1), (0, 2)]  # a 1-token prompt leads 0's last 2-token chunk
    sched.add(make(2, 3))
    assert step(sched) == [(0, 1), (1, 1), (2, 3)]  # in running order among themselves


def test_the_token_budget_caps_decodes_and_what_is_left_goes_to_new_prompts() -> None:
    sched, _ = scheduler(max_num_batched_tokens=4)
    for i in range(6):
        sched.add(make(i, 1))
    assert step(sched) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert step(sched) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # the running come first: 4 and 5 wait
    roomy, _ = scheduler(max_num_batched_tokens=5)
    for i in range(4):
        roomy.add(make(i, 1))
    step(roomy)
    roomy.add(make(9, 30))
    assert step(roomy) == [(0, 1), (1, 1), (2, 1), (3, 1), (9, 1)]  # the one token left is a chunk
    for _ in range(3):
        assert sum(n for _, n in step(roomy)) == 5
    capped, _ = scheduler(max_num_batched_tokens=5, long_prefill_token_threshold=8, long_prefill_chunk=4)
    for i in range(3):
        capped.add(make(i, 1))
    step(capped)
    capped.add(make(9, 30))
    assert step(capped) == [(0, 1), (1, 1), (2, 1), (9, 2)]  # the long cap is 4, the budget left 2


def test_a_prompt_at_the_threshold_is_short_and_one_past_it_is_long() -> None:
    sched, _ = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10, long_prefill_chunk=4)
    sched.add(make(0, 1))
    step(sched)
    sched.add(make(1, 10))
    sched.add(make(2, 11))
    assert step(sched) == [(0, 1), (1, 10), (2, 4)]


def test_long_prompts_are_charged_for_their_context() -> None:
    # crossover 8: a prompt token at context c costs 1 + c / 8 of the cap of 16
    sched, _ = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4, long_prefill_chunk=16,
                         attention_crossover=8)
    sched.add(make(0, 1))
    step(sched)
    sched.add(make(1, 100))
    assert step(sched) == [(0, 1), (1, 16)]  # alone, at context 0: the whole cap
    sched.add(make(2, 100))
    # 1, at context 16, costs 3 a token: 5 tokens (15 of 16); 2, at context 0, gets the 1 left
    assert step(sched) == [(0, 1), (2, 1), (1, 5)]


def test_a_long_prompt_left_without_budget_does_not_hold_up_the_sequences_after_it() -> None:
    # crossover 4: a prompt token at context c costs 1 + c / 4 of the cap of 4
    sched, _ = scheduler(long_prefill_token_threshold=4, long_prefill_chunk=4, attention_crossover=4)
    sched.add(make(0, 1, max_tokens=1000))
    step(sched)
    sched.add(make(1, 200))
    step(sched)
    step(sched)
    sched.add(make(2, 200))
    assert dict(step(sched))[2] == 1  # 1, at context 6, left 1.5 of the cap: 2 starts
    sched.add(make(3, 1, max_tokens=1000))
    skipped = 0
    for _ in range(16):
        plan = dict(step(sched))
        # the decodes never wait, and the first long prompt advances even when one of its tokens costs more than
        # the whole cap (context 16 and beyond)
        assert plan[0] == 1 and plan[3] == 1 and plan[1] >= 1
        skipped += 2 not in plan
    assert skipped  # 2, behind 1, found the cap spent


def test_contiguous_kv_is_reserved_for_the_prompt_and_every_token_it_may_generate() -> None:
    kv = ContiguousKVCache(TINY, CPU, capacity_tokens=30)
    sched = new_scheduler(kv)
    sched.add(make(0, 6, max_tokens=10))
    sched.add(make(1, 6, max_tokens=9))
    sched.add(make(2, 6, max_tokens=1))
    assert step(sched) == [(0, 6)]  # 16 of 30 reserved; 1 needs 15: it waits, and nobody overtakes it
    assert kv.buffers[0].shape[2] == 16
    sched.finish(sched.running[0], "stop")
    plan = sched.schedule()
    assert [(p.seq.seq_id, p.num_tokens) for p in plan] == [(1, 6), (2, 6)] and kv.usage() == (15 + 7) / 30


def test_preemption_takes_the_newest_admits_nobody_that_step_and_is_counted_once() -> None:
    sched, kv = scheduler(num_blocks=7)
    seqs = [make(i, 7, max_tokens=12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.stats.preemptions == 0 and step(sched) == [(0, 7), (1, 7), (2, 7)]
    sched.add(make(3, 1))
    assert step(sched) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # 7 blocks: all taken
    plan = sched.schedule()  # 0 and 1 need a third block: 3, then 2, the newest, give theirs back
    assert [(p.seq.seq_id, p.num_tokens) for p in plan] == [(0, 1), (1, 1)]
    assert sched.stats.preemptions == 2 and [s.seq_id for s in sched.waiting] == [2, 3]
    assert kv.pool.num_free == 1  # 2's 2 blocks and 3's 1 freed, 2 taken: nobody new was admitted
    run(sched, plan)
    preempted = 2
    while sched.has_work():
        before = list(sched.running)
        plan = sched.schedule()
        preempted += sum(s.status == Status.WAITING for s in before)
        run(sched, plan)
        for s in list(sched.running):
            if len(s.output_ids) >= s.max_tokens:
                sched.finish(s, "length")
    assert sched.stats.preemptions == preempted and kv.pool.num_free == 7


def test_nobody_is_admitted_in_a_step_that_had_to_preempt() -> None:
    sched, kv = scheduler(num_blocks=4, max_num_batched_tokens=5)
    sched.add(first := make(0, 7, max_tokens=20))
    sched.add(make(1, 6))
    assert step(sched) == [(0, 5)]
    assert step(sched) == [(0, 2), (1, 3)]
    assert step(sched) == [(0, 1), (1, 3)] and kv.pool.num_free == 0
    # 0 needs a third block: 1 gives back its 2; 1 could restart with a 4-token chunk in the block left, but not
    # in the step that found memory short
    assert step(sched) == [(0, 1)] and sched.waiting[0].seq_id == 1 and kv.pool.num_free == 1
    assert first.num_computed_tokens == 9 and step(sched) == [(0, 1), (1, 4)]


def prefix_scheduler(num_blocks: int = 32, **config) -> tuple[Scheduler, PagedKVCache]:
    return scheduler(num_blocks, prefix_caching=True, **config)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_a_prompt_is_shareable_chunk_by_chunk_while_it_runs() -> None:
    sched, kv = prefix_scheduler(max_num_batched_tokens=7)
    first = make(0, 0, prompt=tokens(10, 13))
    sched.add(first)
    assert step(sched) == [(0, 7)]
    assert kv.prefix_cache.num_blocks == 1  # the first chunk's full block
    assert step(sched) == [(0, 6)]
    assert kv.prefix_cache.num_blocks == 3  # the prompt's 3 full blocks, while it still runs
    sched.add(second := make(1, 0, prompt=tokens(10, 12) + [99]))
    assert step(sched) == [(0, 1), (1, 1)] and second.num_cached_tokens == 12
    assert kv.pool.refs(kv.tables[1][0]) == 3  # the first, the second and the tree share a block


def test_a_chunked_prompt_s_sliding_blocks_are_cached_before_its_window_passes_them() -> None:
    """A sliding layer lets go of the blocks its window has passed, chunk by chunk: a request sharing only the
    start of a long prompt still finds that start's sliding blocks in the tree."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=1, dtype=torch.float32, sliding_layers=(True, False),
                  window=8)
    kv = PagedKVCache(spec, CPU, 32, BLOCK, prefix_caching=True, sliding_blocks=32)
    sched = new_scheduler(kv, max_num_batched_tokens=8)
    sched.add(long := make(0, 0, prompt=tokens(10, 40)))
    while long.num_computed_tokens < 40:
        step(sched)
    assert kv.sliding is not None and kv.sliding.tables[0][:6] == [0] * 6  # passed by the window
    sched.add(start := make(1, 0, prompt=tokens(10, 12) + [99]))
    step(sched)
    assert start.num_cached_tokens == 12


def test_what_a_finished_sequence_computed_is_cached_unless_it_failed() -> None:
    for reason, cached in (("stop", 12), ("abort", 12), ("error", 4)):
        sched, kv = prefix_scheduler()
        done = make(0, 0, prompt=tokens(10, 6), max_tokens=20)
        sched.add(done)
        for _ in range(9):
            step(sched)  # the prompt, then 8 tokens: 14 computed, the 15th not yet
        sched.finish(done, reason)
        assert done.finish_reason == reason and kv.num_sequences == 0
        again = make(1, 0, prompt=done.tokens(0, done.num_tokens) + [99])
        sched.add(again)
        step(sched)
        assert again.num_cached_tokens == cached, reason  # a failed step's KV is not trusted


def test_prefix_hits_are_counted_once_per_request_and_never_cover_the_last_token() -> None:
    sched, kv = prefix_scheduler()
    sched.add(make(0, 0, prompt=tokens(10, 8)))
    step(sched)
    sched.add(repeat := make(1, 0, prompt=tokens(10, 8)))  # all 8 cached, but the last token must run
    sched.add(longer := make(2, 0, prompt=tokens(10, 9)))
    assert step(sched) == [(0, 1), (2, 1), (1, 4)]
    assert (repeat.num_cached_tokens, longer.num_cached_tokens) == (4, 8)
    assert (sched.stats.prefix_queried_tokens, sched.stats.prefix_hit_tokens) == (25, 12)
    sched._evict(repeat)  # resumed later: its cache hit again is not a new lookup
    step(sched)
    assert (sched.stats.prefix_queried_tokens, sched.stats.prefix_hit_tokens) == (25, 12)
    assert repeat.num_cached_tokens == 4


def test_a_prompt_that_does_not_fit_drops_its_prefix_references() -> None:
    sched, kv = prefix_scheduler(num_blocks=5)
    shared = tokens(10, 8)
    sched.add(make(0, 0, prompt=shared))
    step(sched)
    blocks = kv.tables[0]
    sched.add(big := make(1, 0, prompt=shared + tokens(50, 12)))  # 3 more blocks: 2 left after the hit
    assert step(sched) == [(0, 1)]
    assert big.num_computed_tokens == 0 and 1 not in kv.tables
    assert [kv.pool.refs(b) for b in blocks] == [2, 2]  # the first sequence and the tree


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_failed_batch_reruns_each_sequence_alone_with_its_whole_length(layout: str) -> None:
    kv = PagedKVCache(TINY, CPU, 64, BLOCK) if layout == "paged" else ContiguousKVCache(TINY, CPU, 200)
    sched = new_scheduler(kv)
    seqs = [make(i, 6, max_tokens=10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        step(sched)
    sched.isolate([p.seq for p in sched.schedule()])
    assert kv.num_sequences == 0
    assert step(sched) == [(0, 9)]  # prompt and output so far, from scratch
    assert seqs[0].status == Status.RUNNING and seqs[0] in sched.running and kv.num_sequences == 1
    if layout == "paged":
        assert len(kv.tables[0]) == 3
    else:
        assert kv.buffers[0].shape[2] == 16


def decoding(sched: Scheduler, *params: dict) -> list[Sequence]:
    """Sequences through their prefill (token 9 sampled), ready to decode."""
    seqs = [Sequence(seq_id=100 + len(sched.running) + i, prompt_ids=[1] * 5,
                     params=SamplingParams(**{"max_tokens": 100, **p}), detokenizer=None, sink=lambda _: None)
            for i, p in enumerate(params)]
    for seq in seqs:
        sched.add(seq)
    assert sched.update(sched.schedule(), [[9]] * len(seqs)) == []
    return seqs


def test_update_appends_and_stops_by_token() -> None:
    kv = PagedKVCache(TINY, CPU, 100, BLOCK)
    sched = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=20,
                      eos_token_ids={7})
    cases = [
        ({}, [3, 7], [9, 3, 7], "stop"),  # the model's end of sequence
        ({"ignore_eos": True}, [7, 7], [9, 7, 7], None),  # ...not with ignore_eos
        ({"stop_token_ids": [4], "ignore_eos": True}, [4], [9, 4], "stop"),  # a request's own stop token
        ({"max_tokens": 3}, [3, 3], [9, 3, 3], "length"),
        ({}, [3] * 15, [9] + [3] * 14, "length"),  # the context ends at 20 tokens: 5 in the prompt
    ]
    for params, tokens, output, reason in cases:
        [seq] = decoding(sched, params)
        for token in tokens:
            if seq.status == Status.FINISHED:
                break
            plan = sched.schedule()
            finished = sched.update(plan, [[token]])
            assert finished == ([seq] if seq.status == Status.FINISHED else [])
        assert (seq.output_ids, seq.finish_reason) == (output, reason), params
        if reason is not None:
            assert seq.seq_id not in kv.tables  # a finished sequence's KV is back in the pool
        else:
            sched.finish(seq, "abort")
    assert kv.pool.num_used == 0


def test_update_appends_several_tokens_up_to_the_first_that_stops() -> None:
    sched = Scheduler(EngineConfig(), PagedKVCache(TINY, CPU, 100, BLOCK), max_model_len=100, eos_token_ids={7})
    a, b = decoding(sched, {}, {"max_tokens": 3})
    plan = sched.schedule()
    assert sched.update(plan, [[3, 7, 5], [4, 4, 4]]) == [a, b]
    assert (a.output_ids, a.finish_reason) == ([9, 3, 7], "stop")  # what followed the stop is dropped
    assert (b.output_ids, b.finish_reason) == ([9, 4, 4], "length")


def test_a_stop_inside_an_accepted_run_keeps_the_tokens_up_to_it_and_their_kv() -> None:
    """Each token appended is put to the output side (text: a stop string), with the reason its id gives; the token
    that ends a sequence is its last, and as an accepted proposal its KV, computed this step, counts; the sample
    after the proposals is computed by the next step."""
    sched = Scheduler(EngineConfig(), PagedKVCache(TINY, CPU, 100, BLOCK), max_model_len=100, eos_token_ids={7})
    a, b, c, d = decoding(sched, {}, {}, {"max_tokens": 4}, {})
    a.draft, b.draft, c.draft, d.draft = [3, 7, 5], [3, 3, 5], [4, 4, 4], [2, 2]
    said = []

    def text(seq: Sequence, token: int, reason: str | None) -> str | None:
        said.append((seq.seq_id - a.seq_id, token, reason))
        return "stop" if seq is b and len(seq.output_ids) == 3 else reason

    plan = sched.schedule()
    assert sched.update(plan, [[3, 7, 5, 6], [3, 3, 5, 6], [4, 4, 4, 4], [2, 8]], text) == [a, b, c]
    assert [(s.output_ids, s.finish_reason) for s in (a, b, c, d)] == [
        ([9, 3, 7], "stop"), ([9, 3, 3], "stop"), ([9, 4, 4, 4], "length"), ([9, 2, 8], None)]
    assert [s.num_tokens - s.num_computed_tokens for s in (a, b, c, d)] == [0, 0, 0, 1]
    assert said == [(0, 3, None), (0, 7, "stop"), (1, 3, None), (1, 3, None), (2, 4, None), (2, 4, None),
                    (2, 4, "length"), (3, 2, None), (3, 8, None)]


def embedding(seq_id: int, prompt: list[int], pooling: str) -> Sequence:
    seq = make(seq_id, 0, prompt=prompt, max_tokens=1)
    seq.pooling = pooling
    return seq


@pytest.mark.parametrize(("pooling", "cached"), [("last", 12), ("mean", 0)])
def test_an_embedding_prefills_in_chunks_never_samples_and_finishes_when_its_prompt_is_done(
        pooling: str, cached: int) -> None:
    """Its blocks go back (to the prefix cache) like any finished sequence's; last pooling takes prefix hits,
    mean needs every position's hidden state so it computes the whole prompt."""
    sched, kv = prefix_scheduler(max_num_batched_tokens=8)
    sched.add(make(0, 0, prompt=tokens(10, 14), max_tokens=2))
    while sched.has_work():
        step(sched)
    assert kv.prefix_cache.num_blocks == 3 and kv.usage() == 0
    seq = embedding(1, tokens(10, 14), pooling)
    sched.add(seq)
    plans = []
    while sched.has_work():
        plan = sched.schedule()
        plans.append([(p.num_tokens, p.samples, p.pools) for p in plan])
        assert sched.update(plan, []) == ([seq] if plans[-1][0][2] else [])
    todo = 14 - cached
    expected = [[(min(8, todo - i), False, i + 8 >= todo)] for i in range(0, todo, 8)]
    assert plans == expected and seq.num_cached_tokens == cached
    assert seq.status == Status.FINISHED and seq.finish_reason == "stop" and seq.output_ids == []
    assert kv.num_sequences == 0 and kv.usage() == 0 and kv.pool.num_used == kv.prefix_cache.num_blocks == 3


def test_a_draft_runs_after_its_decode_token_within_the_budget_and_never_preempts() -> None:
    """A decoding sequence's proposals join its step (the budget cuts them short); only those accepted count as
    computed; where they do not fit in memory the sequence decodes plainly rather than preempt anyone."""
    sched, kv = scheduler(num_blocks=3, max_num_batched_tokens=4)
    a = make(0, 3, max_tokens=20)
    sched.add(a)
    step(sched)  # the prompt: 3 tokens, one block; a samples its first token
    a.draft = [7, 8, 9, 10]
    plan = sched.schedule()
    assert [(p.num_tokens, p.draft) for p in plan] == [(4, [7, 8, 9])]  # 1 + 3 proposals: the budget of 4
    sched.update(plan, [[7, 8, 6]])  # two accepted, then the sample that differed
    assert a.output_ids == [5, 7, 8, 6] and a.num_computed_tokens == 3 + 1 + 2
    a.draft = []
    sched.add(make(1, 4, max_tokens=20))
    assert step(sched) == [(0, 1), (1, 3)]  # a in 2 blocks, b's first 3 tokens in the last one
    assert kv.pool.num_free == 0
    a.draft = [1, 2, 3]  # a needs a third block for them, which only preempting b would free
    plan = sched.schedule()
    assert [(p.seq.seq_id, p.num_tokens, p.draft) for p in plan] == [(0, 1, []), (1, 1, [])]
    assert sched.stats.preemptions == 0



def salted(seq: Sequence, salt: int) -> Sequence:
    seq.cache_salt = salt
    return seq


def admitted(sched: Scheduler, seq: Sequence) -> int:
    """Add seq and step until it runs: the tokens its prompt found cached."""
    sched.add(seq)
    while seq.num_cached_tokens is None:
        step(sched)
    return seq.num_cached_tokens


def test_a_prompt_is_shared_only_under_its_own_salt() -> None:
    """Each tenant's (or adapter's) prefix-cache namespace: its KV, cached as the prompt runs and when it
    finishes, and looked up at admission, is found only by sequences of the same salt."""
    sched, kv = prefix_scheduler(max_num_batched_tokens=7)
    sched.add(first := salted(make(0, 0, prompt=tokens(10, 13), max_tokens=20), 1))
    assert step(sched) == [(0, 7)] and step(sched) == [(0, 6)]  # the prompt, cached chunk by chunk
    assert admitted(sched, salted(make(1, 0, prompt=tokens(10, 12) + [99]), 2)) == 0
    assert admitted(sched, salted(make(2, 0, prompt=tokens(10, 12) + [99]), 1)) == 12
    sched.finish(first, "stop")  # what it computed beyond its prompt is cached under its salt too
    longer = first.tokens(0, 16) + [99]
    assert admitted(sched, salted(make(3, 0, prompt=longer), 2)) == 12  # only the 12 that 1 cached under 2
    assert admitted(sched, salted(make(4, 0, prompt=longer), 1)) == 16


def test_a_step_s_tokens_must_match_its_sampled_sequences() -> None:
    sched, _ = scheduler()
    for i in range(2):
        sched.add(make(i, 4))
    plan = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(plan, [[5]])  # two sequences sampled, one token list: never silently dropped


def test_a_quota_that_runs_out_ends_its_sequence_and_no_other_in_the_step() -> None:
    from tokenmill.engine.request import Owner  # the fair share's owners; here only the quota matters

    class Empty:
        def take(self, tokens: int) -> bool:
            return False

    sched, kv = scheduler()
    broke = Sequence(seq_id=0, prompt_ids=[1] * 4, params=SamplingParams(max_tokens=8), detokenizer=None,
                     sink=lambda _: None, owner=Owner("a", quota=Empty()))
    other = make(1, 4)
    sched.add(broke)
    sched.add(other)
    plan = sched.schedule()
    assert sched.update(plan, [[5], [6]]) == [broke]
    assert broke.finish_reason == "quota" and broke.output_ids == [] and other.output_ids == [6]
    assert kv.num_sequences == 1  # the one that ended gave its KV back


def test_a_finished_sequence_keeps_its_reason_unless_its_last_output_then_failed() -> None:
    sched, _ = scheduler()
    for reason, then, final in (("stop", "abort", "stop"), ("stop", "error", "error"), ("length", "stop", "length")):
        seq = make(0, 4)
        sched.add(seq)
        step(sched)
        sched.finish(seq, reason)
        sched.finish(seq, then)
        assert seq.finish_reason == final and seq.status == Status.FINISHED


def test_without_an_attention_crossover_every_prompt_token_weighs_one() -> None:
    kv = PagedKVCache(TINY, CPU, 100, BLOCK)
    sched = Scheduler(EngineConfig(), kv, max_model_len=4096)
    seq = make(0, 3000)
    seq.num_computed_tokens = 2000
    assert sched._token_weight(seq) == 1.0


def test_admission_waits_for_a_step_that_had_to_preempt_even_where_a_later_sequence_did_not() -> None:
    from tokenmill.engine.request import Owner

    sched, kv = scheduler(num_blocks=4, max_num_seqs=4)
    first, second, third = make(0, 4, max_tokens=20), make(1, 1, max_tokens=20), make(2, 5, max_tokens=20)
    for seq in (first, second, third):
        seq.owner = Owner("a")
        sched.add(seq)
    assert sorted(step(sched)) == [(0, 4), (1, 1), (2, 5)] and kv.pool.num_free == 0
    late = make(3, 1)
    late.owner = Owner("b")  # never served: first in the fair share's order, where there is room
    sched.add(late)
    plan = step(sched)  # first's 5th token needs a block: third (the newest) gives back two; second fits as it is
    assert sched.stats.preemptions == 1 and third.status == Status.WAITING and kv.pool.num_free == 1
    assert sorted(plan) == [(0, 1), (1, 1)] and late.status == Status.WAITING  # memory was short: nobody new this step


def test_a_whole_prompt_that_runs_alone_runs_only_what_its_prefix_hit_leaves() -> None:
    sched, _ = prefix_scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    sched.add(first := make(0, 0, prompt=tokens(10, 14), max_tokens=20))
    assert step(sched) == [(0, 14)]
    sched.add(second := make(1, 0, prompt=tokens(10, 12) + tokens(100, 16)))  # 12 cached, 16 to run: no room
    assert step(sched) == [(1, 16)] and second.num_cached_tokens == 12  # beside first's decode: it runs alone
    assert first.status == Status.RUNNING and len(step(sched)) == 2

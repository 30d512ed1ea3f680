"""The scheduling policy, without a model: admission by free blocks, chunked prefill, preemption and resume."""

from __future__ import annotations

import pytest

from tokenmill.cache.block_pool import BlockPool
from tokenmill.engine.request import Sequence, Status
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling import SamplingParams

BLOCK = 4


class BlockKV:
    """The paged cache's bookkeeping over a real BlockPool, without tensors."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[int]] = {}

    def reserve(self, seq_id: int, num_tokens: int, final_len: int) -> bool:
        table = self.tables.get(seq_id, [])
        need = -(-num_tokens // BLOCK) - len(table)
        if need > self.pool.num_free:
            return False
        self.tables[seq_id] = table + self.pool.allocate(max(need, 0))
        return True

    def free(self, seq_id: int) -> None:
        for b in self.tables.pop(seq_id, []):
            self.pool.free(b)

    def match_prefix(self, seq_id: int, tokens: list[int]) -> int:
        return 0

    def cache(self, seq_id: int, tokens: list[int]) -> None:
        pass


def make(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[1] * prompt_len, params=SamplingParams(), max_tokens=max_tokens,
                    detokenizer=None, sink=lambda _: None)


def run(sched: Scheduler, plan) -> None:
    """What the engine does after a successful step: progress, and a token for whoever reached the end."""
    sched.step_succeeded(plan)
    for item in plan:
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_ids.append(5)


def scheduler(num_blocks: int = 100, **config) -> tuple[Scheduler, BlockKV]:
    kv = BlockKV(num_blocks)
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), kv), kv


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
    assert sched.num_preemptions >= 1
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


@pytest.mark.parametrize("seed", range(3))
def test_block_pool_has_no_leak_or_double_free_under_random_cycles(seed: int) -> None:
    import random

    rng = random.Random(seed)
    pool = BlockPool(64)
    held: dict[int, list[int]] = {}
    for step in range(1000):
        action = rng.random()
        if action < 0.45 and pool.num_free:
            held[step] = pool.allocate(rng.randint(1, min(4, pool.num_free)))
        elif action < 0.75 and held:  # append: grow a holder by a block
            key = rng.choice(list(held))
            if pool.num_free:
                held[key] += pool.allocate(1)
        elif held:
            for b in held.pop(rng.choice(list(held))):
                pool.free(b)
        owned = [b for blocks in held.values() for b in blocks]
        assert len(owned) == len(set(owned)) == pool.num_used
    for blocks in held.values():
        for b in blocks:
            pool.free(b)
    assert pool.num_free == 64
    with pytest.raises(ValueError):
        pool.free(0)


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
    sched.add(first := make(0, 2))
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

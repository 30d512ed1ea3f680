from __future__ import annotations

from tokenmill.engine.request import Sequence, Status
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling import SamplingParams


class FakeKV:
    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    def allocate(self, seq_id: int, capacity: int) -> None:
        assert seq_id not in self.held
        self.held[seq_id] = capacity

    def free(self, seq_id: int) -> None:
        del self.held[seq_id]


def make(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[1] * prompt_len, params=SamplingParams(), max_tokens=max_tokens,
                    detokenizer=None, sink=lambda _: None)


def run(plan) -> None:
    """What the engine does after a step: progress, and a token for whoever reached the end."""
    for item in plan:
        item.seq.num_computed_tokens += item.num_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_ids.append(5)


def test_admits_up_to_max_num_seqs_and_allocates_prompt_plus_max_tokens() -> None:
    kv = FakeKV()
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for i in range(3):
        sched.add(make(i, 10, max_tokens=6))
    plan = sched.schedule()
    assert [(p.seq.seq_id, p.num_tokens) for p in plan] == [(0, 10), (1, 10)]
    assert kv.held == {0: 16, 1: 16}
    assert len(sched.waiting) == 1


def test_long_prompt_is_prefilled_in_chunks_beside_decodes() -> None:
    kv = FakeKV()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    short = make(0, 4)
    sched.add(short)
    run(sched.schedule())
    long = make(1, 40)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 40:
        plan = sched.schedule()
        assert sum(p.num_tokens for p in plan) <= 16
        assert plan[0].seq is short and plan[0].num_tokens == 1  # the decode is never starved
        chunks.append(next(p.num_tokens for p in plan if p.seq is long))
        run(plan)
    assert chunks == [15, 15, 10]
    assert long.output_ids == [5]


def test_finish_frees_memory_for_running_and_waiting() -> None:
    kv = FakeKV()
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), kv)
    a, b = make(0, 4), make(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")
    sched.finish(a, "stop")
    sched.finish(a, "stop")  # idempotent
    assert kv.held == {} and not sched.has_work()
    assert a.status == b.status == Status.FINISHED and a.finish_reason == "stop"

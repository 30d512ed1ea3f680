"""The fair share as scheduling policy, without a model: tenants admitted by the tokens they were served recently
against their weight, the most served preempted first, and a tenant's quota ending its sequence where it runs out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.request import Owner, Sequence, Status
from tokenmill.engine.scheduler import DECODE_TIME_WEIGHT, FAIR_SHARE_HALF_LIFE, RETURN_CREDIT, Scheduler
from tokenmill.sampling import SamplingParams

TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def scheduler(num_blocks: int = 1000, **config) -> Scheduler:
    settings = dict(max_num_seqs=4, max_num_batched_tokens=256, long_prefill_token_threshold=0,
                    long_prefill_chunk=0)
    kv = PagedKVCache(TINY, torch.device("cpu"), num_blocks, 4, False)
    return Scheduler(EngineConfig(**{**settings, **config}), kv, max_model_len=4096)


def make(seq_id: int, owner: Owner, prompt_len: int = 4, max_tokens: int = 1000) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[1] * prompt_len, params=SamplingParams(max_tokens=max_tokens),
                    detokenizer=None, sink=lambda _: None, owner=owner)


def step(sched: Scheduler) -> list[Sequence]:
    plan = sched.schedule()
    sched.update(plan, [[5] for item in plan if item.samples])
    return [item.seq for item in plan]


def a_served(steps: int, max_tokens: int = 1000, **config) -> Scheduler:
    """A scheduler that admitted tenant a's four sequences (ids 0 to 3) and ran them for `steps` steps."""
    sched = scheduler(**config)
    for i in range(4):
        sched.add(make(i, Owner("a"), max_tokens=max_tokens))
    for _ in range(steps):
        step(sched)
    return sched


def test_a_tenant_with_a_backlog_does_not_keep_a_newcomer_waiting() -> None:
    a, b = Owner("a"), Owner("b")
    sched = a_served(20)  # a's four fill the slots and are served for a while
    for i in range(4, 10):
        sched.add(make(i, a))  # a's backlog, queued first
    sched.add(make(10, b))
    sched.finish(sched.running[0], "stop")  # a slot frees
    admitted = [seq for seq in step(sched) if len(seq.output_ids) == 1]  # its prompt ran this step
    assert [seq.owner.name for seq in admitted] == ["b"]


def test_without_the_fair_share_the_queue_is_first_come_first_served() -> None:
    a, b = Owner("a"), Owner("b")
    sched = a_served(20, fair_share=False)
    for i in range(4, 10):
        sched.add(make(i, a))
    sched.add(make(10, b))
    sched.finish(sched.running[0], "stop")
    admitted = [seq for seq in step(sched) if len(seq.output_ids) == 1]
    assert [seq.owner.name for seq in admitted] == ["a"]


def backlogged_shares(sched: Scheduler, owners: list[Owner], steps: int, ids: Iterator[int]) -> dict[str, int]:
    """Tokens each owner generates over `steps` steps while each keeps 8 sequences of 16 tokens waiting."""
    generated = {owner.name: 0 for owner in owners}
    for _ in range(steps):
        for owner in owners:
            while sum(seq.owner is owner for seq in sched.waiting) < 8:
                sched.add(make(next(ids), owner, max_tokens=16))
        plan = sched.schedule()
        for item in plan:
            if item.samples:
                generated[item.seq.owner.name] += 1
        sched.update(plan, [[5] for item in plan if item.samples])
    return generated


def test_backlogged_tenants_share_the_slots_by_their_weights() -> None:
    """Sequences of 16 tokens each, both tenants always waiting: the tokens each is served follow its weight."""
    heavy, light = Owner("heavy", weight=3.0), Owner("light", weight=1.0)
    generated = backlogged_shares(scheduler(max_num_seqs=8), [heavy, light], 2000, iter(range(10**6)))
    share = generated["heavy"] / sum(generated.values())
    assert abs(share - 0.75) < 0.05, generated


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_what_a_tenant_was_served_alone_is_not_held_against_it_when_another_comes(weight: float) -> None:
    """a has the engine to itself for a while; then b, with a backlog too: from then on they share by weight,
    b coming first only for about RETURN_CREDIT tokens, not until a's past service has decayed."""
    a, b = Owner("a"), Owner("b", weight=weight)
    sched, ids = scheduler(max_num_seqs=8), iter(range(10**6))
    backlogged_shares(sched, [a], 4 * FAIR_SHARE_HALF_LIFE // 8, ids)  # a alone: 8 decodes a step
    generated = backlogged_shares(sched, [a, b], FAIR_SHARE_HALF_LIFE // 8, ids)
    assert abs(generated["b"] / sum(generated.values()) - weight / (1 + weight)) < 0.05, generated


def test_what_a_tenant_was_served_before_the_engine_emptied_is_not_held_against_it() -> None:
    """a has the engine alone, its sequences end and the engine empties; then b and, after it, a arrive with
    backlogs: they share alike from the start (a is not placed behind its old service, which nobody else wanted)."""
    a, b = Owner("a"), Owner("b")
    sched, ids = scheduler(max_num_seqs=8), iter(range(10**6))
    backlogged_shares(sched, [a], 4 * FAIR_SHARE_HALF_LIFE // 8, ids)
    for seq in [*sched.running, *sched.waiting]:
        sched.finish(seq, "abort")
    sched.add(make(next(ids), b, max_tokens=16))
    generated = backlogged_shares(sched, [a, b], FAIR_SHARE_HALF_LIFE // 8, ids)
    assert abs(generated["b"] / sum(generated.values()) - 0.5) < 0.05, generated
    assert sched.served["a"] > sched.served["b"]  # the dashboard's shares still count what a was served alone


def test_service_decays_so_an_old_burst_is_forgotten() -> None:
    a = Owner("a")
    sched = scheduler()
    sched.add(make(0, a, prompt_len=100))
    step(sched)
    before = sched.served["a"]
    sched.served["b"] = 0.0
    sched.add(make(1, Owner("b"), prompt_len=FAIR_SHARE_HALF_LIFE // 4))
    while sched.waiting or any(not s.decoding for s in sched.running):
        step(sched)
    assert sched.served["a"] < before * 0.95  # what b was served since halved a little of what a had
    assert {entry["tenant"]: entry["running"] for entry in sched.shares()} == {"a": 1, "b": 1}
    assert abs(sum(entry["share"] for entry in sched.shares()) - 1) < 1e-3


def run_until_preempted(sched: Scheduler) -> None:
    for _ in range(40):  # decodes grow until blocks run out
        step(sched)
        if sched.stats.preemptions:
            return
    raise AssertionError("nobody was preempted")


def test_memory_pressure_preempts_the_most_served_tenant_first() -> None:
    a, b = Owner("a"), Owner("b")
    sched = scheduler(num_blocks=8, max_num_seqs=8)
    a_seqs = [make(i, a, prompt_len=4) for i in range(3)]
    for seq in a_seqs:
        sched.add(seq)
    step(sched)
    sched.add(b_seq := make(9, b, prompt_len=4))
    step(sched)
    sched.standing["a"] = 1e6  # a has been served far more
    run_until_preempted(sched)
    assert b_seq.status == Status.RUNNING  # though the newest
    assert any(seq.status == Status.WAITING for seq in a_seqs)


def test_the_most_served_is_reckoned_against_its_weight() -> None:
    heavy, light = Owner("heavy", weight=4.0), Owner("light")
    sched = scheduler(num_blocks=8, max_num_seqs=8)
    sched.add(light_seq := make(0, light, prompt_len=4))
    step(sched)
    heavy_seqs = [make(i, heavy, prompt_len=4) for i in range(1, 4)]
    for seq in heavy_seqs:
        sched.add(seq)
    step(sched)
    sched.standing.update(heavy=1000.0, light=400.0)  # 250 against its weight of 4: light was served more
    run_until_preempted(sched)
    assert light_seq.status == Status.WAITING  # though the oldest
    assert any(seq.status == Status.RUNNING for seq in heavy_seqs)


def test_a_quota_that_runs_out_ends_the_sequence_without_the_token() -> None:
    class Quota:
        def __init__(self, left: int) -> None:
            self.left = left

        def take(self, tokens: int) -> bool:
            if tokens > self.left:
                return False
            self.left -= tokens
            return True

    sched = scheduler()
    seq = make(0, Owner("a", quota=Quota(3)))
    sched.add(seq)
    for _ in range(6):
        step(sched)
    assert seq.output_ids == [5, 5, 5] and seq.finish_reason == "quota" and seq.status == Status.FINISHED
    assert sched.kv.pool.num_used == 0  # its blocks came back


def test_a_newcomer_s_prompt_runs_in_a_step_of_its_own_once_and_then_with_everyone() -> None:
    sched = a_served(10, max_num_seqs=8)
    newcomer = make(9, Owner("b"))
    sched.add(newcomer)
    assert step(sched) == [newcomer]  # a's decodes wait this one step
    assert sorted(seq.seq_id for seq in step(sched)) == [0, 1, 2, 3, 9]


def test_a_tenant_returning_to_an_engine_long_busy_still_gets_a_step_of_its_own() -> None:
    """b is placed level with a, whose service is far past RETURN_CREDIT, less that credit: still served so much
    less that its prompt runs alone, once."""
    # room for every token: nobody is preempted
    sched = a_served(FAIR_SHARE_HALF_LIFE // 4, max_tokens=10**4, num_blocks=4000, max_num_seqs=8)
    assert sched.served["a"] > 8 * RETURN_CREDIT
    newcomer = make(9, Owner("b"))
    sched.add(newcomer)
    assert sched.standing["a"] - sched.standing["b"] == pytest.approx(RETURN_CREDIT)
    assert step(sched) == [newcomer]
    assert len(step(sched)) == 5


def test_owners_served_alike_share_their_steps() -> None:
    a, b = Owner("a"), Owner("b")
    sched = scheduler(max_num_seqs=8)
    for i in range(2):
        sched.add(make(i, a))
        sched.add(make(10 + i, b))
    for _ in range(10):
        step(sched)
    late = make(20, b)
    sched.add(late)
    assert len(step(sched)) == 5 and late in sched.running  # b was served as much as a: no step of its own


@pytest.mark.parametrize("a_standing", [1028.0, 1000.0])
def test_a_newcomer_served_about_as_much_as_the_others_shares_their_step(a_standing: float) -> None:
    """b comes back 100 or 128 tokens behind a: no more than half of RETURN_CREDIT, so its prompt runs beside a's
    decodes, not in a step of its own."""
    sched = a_served(3, max_num_seqs=8)
    sched.standing.update(a=a_standing, b=900.0)
    sched.add(make(9, Owner("b")))
    assert sched.standing["b"] == 900.0  # already above where _place would level it
    assert len(step(sched)) == 5


def test_a_returning_tenant_served_more_than_the_others_keeps_its_standing() -> None:
    a, b = Owner("a"), Owner("b")
    sched = a_served(1, max_num_seqs=8)
    sched.standing.update(a=500.0, b=5000.0)  # b was served much more, and has nothing in the engine now
    sched.weights["b"] = 1.0
    sched.add(late := make(9, b))
    assert sched.standing["b"] == 5000.0  # not forgiven down to a's level
    for i in range(10, 13):
        sched.add(make(i, a))
    assert sched._admission_order()[-1] is late  # a's later requests come first


def shared_steps(decode_ms: float, **config) -> Scheduler:
    """A scheduler whose decodes were timed at decode_ms each, keeping shared steps to 10 ms."""
    sched = scheduler(max_num_seqs=16, shared_step_ms=10.0, **config)
    sched.decode_seconds = decode_ms / 1000
    return sched


def test_while_tenants_share_a_step_decodes_what_fits_in_its_time_the_least_served_first() -> None:
    a, b = Owner("a"), Owner("b")
    sched = shared_steps(2.5)  # 4 decodes fit in 10 ms
    a_seqs = [make(i, a) for i in range(10)]
    for seq in a_seqs:
        sched.add(seq)
    for _ in range(3):
        assert len(step(sched)) == 10  # a alone, never served b: every decode, every step
    late = make(20, b)
    sched.add(late)
    assert step(sched) == [late]  # its prompt in a step of its own
    runs = {seq.seq_id: 0 for seq in a_seqs}
    for _ in range(10):
        ran = step(sched)
        assert len(ran) == 4 and late in ran  # b's decode every step, the least served
        for seq in ran:
            if seq is not late:
                runs[seq.seq_id] += 1
    assert sorted(runs.values()) == [3] * 10  # a's decodes in turns: 30 decodes, 3 each


def test_a_decode_longer_than_the_shared_step_still_runs_one_a_step() -> None:
    a, b = Owner("a"), Owner("b")
    sched = shared_steps(25.0)  # not even one decode fits in 10 ms
    for i in range(6):
        sched.add(make(i, a))
    sched.add(make(9, b))
    step(sched)
    step(sched)
    assert [len(step(sched)) for _ in range(4)] == [1] * 4


def test_a_tenant_waiting_for_a_slot_keeps_the_steps_short_before_it_was_ever_served() -> None:
    a, b = Owner("a"), Owner("b")
    sched = scheduler(max_num_seqs=10, shared_step_ms=10.0)
    for i in range(10):
        sched.add(make(i, a))
    assert len(step(sched)) == 10  # the prompts
    sched.decode_seconds = 0.0025  # 4 decodes fit in 10 ms
    assert len(step(sched)) == 10  # a alone: every decode
    sched.add(waiting := make(20, b))  # no slot for it: it waits, never served
    assert len(step(sched)) == 4 and waiting in sched.waiting


def test_a_tenant_served_recently_keeps_the_steps_short_between_its_requests() -> None:
    a, b = Owner("a"), Owner("b")
    sched = shared_steps(2.5)
    for i in range(10):
        sched.add(make(i, a))
    first = make(20, b, max_tokens=2)
    sched.add(first)
    while first.status != Status.FINISHED:
        step(sched)
    assert not any(seq.owner is b for seq in (*sched.running, *sched.waiting))
    assert len(step(sched)) == 4  # b has no request now, but was served lately: its next waits a short step


def test_without_the_fair_share_or_a_time_every_decode_runs_every_step() -> None:
    a, b = Owner("a"), Owner("b")
    for sched in (shared_steps(2.5, fair_share=False), scheduler(max_num_seqs=16)):
        for i in range(10):
            sched.add(make(i, a))
        sched.add(make(20, b))
        step(sched)
        sched.decode_seconds = 0.0025
        assert [len(step(sched)) for _ in range(3)] == [11] * 3


def test_a_decode_s_time_is_the_running_mean_of_decode_steps_alone() -> None:
    sched = scheduler()
    a = Owner("a")
    seqs = [make(i, a) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()  # the prompts
    sched.time_decodes(plan, 1.0)
    assert sched.decode_seconds is None  # a step with prompts in it is not a decode's time
    sched.update(plan, [[5], [5]])
    plan = sched.schedule()
    sched.time_decodes(plan, 0.010)  # two decodes in 10 ms
    assert sched.decode_seconds == pytest.approx(0.005)
    sched.time_decodes(plan, 0.020)
    assert sched.decode_seconds == pytest.approx(0.005 + DECODE_TIME_WEIGHT * (0.010 - 0.005))


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_shared_step_time_that_is_no_time_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="^--shared-step-ms .*: 0 \\(off\\) or a positive number of ms$"):
        EngineConfig(shared_step_ms=value).check()
    EngineConfig(shared_step_ms=25.0).check()


def test_the_dashboard_s_shares_name_each_tenant_with_work_or_recent_service() -> None:
    zed, amy = Owner("zed", weight=2.0), Owner("amy")
    sched = scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make(i, zed))
    sched.add(make(3, amy))
    step(sched)  # zed's first and amy's run (turns), zed's other two wait
    sched.served = {"zed": 2.0, "max": 1.0}  # max was served lately and has nothing in the engine now
    sched.weights["max"] = 3.0
    assert sched.shares() == [
        {"tenant": "amy", "running": 1, "waiting": 0, "weight": 1.0, "share": 0.0},
        {"tenant": "max", "running": 0, "waiting": 0, "weight": 3.0, "share": 0.3333},
        {"tenant": "zed", "running": 1, "waiting": 2, "weight": 2.0, "share": 0.6667},
    ]


def test_a_step_counts_each_tenant_s_tokens_and_nothing_for_a_server_without_tenants() -> None:
    sched = scheduler()
    sched.add(make(0, Owner("a"), prompt_len=100))
    step(sched)
    assert sched.served == sched.standing == {"a": 100.0}
    nameless = scheduler()
    nameless.add(make(0, Owner(), prompt_len=100))
    for _ in range(3):
        step(nameless)
    assert nameless.served == {} and nameless.shares() == [
        {"tenant": "", "running": 1, "waiting": 0, "weight": 1.0, "share": 0.0}]


def test_the_weights_of_tenants_long_gone_are_forgotten() -> None:
    sched = scheduler(max_num_seqs=8)
    for i in range(40):
        seq = make(i, Owner(f"t{i}", weight=2.0))
        sched.add(seq)
        step(sched)
        sched.finish(seq, "stop")
    assert len(sched.weights) > 20
    stayer = Owner("stayer")
    for i in range(8):
        sched.add(make(100 + i, stayer, max_tokens=10**6))
    for _ in range(14 * FAIR_SHARE_HALF_LIFE // 8):  # 14 half-lives: the others' few tokens decay away
        step(sched)
    assert sched.weights == {"stayer": 1.0} and [entry["tenant"] for entry in sched.shares()] == ["stayer"]


def test_without_the_fair_share_a_newcomer_s_prompt_runs_beside_everyone_s_decodes() -> None:
    sched = a_served(10, max_num_seqs=8, fair_share=False)
    sched.add(make(9, Owner("b")))
    assert len(step(sched)) == 5


def test_admission_takes_turns_by_the_service_each_tenant_s_admitted_prompts_will_add() -> None:
    """Both level, heavy (weight 2) and light with prompts of 10: each admitted prompt adds 10 tokens against the
    weight, so heavy comes twice as often."""
    heavy, light = Owner("heavy", weight=2.0), Owner("light")
    sched = scheduler()
    for i in range(4):
        sched.add(make(i, heavy, prompt_len=10))
        sched.add(make(10 + i, light, prompt_len=10))
    order = [seq.owner.name for seq in sched._admission_order()]
    assert order[:6] == ["heavy", "light", "heavy", "heavy", "light", "heavy"]


def test_a_weight_changed_by_a_reload_counts_from_the_tenant_s_next_request() -> None:
    a, b = Owner("a"), Owner("b")
    sched = scheduler(max_num_seqs=8)
    sched.add(make(0, a))
    sched.add(make(1, b))
    step(sched)
    sched.standing.update(a=1000.0, b=1500.0)  # b served more, at its weight of 1
    sched.add(make(2, a))
    sched.add(make(3, Owner("b", weight=2.0)))  # the keys file now gives b a weight of 2: 750 against it
    assert [seq.owner.name for seq in sched._admission_order()] == ["b", "a"]

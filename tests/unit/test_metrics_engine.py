"""The engine's Prometheus metrics (engine/metrics.py) as pure logic: histogram buckets with Prometheus's `le`
semantics, the counters and gauges a step feeds, and the dashboard's snapshot of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine import metrics as metrics_module
from tokenmill.engine.metrics import EngineMetrics, StepHistogram
from tokenmill.engine.scheduler import SchedulerStats

TTFT = "tokenmill:time_to_first_token_seconds"
ITL = "tokenmill:inter_token_latency_seconds"


def buckets(m: EngineMetrics, name: str) -> dict[str, float]:
    """The cumulative count of each `le` bucket of a histogram, as /metrics exports it."""
    samples = (s for family in text_string_to_metric_families(m.render().decode()) for s in family.samples)
    return {s.labels["le"]: s.value for s in samples if s.name == f"{name}_bucket"}


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The metrics module's clock, frozen at 1000.5 s (set `now.t` to move it)."""
    clock = SimpleNamespace(t=1000.5)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda: clock.t))
    return clock


def test_a_value_equal_to_a_bucket_bound_is_counted_in_that_bucket() -> None:
    """Prometheus's buckets are `le`, less than or equal: 0.1 s is in le="0.1", not only in the next one up."""
    m = EngineMetrics()
    m.observe_tokens([0.1, 0.01], [1.0])
    ttft = buckets(m, TTFT)
    assert (ttft["0.01"], ttft["0.075"], ttft["0.1"], ttft["+Inf"]) == (1, 1, 2, 2)
    assert buckets(m, ITL)["0.75"] == 0 and buckets(m, ITL)["1.0"] == 1


def test_histogram_buckets_are_cumulative_with_a_sum_and_a_count() -> None:
    registry = CollectorRegistry()
    histogram = StepHistogram("h_seconds", "A test histogram.", (1.0, 2.0), registry)
    histogram.observe([0.5, 1.5, 1.7, 3.0])
    histogram.observe([])
    histogram.observe([2.5])
    counts = {le: registry.get_sample_value("h_seconds_bucket", {"le": le}) for le in ("1.0", "2.0", "+Inf")}
    assert counts == {"1.0": 1, "2.0": 3, "+Inf": 5}
    assert registry.get_sample_value("h_seconds_count") == 5
    assert registry.get_sample_value("h_seconds_sum") == pytest.approx(9.2)


def test_metrics_are_named_and_described_as_vllm_names_them() -> None:
    """Dashboards and gateways read these names (vLLM's, `vllm:` made `tokenmill:`) and show the help."""
    described = {family.name: (family.type, family.documentation)
                 for family in text_string_to_metric_families(EngineMetrics().render().decode())
                 if not family.name.endswith("_created")}  # a counter's creation time, prometheus_client's own
    assert described == {
        "tokenmill:num_requests_running": ("gauge", "Sequences in the running batch."),
        "tokenmill:num_requests_waiting": ("gauge", "Sequences waiting to be admitted."),
        "tokenmill:kv_cache_usage_perc": ("gauge", "Share of KV memory held by live requests (0 to 1)."),
        "vllm:num_requests_running": ("gauge", "As tokenmill:num_requests_running."),
        "vllm:num_requests_waiting": ("gauge", "As tokenmill:num_requests_waiting."),
        "vllm:kv_cache_usage_perc": ("gauge", "As tokenmill:kv_cache_usage_perc."),
        "vllm:gpu_cache_usage_perc": ("gauge", "As tokenmill:kv_cache_usage_perc (vLLM's older name)."),
        "tokenmill:num_preemptions": ("counter", "Sequences preempted for KV memory."),
        "tokenmill:prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
        "tokenmill:prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache."),
        "tokenmill:prompt_tokens": ("counter", "Prompt tokens of finished requests."),
        "tokenmill:generation_tokens": ("counter", "Tokens generated."),
        TTFT: ("histogram", "Arrival to first token."),
        ITL: ("histogram", "Time between successive tokens."),
        "tokenmill:spec_decode_num_drafts": ("counter", "Speculative proposals checked (one a sequence and step)."),
        "tokenmill:spec_decode_num_draft_tokens": ("counter", "Tokens proposed."),
        "tokenmill:spec_decode_num_accepted_tokens": ("counter", "Proposed tokens accepted."),
        "tokenmill:spec_decode_num_accepted_tokens_per_pos": (
            "counter", "Proposed tokens accepted, by their position in the proposal."),
    }


class FakeScheduler:
    """What EngineMetrics reads of a Scheduler: its queues, and the stats counted since they were last taken."""

    def __init__(self, running: int = 0, waiting: int = 0) -> None:
        self.running, self.waiting = [object()] * running, [object()] * waiting
        self.stats = SchedulerStats()

    def take_stats(self) -> SchedulerStats:
        stats, self.stats = self.stats, SchedulerStats()
        return stats


def test_gauges_show_what_runs_waits_and_holds_kv_memory() -> None:
    m = EngineMetrics()
    m.set_gauges(FakeScheduler(running=3, waiting=1), SimpleNamespace(usage=lambda: 0.25))
    assert m.value("tokenmill:num_requests_running") == 3
    assert m.value("tokenmill:num_requests_waiting") == 1
    assert m.value("tokenmill:kv_cache_usage_perc") == 0.25
    # vLLM's names, which the Gateway API inference extension reads, carry the same values
    assert (m.value("vllm:num_requests_running"), m.value("vllm:num_requests_waiting"),
            m.value("vllm:kv_cache_usage_perc"), m.value("vllm:gpu_cache_usage_perc")) == (3, 1, 0.25, 0.25)


def test_a_step_counts_the_schedulers_stats_once_and_its_prompt_tokens_per_second(now: SimpleNamespace) -> None:
    m = EngineMetrics()
    scheduler = FakeScheduler()
    scheduler.stats = SchedulerStats(preemptions=2, prefix_queried_tokens=10, prefix_hit_tokens=4)
    m.count(scheduler, prompt_tokens=7)
    m.count(scheduler, prompt_tokens=5)  # nothing new from the scheduler
    assert m.value("tokenmill:num_preemptions_total") == 2
    assert m.value("tokenmill:prefix_cache_queries_total") == 10
    assert m.value("tokenmill:prefix_cache_hits_total") == 4
    now.t = 1001.5
    assert m.rates.series(now.t) == ([0] * 299 + [0], [0] * 299 + [12])


def test_speculative_steps_count_proposals_and_accepted_tokens_by_position() -> None:
    """A sequence that proposed nothing this step is no draft; the kept tokens end with one the model chose."""
    m = EngineMetrics()
    m.count_drafts([[1, 2, 3], [], [4, 5]], [[1, 2, 9], [7], [4, 8]])
    assert m.value("tokenmill:spec_decode_num_drafts_total") == 2
    assert m.value("tokenmill:spec_decode_num_draft_tokens_total") == 5
    assert m.value("tokenmill:spec_decode_num_accepted_tokens_total") == 3
    per_pos = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"
    assert [m.value(per_pos, {"position": p}) for p in ("0", "1", "2")] == [2, 1, 0]
    with pytest.raises(ValueError):
        m.count_drafts([[1]], [[1], [2]])


def test_a_sample_not_yet_seen_reads_zero() -> None:
    assert EngineMetrics().value("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) == 0.0


def test_recent_latencies_keep_a_window_of_the_latest() -> None:
    m = EngineMetrics()
    m.observe_tokens([5.0] * 500 + [1.0] * 1000, [5.0] * 1000 + [2.0] * 5000)
    latency = m.snapshot(speculative=False)["latency"]
    assert latency["ttft_s"] == {"count": 1000, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    assert latency["itl_s"] == {"count": 5000, "p50": 2.0, "p90": 2.0, "p99": 2.0}


def test_rates_hold_the_last_five_minutes_and_no_more() -> None:
    """A server up for days keeps 300 one-second buckets, not one per second it has run."""
    rates = metrics_module.RateHistory()
    for second in range(400):
        rates.add(second + 0.5, generated=1)
    generated, prompt = rates.series(400.0)
    assert len(generated) == len(prompt) == 300 and sum(generated) == 300
    assert len(rates._buckets) == 300


def test_the_dashboard_snapshot_of_an_idle_server(now: SimpleNamespace) -> None:
    stats = EngineMetrics().snapshot(speculative=True)
    none = {"count": 0, "p50": None, "p90": None, "p99": None}
    assert stats == {
        "totals": {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0},
        "prefix_cache": {"queried_tokens": 0, "hit_tokens": 0, "hit_rate": None},
        "throughput": {"interval_s": 1, "generation_tokens": [0] * 300, "prompt_tokens": [0] * 300},
        "latency": {"ttft_s": none, "itl_s": none},
        "speculative": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None,
                        "mean_accepted_length": None},
    }


def test_the_dashboard_snapshot_totals_rates_and_speculation(now: SimpleNamespace) -> None:
    m = EngineMetrics()
    m.prompt_tokens.inc(30)
    m.generation_tokens.inc(12)
    m.preemptions.inc(1)
    m.prefix_queries.inc(40)
    m.prefix_hits.inc(10)
    m.rates.add(999.2, generated=12, prompt=30)
    m.count_drafts([[1, 2, 3, 4], [5, 6]], [[1, 2, 0], [5, 6, 0]])
    m.observe_tokens([0.5], [0.1, 0.2])
    stats = m.snapshot(speculative=True)
    assert stats["totals"] == {"prompt_tokens": 30, "generation_tokens": 12, "preemptions": 1}
    assert all(type(v) is int for v in stats["totals"].values())
    assert stats["prefix_cache"] == {"queried_tokens": 40, "hit_tokens": 10, "hit_rate": 0.25}
    assert all(type(v) is int for v in list(stats["prefix_cache"].values())[:2])
    assert stats["throughput"]["generation_tokens"][-1] == 12 and stats["throughput"]["prompt_tokens"][-1] == 30
    assert stats["latency"]["ttft_s"]["p50"] == 0.5 and stats["latency"]["itl_s"]["count"] == 2
    assert stats["speculative"] == {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 4, "acceptance_rate": 4 / 6,
                                    "mean_accepted_length": 2.0}
    assert all(type(v) is int for v in list(stats["speculative"].values())[:3])
    assert m.snapshot(speculative=False)["speculative"] is None

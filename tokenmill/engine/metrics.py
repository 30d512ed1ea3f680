"""Prometheus metrics, named like vLLM's (`vllm:` becomes `tokenmill:`). One registry per engine, no globals."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.scheduler import Scheduler

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class _KVUsage(Protocol):
    def usage(self) -> float: ...


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tokenmill:num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Sequences waiting to be admitted.", registry=r)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc",
                              "Share of KV memory held by live requests (0 to 1).", registry=r)
        self.preemptions = Counter("tokenmill:num_preemptions", "Sequences preempted for KV memory.", registry=r)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between successive tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("tokenmill:spec_decode_num_drafts", "Speculative proposals checked (one a "
                                   "sequence and step).", registry=r)
        self.spec_draft_tokens = Counter("tokenmill:spec_decode_num_draft_tokens", "Tokens proposed.", registry=r)
        self.spec_accepted_tokens = Counter("tokenmill:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by their position in the proposal.",
                                             ["position"], registry=r)

    def set_gauges(self, scheduler: Scheduler, kv: _KVUsage) -> None:
        """Once per loop turn: what runs, waits and holds KV memory now."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(kv.usage())

    def count(self, scheduler: Scheduler) -> None:
        """Once per step: what the scheduler counted since the last step."""
        stats = scheduler.take_stats()
        self.preemptions.inc(stats.preemptions)
        self.prefix_queries.inc(stats.prefix_queried_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens)

    def count_drafts(self, drafts: list[list[int]], tokens: list[list[int]]) -> None:
        """A speculative step: each sequence's proposal and the tokens it kept (its accepted proposals, then one)."""
        for draft, kept in zip(drafts, tokens, strict=True):
            if not draft:
                continue
            accepted = len(kept) - 1
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(len(draft))
            self.spec_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.spec_accepted_per_pos.labels(position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics, named like vLLM's (`vllm:` becomes `tokenmill:`), one registry per engine, no globals; and the
dashboard's view of the same counters: recent latencies and tokens per second over the last minutes."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tokenmill.engine.scheduler import Scheduler

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class _KVUsage(Protocol):
    def usage(self) -> float: ...


class StepHistogram:
    """A Prometheus histogram the engine thread fills a step at a time, its counts in plain lists: prometheus_client's
    Histogram takes two locks per value (at 256 streams, 512 a step). A scrape reads the counts as a glance, like the
    gauges."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, values: list[float]) -> None:
        for value in values:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        bounds = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        yield HistogramMetricFamily(self.name, self.documentation, sum_value=self.sum,
                                    buckets=list(zip(bounds, itertools.accumulate(self.counts), strict=True)))


class RateHistory:
    """Tokens counted into one-second buckets, the last `seconds` of them kept (written by the engine thread, read by
    the API's)."""

    def __init__(self, seconds: int = 300) -> None:
        self.seconds = seconds
        self._buckets: deque[list[int]] = deque(maxlen=seconds)  # [second, generated, prompt]
        self._lock = threading.Lock()

    def add(self, now: float, generated: int = 0, prompt: int = 0) -> None:
        second = int(now)
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += generated
                self._buckets[-1][2] += prompt
            else:
                self._buckets.append([second, generated, prompt])

    def series(self, now: float) -> tuple[list[int], list[int]]:
        """Generated and prompt tokens of each whole second of the last `seconds`, oldest first, zeros included."""
        last = int(now) - 1  # the current second is not over yet
        with self._lock:
            counts = {second: (generated, prompt) for second, generated, prompt in self._buckets}
        seconds = range(last - self.seconds + 1, last + 1)
        return [counts.get(s, (0, 0))[0] for s in seconds], [counts.get(s, (0, 0))[1] for s in seconds]


def percentiles(samples: deque[float]) -> dict[str, float | int | None]:
    """p50, p90 and p99 of the samples (nearest rank), and how many there are."""
    values = sorted(list(samples))
    ranks = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
    if not values:
        return {"count": 0, **{name: None for name in ranks}}
    return {"count": len(values), **{name: values[max(0, math.ceil(q * len(values)) - 1)]
                                     for name, q in ranks.items()}}


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tokenmill:num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Sequences waiting to be admitted.", registry=r)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc",
                              "Share of KV memory held by live requests (0 to 1).", registry=r)
        # The same gauges under vLLM's names, which the Kubernetes Gateway API inference extension (and gateways
        # that follow it) read to pick an endpoint: docs/features/scaling-out.md.
        self.vllm_running = Gauge("vllm:num_requests_running", "As tokenmill:num_requests_running.", registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "As tokenmill:num_requests_waiting.", registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "As tokenmill:kv_cache_usage_perc.", registry=r)
        self.vllm_gpu_kv_usage = Gauge("vllm:gpu_cache_usage_perc", "As tokenmill:kv_cache_usage_perc (vLLM's "
                                       "older name).", registry=r)
        self.preemptions = Counter("tokenmill:num_preemptions", "Sequences preempted for KV memory.", registry=r)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = StepHistogram("tokenmill:time_to_first_token_seconds", "Arrival to first token.",
                                  _LATENCY_BUCKETS, r)
        self.itl = StepHistogram("tokenmill:inter_token_latency_seconds", "Time between successive tokens.",
                                 _LATENCY_BUCKETS, r)
        self.spec_drafts = Counter("tokenmill:spec_decode_num_drafts", "Speculative proposals checked (one a "
                                   "sequence and step).", registry=r)
        self.spec_draft_tokens = Counter("tokenmill:spec_decode_num_draft_tokens", "Tokens proposed.", registry=r)
        self.spec_accepted_tokens = Counter("tokenmill:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by their position in the proposal.",
                                             ["position"], registry=r)
        # For the dashboard: the latest latencies (percentiles of a window, not of all time) and tokens per second.
        self.recent_ttft: deque[float] = deque(maxlen=1000)
        self.recent_itl: deque[float] = deque(maxlen=5000)
        self.rates = RateHistory()

    def observe_tokens(self, first: list[float], next_: list[float]) -> None:
        """A step's latencies: of its sequences' first tokens (since arrival) and of the others (since the last)."""
        self.ttft.observe(first)
        self.recent_ttft.extend(first)
        self.itl.observe(next_)
        self.recent_itl.extend(next_)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (a counter's `_total`), 0 where it has none yet."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def set_gauges(self, scheduler: Scheduler, kv: _KVUsage) -> None:
        """Once per loop turn: what runs, waits and holds KV memory now."""
        running, waiting, usage = len(scheduler.running), len(scheduler.waiting), kv.usage()
        for gauge, value in ((self.running, running), (self.waiting, waiting), (self.kv_usage, usage),
                             (self.vllm_running, running), (self.vllm_waiting, waiting),
                             (self.vllm_kv_usage, usage), (self.vllm_gpu_kv_usage, usage)):
            gauge.set(value)

    def count(self, scheduler: Scheduler, prompt_tokens: int) -> None:
        """Once per step: what the scheduler counted since the last step, and the prompt tokens the step runs."""
        stats = scheduler.take_stats()
        self.rates.add(time.time(), prompt=prompt_tokens)
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

    def snapshot(self, speculative: bool) -> dict[str, object]:
        """The dashboard's counters (GET /stats): totals, rates of the last minutes, recent latency percentiles."""
        v = self.value
        queried, hit = v("tokenmill:prefix_cache_queries_total"), v("tokenmill:prefix_cache_hits_total")
        generated, prompt = self.rates.series(time.time())
        stats: dict[str, object] = {
            "totals": {"prompt_tokens": int(v("tokenmill:prompt_tokens_total")),
                       "generation_tokens": int(v("tokenmill:generation_tokens_total")),
                       "preemptions": int(v("tokenmill:num_preemptions_total"))},
            "prefix_cache": {"queried_tokens": int(queried), "hit_tokens": int(hit),
                             "hit_rate": hit / queried if queried else None},
            "throughput": {"interval_s": 1, "generation_tokens": generated, "prompt_tokens": prompt},
            "latency": {"ttft_s": percentiles(self.recent_ttft), "itl_s": percentiles(self.recent_itl)},
            "speculative": None,
        }
        if speculative:
            drafts = v("tokenmill:spec_decode_num_drafts_total")
            proposed = v("tokenmill:spec_decode_num_draft_tokens_total")
            accepted = v("tokenmill:spec_decode_num_accepted_tokens_total")
            stats["speculative"] = {"drafts": int(drafts), "draft_tokens": int(proposed),
                                    "accepted_tokens": int(accepted),
                                    "acceptance_rate": accepted / proposed if proposed else None,
                                    "mean_accepted_length": accepted / drafts if drafts else None}
        return stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

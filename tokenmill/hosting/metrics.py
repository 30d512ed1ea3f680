"""/metrics for every hosted model: each engine's registry, its samples labelled model_name as vLLM labels them,
the pool's own gauges (loaded, memory), and each tenant's usage by model (labelled by the tenant's name, never a
key; since the usage store began, so they survive a restart)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from tokenmill.hosting.pool import ModelPool
from tokenmill.tenants.usage import UsageLedger

_USAGE = (("prompt_tokens", "Prompt tokens served, by tenant and model."),
          ("completion_tokens", "Completion tokens generated, by tenant and model."),
          ("cached_tokens", "Prompt tokens served from the prefix cache, by tenant and model."),
          ("requests", "Requests served, by tenant and model."))


class _PoolCollector:
    def __init__(self, pool: ModelPool, ledger: UsageLedger | None) -> None:
        self.pool = pool
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for hosted in self.pool.models:
            if hosted.engine is None:
                continue
            for family in hosted.engine.metrics.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples += [s._replace(labels={**s.labels, "model_name": hosted.name}) for s in family.samples]
        yield from merged.values()
        loaded = Metric("tokenmill:model_loaded", "1 while the model is loaded.", "gauge")
        memory = Metric("tokenmill:model_memory_bytes", "Resident memory the model took when it last loaded.", "gauge")
        loads = Metric("tokenmill:model_loads", "Times the model was loaded.", "counter")
        for hosted in self.pool.models:
            labels = {"model_name": hosted.name}
            loaded.add_sample("tokenmill:model_loaded", labels, float(hosted.state == "loaded"))
            memory.add_sample("tokenmill:model_memory_bytes", labels, float(hosted.footprint))
            loads.add_sample("tokenmill:model_loads_total", labels, float(hosted.loads))
        budget = Metric("tokenmill:models_memory_budget_bytes", "Memory the loaded models may take together.",
                        "gauge")
        budget.add_sample("tokenmill:models_memory_budget_bytes", {}, float(self.pool.max_memory))
        yield from (loaded, memory, loads, budget)
        if self.ledger is not None:
            yield from self._usage(self.ledger)

    @staticmethod
    def _usage(ledger: UsageLedger) -> Iterator[Metric]:
        totals = ledger.totals()
        for field, documentation in _USAGE:
            name = f"tokenmill:tenant_{field}"
            metric = Metric(name, documentation, "counter")
            for (tenant, model), usage in sorted(totals.items()):
                metric.add_sample(f"{name}_total", {"tenant": tenant or "anonymous", "model_name": model},
                                  float(getattr(usage, field)))
            yield metric


def render_metrics(pool: ModelPool, ledger: UsageLedger | None = None) -> bytes:
    return generate_latest(_PoolCollector(pool, ledger))

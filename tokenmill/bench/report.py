"""The report of a run: its figures, the terminal table, the JSON file, the PNG plot, and two reports side by side.

A report is one plain dict, the same in memory and in the JSON file: {"config", "summary", "requests"}. Latencies
are in milliseconds; percentiles interpolate between samples (numpy's default, as in `vllm bench serve`). ITL pools
the gaps of all requests; the other latencies have one sample per request.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from tokenmill.bench import workloads


@dataclass
class RequestRecord:
    """One request's times, in seconds since the start of the run, and its outcome."""

    conversation: int
    turn: int  # 1-based
    start: float
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrivals of the chunks with content
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server says it took from its prefix cache
    completion_tokens: int | None = None
    usage_from_server: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.ok and self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok and self.end is not None else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)] if self.ok else []

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or (self.completion_tokens or 0) < 2:
            return None
        return (self.e2e - self.ttft) / ((self.completion_tokens or 0) - 1)


STATS = ("mean", "p50", "p90", "p99")
LATENCIES = {"ttft_ms": "TTFT", "itl_ms": "ITL", "tpot_ms": "TPOT", "e2e_ms": "E2E latency"}
THROUGHPUTS = {"request_throughput": "request throughput (req/s)", "output_throughput": "output throughput (tok/s)",
               "total_token_throughput": "total throughput (tok/s)"}


def _stats(seconds: Sequence[float | None]) -> dict[str, float | None]:
    ms = np.array([s for s in seconds if s is not None]) * 1000.0
    if not ms.size:
        return dict.fromkeys(STATS)
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}}


def _prefill_stall(ok: list[RequestRecord], params: dict[str, Any]) -> dict[str, Any]:
    """Short requests' inter-token gaps before any long prompt arrived, and while one was prefilling (from its
    sending to its first token): what a long prefill costs the users already decoding."""
    long_ones = {c.index for c in workloads.build(workloads.WorkloadParams(**params)) if c.long}
    long = [r for r in ok if r.conversation in long_ones]
    windows = [(r.start, r.start + r.ttft) for r in long if r.ttft is not None]
    first_long = min((start for start, _ in windows), default=math.inf)
    before, during = [], []
    for r in ok:
        if r in long:
            continue
        for a, b in pairwise(r.chunk_times):
            if b <= first_long:
                before.append(b - a)
            elif any(start < b <= end for start, end in windows):
                during.append(b - a)
    return {"itl_ms_before_long_prefill": _stats(before), "itl_ms_during_long_prefill": _stats(during)}


def build(config: dict[str, Any], records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": completion_tokens / duration,
        "total_token_throughput": (prompt_tokens + completion_tokens) / duration,
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
        "usage_from_chunks": sum(not r.usage_from_server for r in ok),  # requests the server sent no usage for
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats([r.tpot for r in ok]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": dict(Counter(r.error for r in records if not r.ok).most_common()),
    }
    if config["workload"] == "long-prompt":
        summary.update(_prefill_stall(ok, config["params"]))
    turns = sorted({r.turn for r in ok})
    if len(turns) > 1:  # multi-turn: does a longer history (a cached prefix, or not) slow the first token?
        summary["ttft_ms_by_turn"] = {str(t): _stats([r.ttft for r in ok if r.turn == t]) for t in turns}
    requests = [{**dataclasses.asdict(r), "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot} for r in records]
    return {"config": config, "summary": summary, "requests": requests}


def save(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def load(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def describe(config: dict[str, Any]) -> str:
    rate = f", {config['request_rate']:g} req/s" if config["request_rate"] else ""
    return (f"{config['workload']} against {config['url']}, model {config['model']}, {config['endpoint']}, "
            f"concurrency {config['concurrency']}{rate}{', ignore_eos' if config['ignore_eos'] else ''}, "
            f"{config['date']}")


def _latency_rows(summary: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    rows = {label: summary[key] for key, label in LATENCIES.items()}
    rows.update({f"TTFT turn {t}": stats for t, stats in summary.get("ttft_ms_by_turn", {}).items()})
    for key, label in (("itl_ms_before_long_prefill", "ITL before long prompts"),
                       ("itl_ms_during_long_prefill", "ITL during long prefill")):
        if key in summary:
            rows[label] = summary[key]
    return rows


def table(report: dict[str, Any]) -> str:
    s = report["summary"]
    counted = (f" ({s['usage_from_chunks']} requests without usage from the server: their content chunks counted)"
               if s["usage_from_chunks"] else " (the server's usage)")
    lines = [describe(report["config"]),
             f"requests: {s['completed']} completed, {s['failed']} failed, in {s['duration_s']:.2f} s",
             f"tokens: {s['prompt_tokens']:,} prompt ({s['cached_prompt_tokens']:,} of them cached), "
             f"{s['completion_tokens']:,} completion{counted}", ""]
    lines += [f"{label:<28}{_fmt(s[key], 2):>12}" for key, label in THROUGHPUTS.items()]
    lines += ["", f"{'latency (ms)':<16}" + "".join(f"{h:>10}" for h in STATS)]
    lines += [f"{label:<16}" + "".join(f"{_fmt(stats[h]):>10}" for h in STATS)
              for label, stats in _latency_rows(s).items()]
    if s["errors"]:
        lines += ["", "errors:"] + [f"  {n} x {message}" for message, n in s["errors"].items()]
    return "\n".join(lines)


def _figures(summary: dict[str, Any]) -> dict[str, float | None]:
    figures = {label: summary[key] for key, label in THROUGHPUTS.items()}
    figures["failed requests"] = summary["failed"]
    figures.update({f"{label} {h} (ms)": stats[h] for label, stats in _latency_rows(summary).items() for h in STATS})
    return figures


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The figures of two reports side by side, with B/A."""
    fa, fb = _figures(a["summary"]), _figures(b["summary"])
    lines = [f"A: {describe(a['config'])}", f"B: {describe(b['config'])}", "",
             f"{'figure':<34}{'A':>12}{'B':>12}{'B/A':>8}"]
    for label in [*fa, *(k for k in fb if k not in fa)]:
        va, vb = fa.get(label), fb.get(label)
        ratio = f"{vb / va:.2f}" if va and vb is not None else "-"
        lines.append(f"{label:<34}{_fmt(va, 2):>12}{_fmt(vb, 2):>12}{ratio:>8}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """A 2x2 PNG: TTFT, ITL and e2e latency histograms, and output tokens/s over the run in 1 s bins."""
    ok = [r for r in report["requests"] if r["error"] is None]
    fig = Figure(figsize=(12, 8))  # no pyplot: Figure renders with Agg, and no global state is touched
    axes = fig.subplots(2, 2).flatten()
    histograms = {"TTFT (ms)": [r["ttft"] for r in ok if r["ttft"] is not None],
                  "ITL (ms)": [gap for r in ok for gap in np.diff(r["chunk_times"])],
                  "end-to-end latency (ms)": [r["e2e"] for r in ok]}
    for ax, (title, seconds) in zip(axes[:3], histograms.items(), strict=True):
        ax.hist(np.array(seconds) * 1000.0, bins=30)
        ax.set(title=title, ylabel="count")
    # Each content chunk carries an equal share of its request's completion tokens (the server's count).
    times = [t for r in ok for t in r["chunk_times"]]
    weights = [r["completion_tokens"] / len(r["chunk_times"]) for r in ok for _ in r["chunk_times"]]
    edges = np.arange(math.ceil(report["summary"]["duration_s"]) + 1)
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    ax = axes[3]
    ax.bar(edges[:-1], tokens, width=1.0, align="edge")
    ax.set(title="output tokens/s over the run", xlabel="time since start (s)", ylabel="tokens/s")
    fig.suptitle(describe(report["config"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")

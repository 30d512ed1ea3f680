"""The dashboard's own arithmetic (engine/metrics.py), as pure logic: tokens per second bucketed by the second, and
latency percentiles of a window of samples."""

from __future__ import annotations

from collections import deque

from tokenmill.engine.metrics import RateHistory, percentiles


def test_rates_add_up_by_the_second_and_the_current_second_waits() -> None:
    rates = RateHistory(seconds=5)
    rates.add(100.2, generated=3)
    rates.add(100.9, generated=4, prompt=10)
    rates.add(102.5, prompt=7)
    rates.add(103.1, generated=1)
    generated, prompt = rates.series(now=103.5)  # seconds 98..102; 103 is not over
    assert generated == [0, 0, 7, 0, 0]
    assert prompt == [0, 0, 10, 0, 7]


def test_rates_keep_only_the_last_seconds() -> None:
    rates = RateHistory(seconds=3)
    for second in range(10):
        rates.add(second + 0.5, generated=second)
    generated, _ = rates.series(now=10.0)  # seconds 7, 8, 9
    assert generated == [7, 8, 9]
    assert rates.series(now=100.0) == ([0, 0, 0], [0, 0, 0])  # an idle server shows zeros, not its last burst


def test_percentiles_by_nearest_rank() -> None:
    assert percentiles(deque()) == {"count": 0, "p50": None, "p90": None, "p99": None}
    samples = deque(float(v) for v in reversed(range(1, 101)))  # 100 .. 1: sorted before ranking
    assert percentiles(samples) == {"count": 100, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles(deque([0.25])) == {"count": 1, "p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert percentiles(deque([3.0, 1.0, 2.0, 4.0])) == {"count": 4, "p50": 2.0, "p90": 4.0, "p99": 4.0}

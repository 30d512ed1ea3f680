"""An engine's thread lets its OpenMP threads go as it idles (kernels/threads.cpp): a second engine's idle team beside
a busy one made libgomp stop spinning between parallel regions, and a one-row decode step 4x slower."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import generate, start_engine

from tokenmill import backend, kernels
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not kernels.load() or not os.path.isdir("/proc/self/task"),
                    reason="the C++ kernels do not build here, or no /proc to count threads in")
def test_releasing_lets_the_calling_threads_team_go_and_a_later_region_starts_it_again() -> None:
    counts: dict[str, int] = {}

    def work() -> None:  # a thread of its own: its team is its own, and ends with it
        torch.set_num_threads(2)  # this thread's OpenMP setting (the tests run with OMP_NUM_THREADS=1)
        x, weight = torch.randn(64, 96), torch.ones(96)
        before = threads_now()
        torch.ops.tokenmill.rms_norm(x, weight, 1e-5)  # 64 rows, 32 a task: a region of two threads
        counts["busy"] = threads_now() - before
        counts["let go"] = int(torch.ops.tokenmill.release_threads())
        counts["released"] = threads_now() - before
        torch.ops.tokenmill.rms_norm(x, weight, 1e-5)
        counts["again"] = threads_now() - before

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert counts == {"busy": 1, "let go": 1, "released": 0, "again": 1}


def test_an_idle_engine_lets_its_threads_go(tiny4k: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[float] = []

    def spy(device: torch.device) -> None:
        assert threading.current_thread().name == "tokenmill-engine" and device.type == "cpu"
        released.append(time.monotonic())

    monkeypatch.setattr(backend, "release_threads", spy)
    engine = start_engine(tiny4k)
    try:
        generate(engine, [[1, 2, 3]], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
        finished = time.monotonic()
        deadline = finished + 5
        while not any(t >= finished for t in released) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(t >= finished for t in released), "the engine idled without letting its threads go"
    finally:
        engine.stop()

"""The C++ kernels' build: a lock left by an interrupted build clears itself, and concurrent builds take turns."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenmill import kernels


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "lock").touch()  # what torch's FileBaton leaves when its builder dies
    with caplog.at_level(logging.WARNING), kernels.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build of the C++ kernels that was interrupted" in caplog.text


def test_a_second_build_waits_for_the_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    events: list[str] = []
    first_in, first_may_leave = threading.Event(), threading.Event()

    def first() -> None:
        with kernels.build_lock(tmp_path):
            events.append("first in")
            first_in.set()
            first_may_leave.wait(10)
            (tmp_path / "lock").touch()  # torch's own lock of a build in progress: not the second's to remove
            time.sleep(0.2)
            events.append("first out")
            (tmp_path / "lock").unlink()

    def second() -> None:
        with kernels.build_lock(tmp_path):
            events.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert first_in.wait(10)
    with caplog.at_level(logging.WARNING):
        threads[1].start()
        deadline = time.monotonic() + 10
        while "waiting for another process building" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        first_may_leave.set()
        for thread in threads:
            thread.join(10)
    assert events == ["first in", "first out", "second in"]
    assert "waiting for another process building" in caplog.text
    assert "interrupted" not in caplog.text


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_the_kernels_load_past_a_stale_lock(tmp_path: Path) -> None:
    """Before, torch waited on the leftover lock forever: every start after a Ctrl-C'd first one hung, silently.
    On a copy of this machine's build (its files' times kept, so nothing rebuilds), not the build other processes
    use."""
    built = kernels.build_directory()
    shutil.copytree(built, tmp_path / built.name, ignore=shutil.ignore_patterns("lock", "tokenmill.flock"))
    (tmp_path / built.name / "lock").touch()
    done = subprocess.run([sys.executable, "-c", "from tokenmill import kernels; assert kernels.load()"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "interrupted" in done.stderr and "building" not in done.stderr

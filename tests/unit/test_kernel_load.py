"""The C++ kernels load past a lock an interrupted build left, on a copy of this machine's real build (a test of its
own: the other build tests never build, tests/unit/test_kernel_build.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import kernels


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

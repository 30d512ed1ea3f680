"""The C++ kernels' build: what is built, where, for which level, when it is not, and what the log says; a lock left by
an interrupted build clears itself, and concurrent builds take turns."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill import cpu, kernels
from tokenmill.errors import ConfigError


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


class FakeOps:
    """torch.ops.tokenmill of a build that fake_build recorded and never ran."""

    def built_with(self) -> list[str]:
        return ["avx2", "avx512"]

    def tiles_available(self) -> bool:
        return False


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[dict]]:
    """kernels.load() as on a Linux x86 machine with a compiler and ninja, each call to torch's builder recorded
    rather than run (nothing is built: FakeOps answers for the ops), builds under tmp_path."""
    from torch.utils import cpp_extension

    calls: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(kernels.platform, "system", lambda: "Linux")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.ops, "tokenmill", FakeOps())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name in (kernels.DISABLE_ENV, cpu.ISA_ENV, "CXX"):
        monkeypatch.delenv(name, raising=False)
    kernels.load.cache_clear()
    yield calls
    kernels.load.cache_clear()


@pytest.mark.parametrize(("value", "on"), [("", True), ("0", True), ("1", False), ("yes", False)])
def test_tokenmill_no_kernels_turns_them_off_when_set_to_anything_but_0(
        value: str, on: bool, fake_build: list[dict], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, value)
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        assert kernels.load() is on
    assert len(fake_build) == on
    off = "C++ kernels off (TOKENMILL_NO_KERNELS is set): plain PyTorch paths"
    assert (off in [r.getMessage() for r in caplog.records]) is not on
    assert kernels.built_with() == (["avx2", "avx512"] if on else []) and kernels.has_vector_kernels() == cpu.has_avx2()


@pytest.mark.parametrize("granted", [True, False])
def test_tiles_run_where_the_build_has_them_and_the_os_grants_them(granted: bool, fake_build: list[dict],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeOps, "tiles_available", lambda self: granted)
    assert kernels.has_tiles() is granted
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    kernels.load.cache_clear()
    assert not kernels.has_tiles() and kernels.built_with() == []  # no kernels, no tiles


def test_the_build_is_this_machine_s_at_the_level_run(fake_build: list[dict], monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """torch's builder gets the sources, a folder named by the build's key, and the compiler options of the level
    (tokenmill/cpu.py); a first build says so, once; the log names the level and what the build holds."""
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        assert kernels.load()
    (call,) = fake_build
    directory = Path(call["build_directory"])
    assert directory.parent == tmp_path and call["name"] == directory.name and directory.is_dir()
    assert re.fullmatch(r"tokenmill_kernels_[0-9a-f]{16}", directory.name)
    assert [Path(s).name for s in call["sources"]] == list(kernels.SOURCES) and call["is_python_module"] is False
    assert call["extra_cflags"] == ["-O3", "-march=native", "-fopenmp"] and call["extra_ldflags"] == ["-fopenmp"]
    assert call["verbose"] is False
    messages = [r.getMessage() for r in caplog.records]
    assert f"building tokenmill's C++ kernels for this CPU in {directory} (once per machine, about a minute)" \
        in messages
    ready = next(m for m in messages if m.startswith("C++ kernels ready in"))
    took = re.fullmatch(rf"C\+\+ kernels ready in (\d+\.\d)s, built for {cpu.level().name} \(avx2 avx512\)", ready)
    assert took and float(took.group(1)) < 30  # nothing was built
    (directory / f"{directory.name}.so").touch()  # built: no second "building" line
    kernels.load.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        assert kernels.load()
    assert "building" not in caplog.text and len(fake_build) == 2
    lower = cpu.supported_levels()[-2:-1]
    if lower:  # a lower level: other options, its own build
        monkeypatch.setenv(cpu.ISA_ENV, lower[0])
        kernels.load.cache_clear()
        assert kernels.load()
        options = fake_build[2]["extra_cflags"]
        assert options == ["-O3", *cpu.build_options(), "-fopenmp"] != fake_build[0]["extra_cflags"]
        assert fake_build[2]["build_directory"] != fake_build[0]["build_directory"]


def test_the_build_s_key_holds_the_sources_the_cpu_torch_and_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    first = kernels.build_directory()
    assert first.parent == tmp_path and kernels.build_directory() == first
    keys = set()
    for change in ("flags", "torch", "prefix", "header"):
        with monkeypatch.context() as patch:
            if change == "flags":
                patch.setattr(cpu, "machine_flags", lambda: frozenset({"fpu", "avx2", "fma"}))
            elif change == "torch":
                patch.setattr(torch, "__version__", "0.0.0")
            elif change == "prefix":
                patch.setattr(sys, "prefix", "/elsewhere")
            else:
                patch.setattr(kernels, "HEADERS", ())
            keys.add(kernels.build_directory())
    assert first not in keys and len(keys) == 4
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils import cpp_extension

    assert kernels.build_directory().parent == Path(cpp_extension.get_default_build_root())


def test_a_build_of_plain_loops_says_so(fake_build: list[dict], monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(FakeOps, "built_with", lambda self: [])
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        assert kernels.load()
    assert re.search(rf"s, built for {cpu.level().name} \(plain loops\)$", caplog.text.strip())


@pytest.mark.parametrize(("cxx", "message"), [
    ("no-such-g++", "no C++ compiler: no-such-g++ is not on PATH"),
    ("ccache-missing g++ -O2", "no C++ compiler: ccache-missing is not on PATH"),
    ("", None)])
def test_without_a_compiler_the_kernels_are_off_in_one_line(cxx: str, message: str | None, fake_build: list[dict],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """CXX's first word is the compiler (it may be "ccache g++"); unset, c++."""
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None if "missing" in name or "no-such" in name
                        else f"/usr/bin/{name}")
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
        assert kernels.load() is (message is None)
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    if message is None:
        assert not warnings and len(fake_build) == 1
    else:
        assert warnings == [f"C++ kernels unavailable ({message}): plain PyTorch paths, quantized weights dequantized "
                            "at load"] and not fake_build


@pytest.mark.parametrize(("error", "said"), [(RuntimeError("ninja: build stopped\nError building extension 'x'"),
                                              "Error building extension 'x'"),
                                             (RuntimeError("  "), "RuntimeError"),
                                             (OSError("x" * 400), "x" * 300)])
def test_a_failed_build_says_its_last_line(error: Exception, said: str, fake_build: list[dict],
                                           monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise error

    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
        assert not kernels.load()
    assert f"C++ kernels unavailable ({said}): plain PyTorch paths" in caplog.text


def test_ninja_from_pypi_is_put_on_the_path(fake_build: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its binary lies in the venv, which need not be on PATH; once, and an unset PATH gets it alone (no empty entry,
    which would mean the current folder)."""
    import ninja

    monkeypatch.setenv("PATH", "/usr/bin")
    assert kernels.load()
    assert os.environ["PATH"] == os.pathsep.join((ninja.BIN_DIR, "/usr/bin"))
    kernels.load.cache_clear()
    assert kernels.load() and os.environ["PATH"] == os.pathsep.join((ninja.BIN_DIR, "/usr/bin"))  # once
    monkeypatch.delenv("PATH")
    kernels.load.cache_clear()
    assert kernels.load() and os.environ["PATH"] == ninja.BIN_DIR


def test_the_compiler_is_c_plus_plus_unless_cxx_names_another(fake_build: list[dict],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(kernels.shutil, "which", lambda name: asked.append(name) or f"/usr/bin/{name}")
    assert kernels.load()
    monkeypatch.setenv("CXX", "ccache g++-12")
    kernels.load.cache_clear()
    assert kernels.load() and asked == ["c++", "ccache"]


def test_the_builds_folder_is_made_where_it_is_missing(fake_build: list[dict], monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "not" / "yet"))
    assert kernels.load()
    assert Path(fake_build[0]["build_directory"]).parent == tmp_path / "not" / "yet"


@pytest.mark.parametrize(("system", "machine"), [("Linux", "aarch64"), ("Darwin", "x86_64"), ("Windows", "AMD64")])
def test_off_linux_x86_the_kernels_are_not_built(system: str, machine: str, fake_build: list[dict],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels.platform, "system", lambda: system)
    monkeypatch.setattr(kernels.platform, "machine", lambda: machine)  # after fake_build's Linux x86
    with caplog.at_level(logging.INFO, logger="tokenmill.kernels"):
        assert not kernels.load()
    assert not fake_build
    said = f"C++ kernels not built on {system} {machine}: plain PyTorch paths"
    assert [r.getMessage() for r in caplog.records] == [said]


def test_a_level_this_cpu_cannot_run_is_refused_not_a_fallback(fake_build: list[dict],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.ISA_ENV, "avx9000")
    with pytest.raises(ConfigError, match="TOKENMILL_CPU_ISA=avx9000"):
        kernels.load()
    assert not fake_build

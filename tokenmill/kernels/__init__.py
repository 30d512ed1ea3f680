"""tokenmill's C++ CPU kernels, compiled on first use for this machine's CPU (torch.utils.cpp_extension) and cached.

The build is keyed by the sources, the CPU's instruction-set flags, the level run (tokenmill/cpu.py:
TOKENMILL_CPU_ISA) and torch's version, so a machine of another CPU class (AVX2, AVX-512, ...), or a lower level on
this one, builds its own. Where it cannot be built (no compiler, no ninja, not Linux x86) the callers fall back to
plain PyTorch; one log line says why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch

from tokenmill import cpu

log = logging.getLogger(__name__)

SOURCES = ("quant.cpp", "ops.cpp")  # the translation units, compiled side by side
# In the build key, not compiled on their own: ops.cpp includes the .cpp files
HEADERS = ("cpu.h", "norm.cpp", "rope.cpp", "attention.cpp", "attention_prefill.cpp", "layer.cpp", "tiles.cpp",
           "collectives.cpp", "lora.cpp", "sample.cpp", "threads.cpp")
DISABLE_ENV = "TOKENMILL_NO_KERNELS"  # set to 1: never build or load them (the fallback, for A/B and tests)


def has_vector_kernels() -> bool:
    """Whether the kernels compile to their AVX2 + FMA code here; elsewhere they are plain loops, correct but slower
    than oneDNN's dense matmuls."""
    return cpu.has_avx2()


def built_with() -> list[str]:
    """The instruction sets the loaded kernels were compiled for (avx2, avx512, avx512_vnni, avx512_bf16, amx): the
    level run's, those above it turned off (tokenmill/cpu.py); none where they are not loaded."""
    return list(torch.ops.tokenmill.built_with()) if load() else []


def has_tiles() -> bool:
    """Whether the kernels run here with AMX tiles (kernels/tiles.cpp): built for a CPU that has them, and granted
    their state by the OS."""
    return load() and bool(torch.ops.tokenmill.tiles_available())


def use_decode_fetch_ahead(on: bool) -> bool:
    """Whether decode attention fetches the next chunk of keys and values while it works on the present one
    (--decode-fetch-ahead; kernels/attention.cpp): one switch for the process. Returns what it was (True where the
    kernels are not loaded: there is nothing to switch). The kernels load with it on, so turning it on loads
    nothing: an engine's start on a GPU, which never runs them, does not build them for it."""
    if on and load.cache_info().currsize == 0:
        return True
    return bool(torch.ops.tokenmill.set_decode_fetch_ahead(on)) if load() else True


def _sources() -> list[str]:
    return [str(resources.files(__package__) / name) for name in SOURCES]


def build_directory() -> Path:
    """This machine's build: a folder named by a key of the sources, the CPU's flags, torch's version and where the
    package and its venv lie, under torch's extensions folder ($TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension

    key = hashlib.sha256()
    for path in [*_sources(), *(str(resources.files(__package__) / name) for name in HEADERS)]:
        with open(path, "rb") as src:
            key.update(src.read())
    key.update(" ".join(sorted(cpu.machine_flags())).encode())
    key.update(" ".join(cpu.build_options()).encode())
    key.update(torch.__version__.encode())
    # The build's own files name the sources' paths and the venv's: another checkout or venv builds its own, rather
    # than rebuild this one each time the two take turns.
    key.update(f"{resources.files(__package__)}|{sys.prefix}".encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"tokenmill_kernels_{key.hexdigest()[:16]}"


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the kernels as torch.ops.tokenmill.*; False where they are unavailable."""
    return _build_and_load()


def _build_and_load() -> bool:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        log.info("C++ kernels off (%s is set): plain PyTorch paths", DISABLE_ENV)
        return False
    level = cpu.level()  # a TOKENMILL_CPU_ISA this CPU cannot run is refused (ConfigError), not a fallback
    if platform.machine() != "x86_64" or platform.system() != "Linux":
        log.info("C++ kernels not built on %s %s: plain PyTorch paths", platform.system(), platform.machine())
        return False
    started = time.perf_counter()
    try:
        import ninja  # the PyPI package: its binary sits in the venv, which need not be on PATH

        paths = os.environ["PATH"].split(os.pathsep) if os.environ.get("PATH") else []
        if ninja.BIN_DIR not in paths:
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *paths])
    except ImportError:
        pass  # a system ninja, or none: verify_ninja_availability says so
    try:
        from torch.utils import cpp_extension

        compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]  # CXX may be "ccache g++"
        if shutil.which(compiler) is None:  # said before the build's line, not after it
            raise RuntimeError(f"no C++ compiler: {compiler} is not on PATH")
        cpp_extension.verify_ninja_availability()
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            if not (directory / f"{directory.name}.so").exists():
                log.warning("building tokenmill's C++ kernels for this CPU in %s (once per machine, about a minute)",
                            directory)
            cpp_extension.load(
                name=directory.name, sources=_sources(), is_python_module=False, build_directory=str(directory),
                extra_cflags=["-O3", *cpu.build_options(), "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
            )
    except Exception as exc:  # a missing compiler or ninja, a failed build: every cause means the same fallback
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        log.warning("C++ kernels unavailable (%s): plain PyTorch paths, quantized weights dequantized at load",
                    reason[:300])
        return False
    log.info("C++ kernels ready in %.1fs, built for %s (%s)", time.perf_counter() - started, level.name,
             " ".join(torch.ops.tokenmill.built_with()) or "plain loops")
    return True


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`'s build to this process, and clear a lock that an interrupted build left.

    torch guards a build with a `lock` file that the builder deletes when it ends: a build killed midway (Ctrl-C on
    a first start) leaves it, and every later load waits on it forever, silently. An flock ends with its process,
    so while this process holds one that every tokenmill build takes, a `lock` file can only be such a leftover.
    Where the filesystem has no flock, torch's lock file alone guards the build, as before."""
    import fcntl  # Linux, where the kernels build; imported here so that the package imports everywhere

    with open(directory / "tokenmill.flock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process building tokenmill's C++ kernels in %s", directory)
            fcntl.flock(held, fcntl.LOCK_EX)
        except OSError as exc:  # ENOSYS, EOPNOTSUPP: some network and FUSE filesystems
            log.debug("no flock in %s (%s): a lock left by an interrupted build stays", directory, exc)
            yield
            return
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of the C++ kernels that was interrupted", stale)
            stale.unlink()
        yield

"""What this CPU runs, as tokenmill sees it: the one probe of its instruction sets, capped by TOKENMILL_CPU_ISA.

The C++ kernels have a code path per instruction-set level (plain loops, AVX2, AVX-512, AVX512-BF16, AMX tiles) and
`--dtype auto` picks bf16 only where the CPU computes it. A machine runs its own highest level by default;
TOKENMILL_CPU_ISA=LEVEL runs a lower one as a CPU of that class would (the kernels compiled without the instructions
above it, bf16 and AMX seen as absent, PyTorch's own kernels capped alike), so one machine tests every path below
its own. TOKENMILL_DTYPE says what `--dtype auto` means (float32 or bfloat16), for the same reason.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass

from tokenmill.errors import ConfigError

log = logging.getLogger(__name__)

ISA_ENV = "TOKENMILL_CPU_ISA"
DTYPE_ENV = "TOKENMILL_DTYPE"
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class Level:
    name: str
    requires: tuple[str, ...]  # /proc/cpuinfo flags a CPU needs to run this level
    above: tuple[str, ...]  # flag prefixes of the levels above it: hidden from the probe, off in the build
    no_build: tuple[str, ...]  # g++ options that turn those instructions off under -march=native
    aten: str  # ATEN_CPU_CAPABILITY: PyTorch's own vectorized kernels at this level
    onednn: str  # ONEDNN_MAX_CPU_ISA: oneDNN's matmuls at this level


_AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# Lowest first. "avx512" is Ice Lake's class (VNNI where the CPU has it), "avx512_bf16" Zen 4's and Cooper Lake's,
# "amx" Sapphire Rapids'.
LEVELS = (
    Level("scalar", (), ("avx2", "fma", "avx512", "amx", "avx_vnni"),
          ("-mno-avx2", "-mno-fma", "-mno-avx512f", "-mno-avxvnni", *_AMX_OFF), "default", "SSE41"),
    Level("avx2", ("avx2", "fma"), ("avx512", "amx"), ("-mno-avx512f", *_AMX_OFF), "avx2", "AVX2"),
    Level("avx512", ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
          ("avx512_bf16", "avx512_fp16", "amx"), ("-mno-avx512bf16", "-mno-avx512fp16", *_AMX_OFF), "avx512",
          "AVX512_CORE_VNNI"),
    Level("avx512_bf16", ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"), ("amx",),
          _AMX_OFF, "avx512", "AVX512_CORE_BF16"),
    Level("amx", ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile",
                  "amx_bf16"), (), (), "avx512", "AVX512_CORE_AMX"),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


@functools.cache
def machine_flags() -> frozenset[str]:
    """The CPU's own flags as Linux lists them (none elsewhere: no cheap way to tell, so the plain paths)."""
    try:
        with open(CPUINFO, encoding="ascii", errors="ignore") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except (OSError, IndexError):
        return frozenset()


def supported_levels() -> list[str]:
    """The levels this machine can run, lowest first: its own and every one below."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["scalar"]
    flags = machine_flags()
    return [level.name for level in LEVELS if all(flag in flags for flag in level.requires)]


def _asked() -> str:
    return os.environ.get(ISA_ENV, "").strip().lower()


def level() -> Level:
    """The level this process runs: TOKENMILL_CPU_ISA's (native or unset: the machine's highest)."""
    asked, supported = _asked(), supported_levels()
    name = supported[-1] if asked in ("", "native") else asked
    if name not in LEVEL_NAMES:
        raise ConfigError(f"{ISA_ENV}={asked}: choose native, {', '.join(LEVEL_NAMES)}")
    if name not in supported:
        raise ConfigError(f"{ISA_ENV}={asked}: this CPU runs {', '.join(supported)}, not {name}")
    return LEVELS[LEVEL_NAMES.index(name)]


def flags() -> frozenset[str]:
    """The CPU's flags as this process's level sees them: those of the levels above an asked one left out."""
    if _asked() in ("", "native"):
        return machine_flags()
    hidden = level().above
    return frozenset(flag for flag in machine_flags() if not flag.startswith(hidden))


def build_options() -> list[str]:
    """The compiler's options for the C++ kernels: this CPU's (-march=native) less the levels above an asked one."""
    return ["-march=native", *(() if _asked() in ("", "native") else level().no_build)]


def computes_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX): where it has not, bf16 matmuls are emulated.

    --dtype auto picks bf16 by it and bf16 weights are prepacked by it. Those CPUs all have the AVX512 (BW, VL, DQ)
    that oneDNN's own bf16 check asks for, so what this accepts oneDNN runs."""
    seen = flags()
    return "amx_bf16" in seen or "avx512_bf16" in seen


def has_amx() -> bool:
    """Whether this CPU has AMX tile matmuls (Sapphire Rapids and later), which oneDNN runs bf16 matmuls on."""
    return "amx_bf16" in flags()


def has_avx2() -> bool:
    """Whether the kernels compile to their AVX2 + FMA code here; elsewhere they are plain loops."""
    seen = flags()
    return "avx2" in seen and "fma" in seen


def auto_dtype() -> str | None:
    """What --dtype auto means on the CPU when TOKENMILL_DTYPE says (float32 or bfloat16); None: the CPU decides."""
    asked = os.environ.get(DTYPE_ENV, "").strip().lower()
    if asked in ("", "auto"):
        return None
    names = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if asked not in names:
        raise ConfigError(f"{DTYPE_ENV}={asked}: choose auto, float32 or bfloat16")
    return names[asked]


def cap_torch() -> None:
    """Cap PyTorch's own kernels (ATen's vectorized ones, oneDNN's matmuls) at TOKENMILL_CPU_ISA's level, where one
    is asked and they are not set already: read when torch first runs a kernel, so called before it does."""
    if _asked() in ("", "native"):
        return
    try:
        chosen = level()
    except ConfigError:
        return  # said where the kernels are loaded, in one line
    os.environ.setdefault("ATEN_CPU_CAPABILITY", chosen.aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", chosen.onednn)


def describe() -> str:
    """One line for the start-up log: the level run, and how it was chosen."""
    chosen, own = level(), supported_levels()[-1]
    how = f"{ISA_ENV}, this CPU runs up to {own}" if chosen.name != own else f"this CPU's own; {ISA_ENV} runs lower"
    dtype = auto_dtype()
    return f"CPU instruction sets: {chosen.name} ({how})" + (f"; {DTYPE_ENV}={dtype}" if dtype else "")

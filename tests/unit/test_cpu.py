"""The one CPU probe (tokenmill/cpu.py): the instruction-set levels a CPU runs, TOKENMILL_CPU_ISA running a lower one
as a CPU of that class would, and TOKENMILL_DTYPE saying what --dtype auto means."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from tokenmill import cpu, kernels
from tokenmill.backend import resolve_dtype
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError

ZEN3 = "fpu sse4_2 avx f16c fma avx2 bmi2"
ZEN4 = f"{ZEN3} avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = f"{ZEN4} avx512_fp16 amx_bf16 amx_tile amx_int8"
Pretend = Callable[[str | None], None]


@pytest.mark.parametrize(("flags", "levels"), [
    (None, ["scalar"]), ("fpu sse4_2 avx", ["scalar"]), (ZEN3, ["scalar", "avx2"]),
    (ZEN3 + " avx512f", ["scalar", "avx2"]),  # AVX-512 without BW/DQ/VL (Knights Landing) runs AVX2's paths
    (ZEN4, ["scalar", "avx2", "avx512", "avx512_bf16"]), (SAPPHIRE_RAPIDS, list(cpu.LEVEL_NAMES))])
def test_a_cpu_runs_its_own_level_and_every_one_below(flags: str | None, levels: list[str],
                                                      pretend_cpu: Pretend) -> None:
    pretend_cpu(flags)
    assert cpu.supported_levels() == levels
    assert cpu.level().name == levels[-1]


def test_a_lower_level_hides_the_instructions_above_it(pretend_cpu: Pretend, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_cpu(SAPPHIRE_RAPIDS)
    assert cpu.computes_bf16() and cpu.has_amx() and cpu.has_avx2() and cpu.build_options() == ["-march=native"]
    seen = {}
    for level in cpu.LEVEL_NAMES:
        monkeypatch.setenv(cpu.ISA_ENV, level.upper())  # the case does not matter
        seen[level] = (cpu.has_avx2(), "avx512f" in cpu.flags(), cpu.computes_bf16(), cpu.has_amx())
        assert cpu.build_options()[0] == "-march=native"
    assert seen == {"scalar": (False, False, False, False), "avx2": (True, False, False, False),
                    "avx512": (True, True, False, False), "avx512_bf16": (True, True, True, False),
                    "amx": (True, True, True, True)}
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert {"-mno-avx512f", "-mno-amx-tile"} <= set(cpu.build_options()) and "-mno-avx2" not in cpu.build_options()
    monkeypatch.setenv(cpu.ISA_ENV, "native")
    assert cpu.level().name == "amx" and cpu.flags() == cpu.machine_flags()


@pytest.mark.parametrize(("asked", "message"), [("amx", "this CPU runs scalar, avx2, avx512, avx512_bf16, not amx"),
                                                ("avx3", "choose native, scalar, avx2")])
def test_a_level_this_cpu_cannot_run_is_refused_in_one_line(asked: str, message: str, pretend_cpu: Pretend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_cpu(ZEN4)
    monkeypatch.setenv(cpu.ISA_ENV, asked)
    with pytest.raises(ConfigError, match=message):
        cpu.level()
    with pytest.raises(ConfigError, match=f"TOKENMILL_CPU_ISA={asked}"):
        EngineConfig().check()  # before any model loads


@pytest.mark.parametrize(("asked", "expected"), [("float32", torch.float32), ("bf16", torch.bfloat16),
                                                 ("auto", None), ("", None)])
def test_tokenmill_dtype_says_what_auto_means_on_the_cpu(asked: str, expected: torch.dtype | None,
                                                         pretend_cpu: Pretend, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_cpu(ZEN4)  # bf16 by itself
    monkeypatch.setenv(cpu.DTYPE_ENV, asked)
    assert resolve_dtype("auto", torch.device("cpu")) == (expected or torch.bfloat16)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32  # a dtype asked for wins
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")  # a level without bf16: auto is fp32 unless TOKENMILL_DTYPE says
    assert resolve_dtype("auto", torch.device("cpu")) == (expected or torch.float32)


def test_a_dtype_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.DTYPE_ENV, "int8")
    with pytest.raises(ConfigError, match="TOKENMILL_DTYPE=int8: choose auto, float32 or bfloat16"):
        EngineConfig().check()


def test_the_level_asked_caps_pytorch_s_own_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATen's vectorized kernels and oneDNN's matmuls at the level's instructions (read when torch first runs a
    kernel: tokenmill sets them on import, before); where they are set already, they are left as they are."""
    if "avx2" not in cpu.supported_levels():
        pytest.skip("this CPU has no AVX2 to cap")
    probe = ("import tokenmill, torch, os; "
             "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    done = subprocess.run([sys.executable, "-c", probe], env={**env, cpu.ISA_ENV: "avx2"}, capture_output=True,
                          text=True, check=True)
    assert done.stdout.split() == ["AVX2", "AVX2"]
    monkeypatch.setenv(cpu.ISA_ENV, "scalar")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cpu.cap_torch()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.setenv(cpu.ISA_ENV, "native")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    cpu.cap_torch()
    assert "ATEN_CPU_CAPABILITY" not in os.environ


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_the_kernels_are_built_for_the_level_run() -> None:
    """What the compiler saw building the kernels loaded here: the level's instructions and none above them (run at
    every level by tests/paths)."""
    level, flags = cpu.level().name, cpu.machine_flags()
    expected = {"scalar": [], "avx2": ["avx2"], "avx512": ["avx2", "avx512"],
                "avx512_bf16": ["avx2", "avx512", "avx512_bf16"],
                "amx": ["avx2", "avx512", "avx512_bf16", "amx"]}[level]
    if level not in ("scalar", "avx2") and "avx512_vnni" in flags:
        expected.insert(2, "avx512_vnni")
    assert kernels.built_with() == expected
    assert kernels.has_vector_kernels() == (level != "scalar")
    assert kernels.has_tiles() == (level == "amx")

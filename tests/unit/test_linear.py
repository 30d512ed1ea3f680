"""Prepacked weights (layers/linear.py) compute what the plain Linears compute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import our_logits
from torch import nn

from tokenmill.backend import resolve_dtype
from tokenmill.config import WeightPlan
from tokenmill.layers.linear import PackedLinear, can_prepack
from tokenmill.loader import load_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_model_matches_the_plain_one(tiny_gguf: Path, dtype: str) -> None:
    if not can_prepack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"this CPU's oneDNN does not prepack {dtype}")
    packed = load_model(str(tiny_gguf), WeightPlan(dtype=dtype, device="cpu", bf16_kernels=False))
    plain = load_model(str(tiny_gguf), WeightPlan(dtype=dtype, device="cpu", prepack=False, bf16_kernels=False))
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert isinstance(packed.model.lm_head, PackedLinear)  # the tied head too
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    ids = list(range(3, 250, 9))
    ours, ref = our_logits(packed, ids), our_logits(plain, ids)
    tolerance = 1e-4 if dtype == "float32" else 0.05  # bf16: measured bitwise equal here; an ulp elsewhere
    assert (ours - ref).abs().max().item() <= tolerance


@pytest.mark.parametrize("flags,native", [("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),
                                          ("fpu avx2 amx_bf16 amx_tile", True), ("fpu avx2 avx512f", False),
                                          (None, False)])
def test_one_bf16_probe_picks_auto_dtype_and_prepacking(flags: str | None, native: bool,
                                                        pretend_cpu: Callable[[str | None], None]) -> None:
    """/proc/cpuinfo's flags (None: no such file, as off Linux) decide both: bf16 where the CPU computes it."""
    pretend_cpu(flags)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert can_prepack(cpu, torch.bfloat16) == (native and can_prepack(cpu, torch.float32))

"""Prepacked weights (layers/linear.py) compute what the plain Linears compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import our_logits
from torch import nn

from tokenmill.layers.linear import PackedLinear, can_prepack
from tokenmill.loader import load_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_model_matches_the_plain_one(tiny_gguf: Path, dtype: str) -> None:
    if not can_prepack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"this CPU's oneDNN does not prepack {dtype}")
    packed = load_model(str(tiny_gguf), dtype=dtype, device="cpu")
    plain = load_model(str(tiny_gguf), dtype=dtype, device="cpu", prepack=False)
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert isinstance(packed.model.lm_head, PackedLinear)  # the tied head too
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    ids = list(range(3, 250, 9))
    ours, ref = our_logits(packed, ids), our_logits(plain, ids)
    tolerance = 1e-4 if dtype == "float32" else 0.05  # bf16: measured bitwise equal here; an ulp elsewhere
    assert (ours - ref).abs().max().item() <= tolerance

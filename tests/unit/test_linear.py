"""Prepacked weights (layers/linear.py) compute what the plain Linears compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill.cache.kv_cache import PagedKVCache, SequenceSlice
from tokenmill.layers.linear import PackedLinear, can_prepack
from tokenmill.loader import LoadedModel, load_model


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    cache = PagedKVCache(loaded.config, loaded.dtype, loaded.device, num_blocks=4, block_size=16)
    assert cache.reserve(0, len(ids), len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache.prepare([SequenceSlice(0, 0, len(ids))]))
        return loaded.model.compute_logits(hidden)


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
    ours, ref = logits(packed, ids), logits(plain, ids)
    tolerance = 1e-4 if dtype == "float32" else 0.05  # bf16: measured bitwise equal here; an ulp elsewhere
    assert (ours - ref).abs().max().item() <= tolerance

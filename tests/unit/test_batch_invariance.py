"""Deterministic mode's parts: dense matmuls on fixed row tiles, every row's own block table for attention, and the
settings it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill import kernels
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import AttentionPaths, KVSpec, PagedKVCache
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.errors import ConfigError
from tokenmill.layers.attention import SequenceSlice
from tokenmill.layers.linear import INVARIANT_ROWS, PackedLinear, RowInvariantLinear, can_prepack
from tokenmill.loader import load_model
from tokenmill.models import registry


def _linears(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    plain = nn.Linear(576, 960, bias=True).to(dtype)
    packed = [PackedLinear(plain.weight, plain.bias)] if can_prepack(torch.device("cpu"), dtype) else []
    return [plain, *packed]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_every_batch_and_place(dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    row = torch.randn(576, generator=generator).to(dtype)
    for inner in _linears(dtype):
        layer = RowInvariantLinear(inner)
        seen = []
        with torch.inference_mode():
            for rows in (1, 3, INVARIANT_ROWS, INVARIANT_ROWS + 1, 40):
                x = torch.randn(rows, 576, generator=generator).to(dtype)
                place = int(torch.randint(rows, (1,), generator=generator))
                x[place] = row
                out = layer(x)
                assert out.shape == (rows, 960)
                torch.testing.assert_close(out, inner(x))  # the same Linear, only its rows tiled
                seen.append(out[place])
        assert all(torch.equal(seen[0], s) for s in seen[1:]), type(inner).__name__


def test_every_row_gets_its_sequence_table_and_the_keys_up_to_its_position() -> None:
    cache = PagedKVCache(KVSpec(1, 1, 4, torch.float32), torch.device("cpu"), num_blocks=8, block_size=4,
                         paths=AttentionPaths(per_row=True))
    assert cache.reserve(0, 7, 7) and cache.reserve(1, 3, 3)
    meta = metadata.prepare(cache, [SequenceSlice(0, 6, 1), SequenceSlice(1, 0, 3)])  # a decode, then a prompt of three
    tables = [cache.tables[0], cache.tables[1] + [0]]  # padded with the null block to the longest
    assert meta.row_tables is not None and meta.row_lengths is not None
    assert meta.row_tables.tolist() == [tables[0], tables[1], tables[1], tables[1]]
    assert meta.row_lengths.tolist() == [7, 1, 2, 3]
    assert metadata.prepare(PagedKVCache(KVSpec(1, 1, 4, torch.float32), torch.device("cpu"), 8, 4), []).row_tables \
        is None


def test_the_mode_refuses_what_it_cannot_keep(tiny_gguf, monkeypatch) -> None:
    tiny = load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu"))
    with pytest.raises(ConfigError, match="deterministic=True but the model was loaded with deterministic=False"):
        Engine(EngineConfig(deterministic=True), tiny)._setup()
    if kernels.load():
        deterministic = load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu", deterministic=True))
        with pytest.raises(ConfigError, match="needs --kv paged"):
            Engine(EngineConfig(deterministic=True, kv="contiguous"), deterministic)._setup()
    monkeypatch.setattr(kernels, "load", lambda: False)
    with pytest.raises(ConfigError, match="needs tokenmill's C.. kernels"):
        load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu", deterministic=True, quantized=False))
    with pytest.raises(ConfigError, match="CPU only"):
        registry.check_deterministic(torch.device("cuda"))

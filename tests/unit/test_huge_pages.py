"""The weights the kernels read, moved into one mapping advised for huge pages (layers/memory.py): the same values,
one storage for all, shared tensors still shared, and the model's outputs unchanged to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import write_tiny_gguf

from tokenmill.config import WeightPlan
from tokenmill.layers import memory
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.loader import load_model


def test_copies_keep_values_shapes_and_a_64_byte_boundary() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.uint8), torch.empty(0, 4), torch.randn(2, 3).t(),
               torch.randn(9).to(torch.bfloat16), torch.tensor([1, -2], dtype=torch.int8)]
    copies = memory.huge_page_copies(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert torch.equal(tensor, copy) and copy.dtype == tensor.dtype and copy.is_contiguous()
    if not memory.huge_pages_granted():
        pytest.skip("this OS grants no transparent huge pages: the tensors are kept as they are")
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1  # one mapping for all
    assert all(c.data_ptr() % memory.ALIGN == 0 for c in copies)
    assert all(c.data_ptr() != t.data_ptr() for c, t in zip(copies, tensors, strict=True) if t.numel())
    copies[0].zero_()  # a copy, not a view of the source
    assert tensors[0].abs().sum() > 0


def test_without_huge_pages_granted_the_tensors_stay(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "THP_SETTING", setting)
    tensors = [torch.randn(4)]
    assert not memory.huge_pages_granted() and memory.huge_page_copies(tensors)[0] is tensors[0]
    monkeypatch.setattr(memory, "THP_SETTING", tmp_path / "absent")
    assert not memory.huge_pages_granted()


def test_a_model_on_huge_pages_computes_the_same_bits(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q4.gguf", qtype=GGMLQuantizationType.Q4_1, hidden=256)
    plans = {on: WeightPlan(dtype="float32", device="cpu", huge_pages=on) for on in (False, True)}
    models = {on: load_model(str(path), plan).model for on, plan in plans.items()}
    held = [m.weight for m in models[True].modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    assert held, "the tiny model keeps quantized weights"
    ids = torch.tensor([1, 5, 9, 2])
    with torch.inference_mode():
        logits = {on: m.compute_logits(m.model.embed(ids)) for on, m in models.items()}
    assert torch.equal(logits[False], logits[True])
    head, embed = models[True].lm_head, models[True].model.embed_tokens  # tied: still one weight, moved once
    assert head.weight is embed.weight or not isinstance(embed.weight, QuantizedWeight)
    if memory.huge_pages_granted():
        storages = {t.untyped_storage().data_ptr() for w in held for t in (w.qweight, w.scales, w.mins)
                    if t is not None}
        assert len(storages) == 1

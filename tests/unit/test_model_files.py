"""Loading untrusted or unsupported model files: clear errors, fast; quantized weights as their blocks say."""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader
from helpers import our_logits, write_tiny_gguf

from tokenmill.errors import ModelFormatError
from tokenmill.loader import load_model


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="mamba")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'mamba'"):
        load_model(str(path), device="cpu")


def test_unsupported_quant_type_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", qtype=GGMLQuantizationType.TQ2_0)
    with pytest.raises(ModelFormatError, match="TQ2_0"):
        load_model(str(path), device="cpu")


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelFormatError):
        load_model(str(path), device="cpu")


QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quantized_weights_load_to_the_values_their_blocks_hold(qtype: str, tmp_path: Path) -> None:
    """A quantized file, loaded as it is served (prepacked where the CPU allows), computes the logits of its F32
    twin: every weight took the values its blocks decode to, in every projection, the embedding and the head."""
    quant_type = GGMLQuantizationType[qtype]
    quant_path = write_tiny_gguf(tmp_path / "q.gguf", qtype=quant_type, hidden=256)
    matrices = [t for t in GGUFReader(quant_path).tensors if len(t.shape) == 2]
    assert len(matrices) == 15 and all(t.tensor_type == quant_type for t in matrices)
    quant = load_model(str(quant_path), dtype="float32", device="cpu")
    twin = load_model(str(write_tiny_gguf(tmp_path / "twin.gguf", qtype=quant_type, hidden=256, dequantized=True)),
                      dtype="float32", device="cpu")
    ids = list(range(3, 250, 9))
    ours, reference = our_logits(quant, ids), our_logits(twin, ids)
    assert (ours - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()


def _field_value_offset(path: Path, key: str) -> int:
    """Where the value of metadata `key` starts (after its key string and its type)."""
    field = GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _craft(tmp_path: Path, edit) -> Path:
    data = bytearray(write_tiny_gguf(tmp_path / "good.gguf").read_bytes())
    path = tmp_path / "crafted.gguf"
    edit(data, tmp_path / "good.gguf")
    path.write_bytes(bytes(data))
    return path


def _put_u64(data: bytearray, offset: int, value: int) -> None:
    data[offset:offset + 8] = struct.pack("<Q", value)


def _tensor_offset_field(path: Path) -> int:
    tensor = GGUFReader(path).tensors[-1]
    return tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape) + 4


PAST_END = r"a read of \d+ x \w+ at byte \d+ runs past the end of the file"
# name: (the edit, the error our reader's checks raise: the stock reader fails on these too, but elsewhere)
CRAFTED_GGUFS = {
    "truncated in the header": (lambda d, p: d.__delitem__(slice(20, None)), PAST_END),
    "truncated in the metadata": (
        lambda d, p: d.__delitem__(slice(_field_value_offset(p, "tokenizer.ggml.tokens") + 100, None)),
        r"array item count 259 at byte \d+ cannot fit in the 88 bytes left"),
    "truncated in the tensor data": (lambda d, p: d.__delitem__(slice(len(d) - 64, None)), PAST_END),
    "absurd string length": (lambda d, p: _put_u64(d, _field_value_offset(p, "general.architecture"), 2**62),
                             r"a read of 4611686018427387904 x uint8 at byte \d+ runs past the end"),
    "absurd array length": (lambda d, p: _put_u64(d, _field_value_offset(p, "tokenizer.ggml.tokens") + 4, 2**60),
                            r"array item count 1152921504606846976 at byte \d+ cannot fit"),
    "absurd metadata count": (lambda d, p: _put_u64(d, 16, 2**60),
                              r"metadata key count 1152921504606846976 at byte 24 cannot fit"),
    "absurd tensor count": (lambda d, p: _put_u64(d, 8, 2**60), r"tensor count 1152921504606846976 at byte \d+ "
                                                                r"cannot fit"),
    "tensor data past the end": (lambda d, p: _put_u64(d, _tensor_offset_field(p), 2**40), PAST_END),
    "more layers than tensors": (lambda d, p: d.__setitem__(
        slice(_field_value_offset(p, "llama.block_count"), _field_value_offset(p, "llama.block_count") + 4),
        struct.pack("<I", 100_000)), r"the metadata describes a model of \d+ weights, the file holds 139776"),
}


@pytest.mark.parametrize("case", CRAFTED_GGUFS.values(), ids=CRAFTED_GGUFS.keys())
def test_crafted_gguf_is_refused_fast_by_our_checks(case, tmp_path: Path) -> None:
    edit, reason = case
    path = _craft(tmp_path, edit)
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match="crafted.gguf") as refused:
        load_model(str(path), dtype="float32", device="cpu")
    assert time.perf_counter() - started < 1.0
    assert re.search(reason, str(refused.value)), str(refused.value)

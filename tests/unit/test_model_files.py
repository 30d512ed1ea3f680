"""Loading untrusted or unsupported model files: clear errors, sandboxed chat templates."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader
from helpers import write_tiny_gguf

from tokenmill.errors import ModelFormatError, RequestError
from tokenmill.loader import load_model
from tokenmill.loader.chat_template import ChatTemplate

HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['__import__']('os').system('touch {marker}') }}{% endif %}{% endfor %}",
    "{{ messages.append({'role': 'system'}) }}{{ messages.clear() }}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_chat_template_in_a_gguf_is_refused_without_running(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write_tiny_gguf(tmp_path / "hostile.gguf", chat_template=template.replace("{marker}", str(marker)))
    loaded = load_model(str(path), dtype="float32", device="cpu")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError):
        loaded.chat_template.render(messages)
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_errors_and_fallback() -> None:
    with pytest.raises(ModelFormatError):
        ChatTemplate("{% for %}", None, None)
    with pytest.raises(RequestError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", None, None).render([])
    fallback = ChatTemplate(None, None, None)
    assert fallback.is_fallback
    assert fallback.render([{"role": "user", "content": "hi"}]).endswith("user: hi\n\nassistant:")


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


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16"])
def test_quantized_weights_load_close_to_full_precision(qtype: str, tmp_path: Path) -> None:
    full = load_model(str(write_tiny_gguf(tmp_path / "f32.gguf")), dtype="float32", device="cpu")
    quant_path = write_tiny_gguf(tmp_path / "q.gguf", qtype=GGMLQuantizationType[qtype])
    quant = load_model(str(quant_path), dtype="float32", device="cpu")
    for (name, a), (_, b) in zip(full.model.named_parameters(), quant.model.named_parameters(), strict=True):
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() < 0.1 * scale, name


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


CRAFTED_GGUFS = {
    "truncated in the header": lambda d, p: d.__delitem__(slice(20, None)),
    "truncated in the metadata": lambda d, p: d.__delitem__(slice(_field_value_offset(p, "tokenizer.ggml.tokens") + 100,
                                                                  None)),
    "truncated in the tensor data": lambda d, p: d.__delitem__(slice(len(d) - 64, None)),
    "absurd string length": lambda d, p: _put_u64(d, _field_value_offset(p, "general.architecture"), 2**62),
    "absurd array length": lambda d, p: _put_u64(d, _field_value_offset(p, "tokenizer.ggml.tokens") + 4, 2**60),
    "absurd metadata count": lambda d, p: _put_u64(d, 16, 2**60),
    "absurd tensor count": lambda d, p: _put_u64(d, 8, 2**60),
    "tensor data past the end": lambda d, p: _put_u64(d, _tensor_offset_field(p), 2**40),
    "more layers than tensors": lambda d, p: d.__setitem__(
        slice(_field_value_offset(p, "llama.block_count"), _field_value_offset(p, "llama.block_count") + 4),
        struct.pack("<I", 100_000)),
}


@pytest.mark.parametrize("edit", CRAFTED_GGUFS.values(), ids=CRAFTED_GGUFS.keys())
def test_crafted_gguf_is_refused_fast_with_a_clear_error(edit, tmp_path: Path) -> None:
    path = _craft(tmp_path, edit)
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match="crafted.gguf"):
        load_model(str(path), dtype="float32", device="cpu")
    assert time.perf_counter() - started < 1.0


def test_chat_template_budgets() -> None:
    messages = [{"role": "user", "content": "hi"}]
    endless = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           None, None)
    started = time.perf_counter()
    with pytest.raises(RequestError, match="out of time"):
        endless.render(messages, timeout=0.3)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(RequestError, match="more than 1000 characters"):
        ChatTemplate("{% for i in range(1000) %}xx{% endfor %}", None, None).render(messages, max_chars=1000)
    for bomb in ("{{ 'a' * 10**9 }}", "{{ [1] * 10**8 }}", "{{ 9 ** 999999999 }}"):
        with pytest.raises(RequestError, match="too"):
            ChatTemplate(bomb, None, None).render(messages)
    assert ChatTemplate("{{ 'ab' * 3 }}{{ 2 ** 10 }}", None, None).render(messages) == "ababab1024"
    assert sys.gettrace() is None  # the deadline's tracer is gone after rendering

"""Loading untrusted or unsupported model files: clear errors, sandboxed chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
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

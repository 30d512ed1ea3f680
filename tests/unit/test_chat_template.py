"""The chat template sandbox: what templates may use, what they may not, and the budgets that stop the rest."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import write_tiny_gguf

from tokenmill.config import WeightPlan
from tokenmill.errors import ModelFormatError, RequestError
from tokenmill.loader import load_model
from tokenmill.loader.chat_template import ChatTemplate, template_from_metadata

HI = [{"role": "user", "content": "hi"}]
MAX_VALUE = 1 << 20  # what one `*` or `**` may make
BUDGET = {"timeout": 2.0, "max_chars": 8 << 20}

HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['__import__']('os').system('touch {marker}') }}{% endif %}{% endfor %}",
    "{{ messages.append({'role': 'system'}) }}{{ messages.clear() }}",
]


def render(source: str, messages: list | None = None, **kwargs) -> str:
    return ChatTemplate(source, "<s>", "</s>").render(HI if messages is None else messages, **{**BUDGET, **kwargs})


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_chat_template_in_a_gguf_is_refused_without_running(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write_tiny_gguf(tmp_path / "hostile.gguf", chat_template=template.replace("{marker}", str(marker)))
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match="failed to render") as refused:
        loaded.chat_template.render(messages, **BUDGET)
    assert refused.value.param == "messages"
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_what_templates_use_renders() -> None:
    messages = [{"role": "user", "content": "héllo \"x\""}, {"role": "assistant", "content": "ok"}]
    assert render("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}", messages) == '<s>héllo "x"</s>'
    assert render("{{ messages | tojson }}", messages) == json.dumps(messages, ensure_ascii=False)
    assert render("{{ messages[1] | tojson(indent=2) }}", messages) == json.dumps(messages[1], indent=2)
    assert render("{{ 'é' | tojson(ensure_ascii=True) }}") == '"\\u00e9"'
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    assert render("{% if add_generation_prompt %}go{% endif %}") == "go"
    assert render("{% if add_generation_prompt %}go{% endif %}", add_generation_prompt=False) == ""
    # trim_blocks and lstrip_blocks, as Hugging Face renders templates: a block's newline and indent vanish
    assert render("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['role'] }}]\n    {% endif %}\n"
                  "{% endfor %}", messages) == "[user]\n"
    assert render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "01"


def test_errors_and_the_fallback() -> None:
    with pytest.raises(ModelFormatError, match="does not compile"):
        ChatTemplate("{% for %}", None, None)
    with pytest.raises(RequestError, match="^chat template: roles must alternate$") as raised:
        render("{{ raise_exception('roles must alternate') }}")
    assert raised.value.param == "messages"
    with pytest.raises(RequestError, match="failed to render these messages"):
        render("{{ messages[5]['content'] }}")
    fallback = ChatTemplate(None, None, None)
    assert fallback.is_fallback and not ChatTemplate("x", None, None).is_fallback
    assert fallback.render(HI, **BUDGET) == "user: hi\n\nassistant:"
    assert fallback.render(HI, add_generation_prompt=False, **BUDGET) == "user: hi\n\n"
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}", None, None).render(HI, **BUDGET) == "|"


def test_a_template_that_never_ends_is_stopped_on_time() -> None:
    endless = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           None, None)
    started = time.perf_counter()
    with pytest.raises(RequestError, match="the chat template was stopped: it ran out of time") as stopped:
        endless.render(HI, timeout=0.3, max_chars=1000)
    assert 0.3 <= time.perf_counter() - started < 1.0 and stopped.value.param == "messages"
    assert render("{% for i in range(3000) %}{% endfor %}done", timeout=5.0) == "done"


def test_the_tracer_is_the_callers_again_after_rendering() -> None:
    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        render("x")
        assert sys.gettrace() is tracer
        with pytest.raises(RequestError):
            render("{{ raise_exception('no') }}")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_output_budget_is_exact() -> None:
    assert render("{% for i in range(500) %}xx{% endfor %}", max_chars=1000) == "xx" * 500
    with pytest.raises(RequestError, match="^the chat template was stopped: it wrote more than 999 characters$"):
        render("{% for i in range(500) %}xx{% endfor %}", max_chars=999)


def test_multiplication_budget_is_exact() -> None:
    assert len(render(f"{{{{ 'a' * {MAX_VALUE} }}}}")) == MAX_VALUE
    assert len(render(f"{{{{ {MAX_VALUE // 2} * 'ab' }}}}")) == MAX_VALUE
    assert render(f"{{{{ ([0] * {MAX_VALUE}) | length }}}}") == str(MAX_VALUE)
    for bomb in (f"'a' * {MAX_VALUE + 1}", f"{MAX_VALUE // 2 + 1} * 'ab'", f"[1] * {MAX_VALUE + 1}",
                 "'a' * 10**9", "[1, 2] * 10**8"):
        with pytest.raises(RequestError, match="^the chat template was stopped: `\\*` would make a sequence too long$"):
            render(f"{{{{ {bomb} }}}}")
    assert render("{{ 'ab' * 3 }}|{{ 6 * 7 }}|{{ 2.5 * 2 }}|{{ 'x' * 0 }}") == "ababab|42|5.0|"


def test_power_budget_is_exact() -> None:
    # 2 has 2 bits: up to 3 * 2**20 / 2 = 1572864 may be raised; the number is kept, not written
    assert render("{% set x = 2 ** 1572864 %}ok") == "ok"
    assert render("{% set x = (-7) ** 786432 %}ok") == "ok"  # 7 has 3 bits: 3 * 2**20 / 3 = 1048576
    for bomb in ("2 ** 1572865", "(-7) ** 1048577", "9 ** 999999999", "1 ** 1572865"):
        with pytest.raises(RequestError, match="^the chat template was stopped: `\\*\\*` would make a number too "
                                               "large$"):
            render(f"{{% set x = {bomb} %}}")
    assert render("{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 2.0 ** 3 }}") == "1024|0.5|8.0"


def test_template_from_metadata() -> None:
    named = [{"name": "tool_use", "template": "T"}, "junk", {"name": "default", "template": "D"}]
    assert template_from_metadata(named) == "D"
    assert template_from_metadata([{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]) == "T"
    assert template_from_metadata([]) is None
    assert template_from_metadata("S") == "S"
    assert template_from_metadata(None) is None and template_from_metadata(5) is None

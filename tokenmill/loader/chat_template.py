"""The model's chat template, rendered in jinja2's immutable sandbox: a model file is untrusted input."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import ModelFormatError, RequestError

# Used when a model ships no template (base models): role-tagged turns, then the assistant's cue.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise RequestError(f"chat template: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None) -> None:
        self.is_fallback = not source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source or FALLBACK_TEMPLATE)
        except TemplateError as exc:
            raise ModelFormatError(f"the model's chat template does not compile: {exc}") from exc
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                **extra,
            )
        except RequestError:
            raise
        except Exception as exc:  # SecurityError, UndefinedError, TypeError...: the template failed, not us
            raise RequestError(f"the chat template failed to render these messages: {exc}",
                               param="messages") from exc


def template_from_metadata(source: Any) -> str | None:
    """tokenizer_config.json may hold one template or a list of named ones; take the default."""
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return source if isinstance(source, str) else None

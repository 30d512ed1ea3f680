"""The model's chat template, rendered in jinja2's immutable sandbox: a model file is untrusted input.

The sandbox stops attribute tricks (`''.__class__.__mro__`); a budget stops the rest: a render may run for so long
and write so much, and `*` and `**` may not build huge values at once.
"""

from __future__ import annotations

import json
import operator
import sys
import time
from datetime import datetime
from types import FrameType
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


class TemplateBudgetError(Exception):
    pass


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})
    max_value = 1 << 20  # items of a sequence, or digits of a number, one `*` or `**` may make

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(left, int) and isinstance(right, int) and \
                right * max(abs(left), 2).bit_length() > self.max_value * 3:
            raise TemplateBudgetError("`**` would make a number too large")
        if op == "*":
            sized, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and hasattr(sized, "__len__") and len(sized) * times > self.max_value:
                raise TemplateBudgetError("`*` would make a sequence too long")
        return (operator.pow if op == "**" else operator.mul)(left, right)


class _Deadline:
    """A trace function, set only while rendering: every line the compiled template runs checks the clock, so
    even a loop that writes nothing ends on time. Frames outside the template (jinja's runtime) are not traced."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.perf_counter() > self.deadline:
            raise TemplateBudgetError("it ran out of time")
        return self._line


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None) -> None:
        self.is_fallback = not source
        self.source = source or FALLBACK_TEMPLATE
        # Whether the template itself shows the model its tools and its past calls; where it does not, the API
        # writes them into the messages in the model's own tool-call format.
        self.renders_tools = "tools" in self.source
        self.renders_tool_calls = "tool_calls" in self.source
        env = _BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source or FALLBACK_TEMPLATE)
        except TemplateError as exc:
            raise ModelFormatError(f"the chat template does not compile: {exc}") from exc
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, timeout: float,
               max_chars: int, tools: list[dict[str, Any]] | None = None) -> str:
        """Render within a budget of time (seconds) and of output (characters), the server's (ServerConfig);
        a RequestError if it fails. tools: OpenAI's tool objects ({type: function, function: {...}}), as Hugging
        Face templates take them."""
        parts, size = [], 0
        previous_trace = sys.gettrace()
        sys.settrace(_Deadline(timeout))
        try:
            for part in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=self._bos_token, eos_token=self._eos_token, tools=tools):
                size += len(part)
                if size > max_chars:
                    raise TemplateBudgetError(f"it wrote more than {max_chars} characters")
                parts.append(part)
        except RequestError:
            raise
        except TemplateBudgetError as exc:
            raise RequestError(f"the chat template was stopped: {exc}", param="messages") from exc
        except Exception as exc:  # SecurityError, UndefinedError, TypeError...: the template failed, not us
            raise RequestError(f"the chat template failed to render these messages: {exc}",
                               param="messages") from exc
        finally:
            sys.settrace(previous_trace)
        return "".join(parts)


def template_from_metadata(source: Any) -> str | None:
    """tokenizer_config.json may hold one template or a list of named ones; take the default."""
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return source if isinstance(source, str) else None

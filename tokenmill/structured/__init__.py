"""Structured output: requests whose text must match a JSON schema, a regex, a choice or a grammar.

StructuredSpec (here) says what a request asks for; backend.py compiles it (llguidance) and keeps one matcher per
sequence, whose mask the sampler applies and whose state the scheduler advances with each accepted token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Whitespace allowed in each gap between a JSON value's tokens: enough to pretty-print a few levels deep, bounded so
# that a model cannot loop on spaces.
JSON_WHITESPACE = r"[ \n\t\r]{0,16}"


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's text must match: a JSON schema (JSON text), a regex, a choice (a JSON list of strings), a
    grammar (GBNF or Lark, as sent) or a Lark grammar tokenmill wrote (tool calls). Hashable: the compile cache's
    key."""

    kind: Literal["json", "regex", "choice", "grammar", "lark"]
    value: str

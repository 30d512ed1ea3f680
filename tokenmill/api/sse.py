"""Server-sent events as OpenAI streams them: `data: <json>` lines, closed by `data: [DONE]` (chat and completions),
or named events (`event: <type>`, the Responses API)."""

from __future__ import annotations

import json

# Characters JSON may leave raw that str.splitlines() (and so httpx's aiter_lines, which clients read streams with)
# takes for line ends, though SSE does not: escaped, so that a stream splits into its lines whatever reads it.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: dict, event: str | None = None) -> str:
    named = f"event: {event}\n" if event else ""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"{named}data: {data.translate(_LINE_BREAKING)}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"

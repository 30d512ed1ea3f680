"""Server-sent events as OpenAI streams them: `data: <json>` lines, closed by `data: [DONE]` (chat and completions),
or named events (`event: <type>`, the Responses API)."""

from __future__ import annotations

import json


def sse_event(payload: dict, event: str | None = None) -> str:
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"

"""Server-sent events as OpenAI streams them: `data: <json>` lines, closed by `data: [DONE]`."""

from __future__ import annotations

import json


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"

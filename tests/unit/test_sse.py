"""Stream events split into their lines whatever reads them: SSE ends lines at \\n and \\r only, but clients read
streams with str.splitlines() (httpx's aiter_lines), which also breaks at U+0085, U+2028 and U+2029."""

from __future__ import annotations

import json

import pytest

from tokenmill.api.sse import sse_event


@pytest.mark.parametrize("text", ["a\u2028b", "\x85", "x\u2029y\u2028", "\x1c\x1d\x1e\x0b\x0c\r\n", "é 日本 🙂"])
def test_a_token_s_text_never_breaks_the_line_of_its_event(text: str) -> None:
    event = sse_event({"choices": [{"delta": {"content": text}}]}, "delta")
    lines = event.splitlines()
    assert lines[0] == "event: delta" and lines[2:] == [""] and len(lines) == 3
    assert json.loads(lines[1].removeprefix("data: "))["choices"][0]["delta"]["content"] == text
    assert "é" not in text or "é" in event  # other characters stay as they are

"""The other half of the request-fields rule (tests/unit/test_request_fields.py): a field that claims to be
implemented is read by the server. Requests through the live in-process server record every field their handlers
read; each implemented field must be among them, or be enforced by its type alone (listed, with why)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from helpers import ServerThread

from tokenmill.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RequestModel,
    field_effect,
)
from tokenmill.api.responses_api import ResponsesRequest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"

# Implemented by their type: only the values this server honours validate, so there is nothing to read.
TYPE_ENFORCED = {
    ("ChatCompletionRequest", "modalities"): "only [\"text\"] validates",
    ("ResponsesRequest", "truncation"): "only \"disabled\" validates",
    ("ResponsesRequest", "include"): "only an empty list validates",
}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "logprobs": True, "top_logprobs": 1}),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "stream": True, "stream_options": {"include_usage": True}}),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                           "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                           "parallel_tool_calls": False}),
    ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True}),
    ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "instructions": "Be brief.",
                    "metadata": {"k": "v"}}),
    ("/embeddings", {"model": MODEL, "input": "hi"}),
]


def test_every_implemented_field_is_read(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: set[tuple[str, str]] = set()

    def recording(self: RequestModel, name: str) -> Any:
        if name in type(self).model_fields:
            reads.add((type(self).__name__, name))
        return object.__getattribute__(self, name)

    monkeypatch.setattr(RequestModel, "__getattribute__", recording)
    for path, body in REQUESTS:
        assert httpx.post(server.base_url + path, json=body, timeout=60).status_code == 200
    for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, EmbeddingRequest):
        implemented = {(model.__name__, name) for name in model.model_fields
                       if field_effect(model, name)[0] == "implemented"}
        unread = implemented - reads - set(TYPE_ENFORCED)
        assert not unread, f"implemented but never read: {sorted(unread)}"

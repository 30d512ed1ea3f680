"""Real responses of every route, as the bytes came over HTTP, validated against OpenAI's published OpenAPI
document (tests/data). Where tokenmill differs on purpose, DELIBERATE says how and why."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import ServerThread
from openai_spec import validate, validate_event

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hi."}]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}

# Differences we keep, each tested as present where these tests can reach it. The schemas do not forbid additional
# properties, so an extra field needs nothing; where a schema rules out what we send on purpose, as_documented (or the
# test) names the entry it applies.
DELIBERATE = {
    "model.max_model_len": "vLLM's extra field on model objects: clients size their prompts by it",
    "finish_reason abort": "vLLM's finish_reason for a sequence ended by shutdown or a client that went away; "
                           "the spec's enum has no word for it (never seen in these tests)",
    "embedding base64": "with encoding_format base64 each embedding is a base64 string of float32s, as OpenAI sends "
                        "it; the schema types it as an array only",
    "completion chunk finish_reason null": "streamed completions chunks carry finish_reason: null until the last, "
                                           "as OpenAI's do; the schema (written for the whole response) wants a "
                                           "string",
    "completion chunk usage null": "with include_usage every completions chunk but the last carries usage: null, "
                                   "as OpenAI's do; CreateCompletionResponse (shared with the whole response) "
                                   "types usage as an object only. Chat chunks need no entry: their schema allows "
                                   "null",
}


def as_documented(chunk: dict[str, Any]) -> dict[str, Any]:
    """A completions stream chunk with the DELIBERATE nulls set as the schema allows (the rest validated as sent)."""
    chunk = dict(chunk)
    if chunk.get("usage", {}) is None:
        del chunk["usage"]  # DELIBERATE: completion chunk usage null
    # DELIBERATE: completion chunk finish_reason null
    chunk["choices"] = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
    return chunk


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def sse(server: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every event of a stream, [DONE] left out."""
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2},
                                   {"tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required"}],
                         ids=["plain", "logprobs", "tools"])
def test_chat_completions(server: ServerThread, extra: dict) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 24 if "tools" in extra else 4, **extra}
    response = post(server, "/chat/completions", body)
    assert response.status_code == 200
    validate(response.json(), "CreateChatCompletionResponse")
    chunks = sse(server, "/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] is not None
    assert all(c["usage"] is None for c in chunks[:-1])
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")  # as sent: usage null included


@pytest.mark.parametrize("extra", [{}, {"logprobs": 3}], ids=["plain", "logprobs"])
def test_completions(server: ServerThread, extra: dict) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **extra}
    validate(post(server, "/completions", body).json(), "CreateCompletionResponse")
    chunks = sse(server, "/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["finish_reason"] is None and chunks[-2]["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    for chunk in chunks:
        validate(as_documented(chunk), "CreateCompletionResponse")  # OpenAI streams completions in its own shape


def test_models(server: ServerThread) -> None:
    listed = httpx.get(server.base_url + "/models").json()
    validate(listed, "ListModelsResponse")
    assert "max_model_len" in listed["data"][0]  # DELIBERATE
    validate(httpx.get(f"{server.base_url}/models/{MODEL}").json(), "Model")


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/chat/completions", {"model": MODEL, "messages": HI, "temperature": 5}, 400),
    ("POST", "/chat/completions", {"model": "nope", "messages": HI}, 404),
    ("POST", "/completions", {"model": MODEL, "prompt": "x", "surely_not_a_field": 1}, 400),
    ("GET", "/models/nope", None, 404),
    ("POST", "/responses", {"model": MODEL, "input": "x", "reasoning": {"effort": "high"}}, 400),
    ("GET", "/responses/resp_nope", None, 404),
    ("POST", "/embeddings", {"model": MODEL, "input": ""}, 400),
])
def test_errors(server: ServerThread, method: str, path: str, body: dict | None, status: int) -> None:
    response = httpx.request(method, server.base_url + path, json=body, timeout=60)
    assert response.status_code == status
    validate(response.json(), "ErrorResponse")


@pytest.mark.parametrize("extra", [{}, {"tools": [{"type": "function", **WEATHER}], "tool_choice": "required",
                                        "max_output_tokens": 24}], ids=["plain", "tools"])
def test_responses(server: ServerThread, extra: dict) -> None:
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, **extra}
    created = post(server, "/responses", body).json()
    validate(created, "Response")
    validate(httpx.get(f"{server.base_url}/responses/{created['id']}").json(), "Response")
    events = sse(server, "/responses", {**body, "stream": True})
    for event in events:
        validate_event(event)
    validate(events[-1]["response"], "Response")
    # the conversation listed: messages, and with tools the calls and their outputs
    answers = [{"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
               for item in created["output"] if item["type"] == "function_call"]
    assert bool(answers) == bool(extra)  # tool_choice required: calls
    follow_up = post(server, "/responses", {"model": MODEL, "input": answers or "Thanks.",
                                            "previous_response_id": created["id"], "max_output_tokens": 4}).json()
    listed = httpx.get(f"{server.base_url}/responses/{follow_up['id']}/input_items").json()
    validate(listed, "ResponseItemList")
    assert len(listed["data"]) == 1 + len(created["output"]) + max(len(answers), 1)
    assert httpx.delete(f"{server.base_url}/responses/{created['id']}").json()["deleted"] is True


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings(server: ServerThread, encoding: str) -> None:
    body = {"model": MODEL, "input": ["one", "two"], "encoding_format": encoding}
    created = post(server, "/embeddings", body).json()
    if encoding == "base64":  # DELIBERATE: embedding base64 (each a whole number of float32s, decoded as one)
        floats = post(server, "/embeddings", {**body, "encoding_format": "float"}).json()["data"]
        for d, f in zip(created["data"], floats, strict=True):
            assert np.frombuffer(base64.b64decode(d["embedding"]), "<f4").shape == (len(f["embedding"]),)
        created["data"] = [{**d, "embedding": [0.0]} for d in created["data"]]
    validate(created, "CreateEmbeddingResponse")


@pytest.fixture
def failing_engine(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model step raises, as a broken kernel would: the engine fails the sequence, not the server."""
    def boom(*_: Any) -> None:
        raise RuntimeError("injected by the conformance test")

    monkeypatch.setattr(server.engine.runner, "run", boom)


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", {"messages": HI}),
                                            ("/completions", {"prompt": "x"}), ("/responses", {"input": "x"})],
                         ids=["chat", "completions", "responses"])
def test_engine_failure(server: ServerThread, failing_engine: None, path: str, body: dict) -> None:
    """An engine failure is a 500 error object; streamed, an error event (chat, completions) or response.failed."""
    body = {"model": MODEL, "max_tokens" if path != "/responses" else "max_output_tokens": 4, **body}
    response = post(server, path, body)
    assert response.status_code == 500
    validate(response.json(), "ErrorResponse")
    assert response.json()["error"]["type"] == "server_error"
    events = sse(server, path, {**body, "stream": True})
    if path == "/responses":
        for event in events:
            validate_event(event)
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
        validate(events[-1]["response"], "Response")
    else:
        assert "error" in events[-1]
        validate(events[-1], "ErrorResponse")

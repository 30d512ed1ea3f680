"""Logprobs byte-exact, through the `openai` SDK against a live server on the default model (SmolLM2's byte-level
BPE splits emoji and CJK characters into several tokens): each entry carries its token's own bytes, and over an
answer they rebuild its text exactly."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import ServerThread

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TEXTS = ["🌍🌐", "你好，世界！这是一个测试。"]


def forced(text: str) -> dict:
    """A constraint that makes the model write exactly this text (then end)."""
    return {"structured_outputs": {"choice": [text]}}


@pytest.mark.parametrize("text", TEXTS)
def test_chat_logprob_bytes_rebuild_the_answer(client: openai.OpenAI, text: str) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Write it."}], "max_tokens": 40,
           "logprobs": True, "top_logprobs": 3, "extra_body": forced(text)}
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
    entries = reply.choices[0].logprobs.content
    assert len(entries) > len(text)  # pieces of characters, each its own entry
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    for e in entries:
        assert "\ufffd" not in e.token
        assert e.token == bytes(e.bytes).decode() if not e.token.startswith("bytes:") else \
            e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)
        assert len(e.top_logprobs) == 3
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert b"".join(bytes(e.bytes) for e in streamed) == text.encode()
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]


def test_completion_logprobs_show_pieces_as_bytes_and_every_alternative(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "Translate to Chinese: Hello, world! ->", "max_tokens": 12, "logprobs": 5,
            **forced(TEXTS[1])}
    lp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    pieces = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert pieces and all(t.count("\\x") for t in pieces)
    rebuilt = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                       for t in lp["tokens"])
    assert rebuilt == TEXTS[1].encode()[:len(rebuilt)] and len(rebuilt) > 6
    assert all(len(alternatives) == 5 for alternatives in lp["top_logprobs"])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_completion_alternatives_never_collapse(server: ServerThread) -> None:
    """Random prompts of CJK and emoji, where several likely next tokens are pieces of characters."""
    for prompt in ["日本語の文章：", "🌍🌐🌏", "数学是"]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "logprobs": 5, "temperature": 1.0, "seed": 7}
        lp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        assert [len(alternatives) for alternatives in lp["top_logprobs"]] == [5] * len(lp["tokens"])
        assert all(json.dumps(k) for alternatives in lp["top_logprobs"] for k in alternatives)

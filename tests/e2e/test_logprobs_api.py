"""Logprobs byte-exact, against a live server on the default model (SmolLM2's byte-level BPE splits emoji and CJK
characters into several tokens): each entry carries the bytes its token adds, and over an answer they rebuild its
text exactly; pieces of a character are written as OpenAI writes them; /v1/completions gives every alternative asked
for and text_offset in characters of the text, streamed or not."""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest
from helpers import ServerThread

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TEXTS = ["🌍🌐", "你好，世界！这是一个测试。"]
WRITE_IT = [{"role": "user", "content": "Write it."}]


def forced(text: str) -> dict:
    """A constraint that makes the model write exactly this text (then end)."""
    return {"structured_outputs": {"choice": [text]}}


def escaped(data: bytes) -> str:
    """OpenAI's form of bytes that are not whole UTF-8: printable ASCII as itself, the rest as \\xNN."""
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


def unescaped(token: str) -> bytes:
    """A legacy token's bytes: its text, or those its `bytes:` form writes."""
    if not token.startswith("bytes:"):
        return token.encode()
    parts = re.findall(r"\\x([0-9a-f]{2})|(.)", token.removeprefix("bytes:"), flags=re.DOTALL)
    return b"".join(bytes([int(hex_, 16)]) if hex_ else char.encode() for hex_, char in parts)


def post(server: ServerThread, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server: ServerThread, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={"model": MODEL, **body, "stream": True},
                      timeout=120) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("text", TEXTS)
def test_chat_logprob_bytes_rebuild_the_answer(client: openai.OpenAI, text: str) -> None:
    ask = {"model": MODEL, "messages": WRITE_IT, "max_tokens": 40, "logprobs": True, "top_logprobs": 3,
           "extra_body": forced(text)}
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
    entries = reply.choices[0].logprobs.content
    assert len(entries) > len(text)  # pieces of characters, each its own entry; no entry for the end token
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    for one in entries + [alternative for e in entries for alternative in e.top_logprobs]:
        try:
            assert one.token == bytes(one.bytes).decode()
        except UnicodeDecodeError:
            assert one.token == escaped(bytes(one.bytes)) and "\\x" in one.token  # a piece: as OpenAI writes it
    assert all(len(e.top_logprobs) == 3 for e in entries)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    pieces = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert b"".join(bytes(e.bytes) for e in pieces) == text.encode()
    assert [(e.token, e.bytes) for e in pieces] == [(e.token, e.bytes) for e in entries]


def test_chat_logprobs_carry_refusal_null(server: ServerThread) -> None:
    """OpenAI's schema requires `refusal` beside `content` in a choice's logprobs, whole or streamed."""
    body = {"messages": WRITE_IT, "max_tokens": 3, "logprobs": True}
    assert post(server, "/chat/completions", body)["choices"][0]["logprobs"].keys() == {"content", "refusal"}
    assert post(server, "/chat/completions", body)["choices"][0]["logprobs"]["refusal"] is None
    with_logprobs = [c["choices"][0]["logprobs"] for c in streamed(server, "/chat/completions", body)
                     if c["choices"] and c["choices"][0]["logprobs"]]
    assert with_logprobs and all(lp.keys() == {"content", "refusal"} and lp["refusal"] is None
                                 for lp in with_logprobs)


def offsets_of(tokens: list[str]) -> list[int]:
    """text_offset as tokenmill counts it, for text that is whole UTF-8: the characters before each token; the
    pieces of one character all start where it does."""
    data = [unescaped(t) for t in tokens]
    return [len(b"".join(data[:i]).decode("utf-8", errors="ignore")) for i in range(len(data))]


def test_completion_logprobs_show_pieces_as_bytes_and_every_alternative(server: ServerThread) -> None:
    body = {"prompt": "Translate to Chinese: Hello, world! ->", "max_tokens": 30, "logprobs": 5, **forced(TEXTS[1])}
    choice = post(server, "/completions", body)["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text == TEXTS[1]
    pieces = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert len(pieces) > 4 and all(t.count("\\x") == len(unescaped(t)) for t in pieces)
    assert b"".join(unescaped(t) for t in lp["tokens"]) == text.encode()
    assert_alternatives(lp, 5)
    assert lp["text_offset"] == offsets_of(lp["tokens"])
    for token, at in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[at:].startswith(token) if not token.startswith("bytes:") else \
            unescaped(token) in text[at:at + 2].encode()  # a piece of the character at its offset (and the next)
    assert lp["text_offset"][-1] == len(text) - 1  # 。 is the last character


def test_streamed_offsets_are_the_whole_answer_s(server: ServerThread) -> None:
    """A stop string makes the stream hold text back; offsets still count every token's characters."""
    body = {"prompt": "Translate to Chinese: Hello, world! ->", "max_tokens": 30, "logprobs": 2,
            "stop": ["never written anywhere"], **forced(TEXTS[1])}
    whole = post(server, "/completions", body)["choices"][0]["logprobs"]
    chunks = [c["choices"][0] for c in streamed(server, "/completions", body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == TEXTS[1]
    assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == whole["text_offset"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == whole["tokens"]


def test_completion_alternatives_never_collapse(server: ServerThread) -> None:
    """Prompts of CJK and emoji, where several likely next tokens are pieces of characters, and of random token
    ids: logprobs: 5 gives 5 alternatives at every position."""
    rng = random.Random(5)
    prompts = ["日本語の文章：", "🌍🌐🌏", [rng.randrange(server.engine.tokenizer.vocab_size) for _ in range(12)]]
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 6, "logprobs": 5, "temperature": 1.0, "seed": 7}
        lp = post(server, "/completions", body)["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6
        assert_alternatives(lp, 5)


def assert_alternatives(lp: dict, k: int) -> None:
    """Each position's top_logprobs: the k likeliest tokens and the sampled one (OpenAI: up to logprobs + 1), which
    is the least likely of them when it is not among the k."""
    for token, logprob, alternatives in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert alternatives[token] == logprob
        assert len(alternatives) == k or (len(alternatives) == k + 1 and logprob == min(alternatives.values()))


@pytest.mark.parametrize("k", [0, 1])
def test_completion_alternatives_hold_the_sampled_token(server: ServerThread, k: int) -> None:
    """At a high temperature many sampled tokens are not the likeliest; logprobs: 0 gives the sampled one alone."""
    body = {"prompt": "The weather today is", "max_tokens": 16, "logprobs": k, "temperature": 1.5, "seed": 3}
    lp = post(server, "/completions", body)["choices"][0]["logprobs"]
    assert_alternatives(lp, k)
    assert any(len(alternatives) == k + 1 for alternatives in lp["top_logprobs"])
    if k == 0:
        assert all(alternatives == {token: logprob} for token, logprob, alternatives
                   in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))


def test_a_hidden_special_token_keeps_its_logprob_and_adds_no_bytes(server: ServerThread) -> None:
    """A control token the model writes mid-answer never reaches the text: its entry has its name and no bytes,
    so the entries' bytes still rebuild the content (here none)."""
    [im_start] = server.engine.tokenizer.special_token_ids(("<|im_start|>",))
    body = {"max_tokens": 3, "logit_bias": {str(im_start): 100}, "temperature": 0}
    choice = post(server, "/chat/completions", {**body, "messages": WRITE_IT, "logprobs": True})["choices"][0]
    assert choice["message"]["content"] == ""
    assert [(e["token"], e["bytes"]) for e in choice["logprobs"]["content"]] == [("<|im_start|>", [])] * 3
    choice = post(server, "/completions", {**body, "prompt": "Hi", "logprobs": 1})["choices"][0]
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == ["<|im_start|>"] * 3
    assert choice["logprobs"]["text_offset"] == [0, 0, 0]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_left_out_of_text_and_logprobs_unless_included(server: ServerThread, include: bool) -> None:
    """A request's own stop token finishes the answer and, as vLLM does, is not part of it (neither text nor
    entry) unless include_stop_str_in_output keeps it; the entries' bytes rebuild the text either way."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "logprobs": 1, "temperature": 0}
    free = post(server, "/completions", body)["choices"][0]["logprobs"]["tokens"]
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # the first token that is new here
    [stop_id] = server.engine.tokenizer.encode(free[at])
    choice = post(server, "/completions", {**body, "stop_token_ids": [stop_id],
                                           "include_stop_str_in_output": include})["choices"][0]
    kept = free[:at + 1] if include else free[:at]
    assert choice["finish_reason"] == "stop" and choice["logprobs"]["tokens"] == kept
    assert choice["text"] == "".join(kept)

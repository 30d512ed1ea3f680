"""Gemma 3 270M served as `tokenmill serve gemma3-270m` serves it (its GGUF kept quantized, the default dtype),
through the openai SDK."""

from __future__ import annotations

import openai
import pytest
from helpers import ServerThread, openai_client

from tokenmill.loader import load_model

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def server():
    with ServerThread(load_model(MODEL), MODEL, max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


def test_the_base_model_continues_a_prompt(client: openai.OpenAI, server: ServerThread) -> None:
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert "France" in full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt)) == 6  # <bos> and five words
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True))
    assert streamed == full.choices[0].text


def test_chat_and_a_batch_of_eight(client: openai.OpenAI, server: ServerThread) -> None:
    """The base GGUF has no chat template: the fallback's, with one <bos>; eight prompts run at once (that each
    answers in a batch what it answers alone is tested in fp32: tests/model/test_gemma3.py)."""
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens == len(server.engine.tokenizer.encode("user: Name a colour.\n\nassistant:"))
    batch = client.completions.create(model=MODEL, prompt=[f"Fact number {i}: the ocean" for i in range(8)],
                                      temperature=0, max_tokens=8)
    assert sorted(c.index for c in batch.choices) == list(range(8))
    assert all(c.text for c in batch.choices) and batch.usage.completion_tokens == 64
    assert server.engine.num_unfinished == 0 and server.engine.kv_cache.usage() == 0

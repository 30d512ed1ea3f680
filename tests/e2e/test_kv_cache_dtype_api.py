"""A server whose KV cache is int8 (--kv-cache-dtype int8), through the openai SDK: streamed and whole answers agree,
a repeated prompt is served from the prefix cache with the same answer, and /server_info names the cache's dtype
and the tokens it holds."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import ServerThread, openai_client

from tokenmill.loader import LoadedModel

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers of Europe and their seas."}],
       "temperature": 0, "max_tokens": 32}


@pytest.fixture(scope="module")
def server(smollm_served: LoadedModel):
    with ServerThread(smollm_served, MODEL, kv_cache_dtype="int8", kv_cache_memory="64MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


def test_streamed_whole_and_cached_answers_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**ASK)
    chunks = client.chat.completions.create(**ASK, stream=True, stream_options={"include_usage": True})
    pieces = list(chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert whole.choices[0].message.content == streamed and len(streamed) > 20
    usage = pieces[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens >= 16  # the first answer's prompt blocks


def test_server_info_names_the_caches_dtype(server: ServerThread) -> None:
    info = httpx.get(f"{server.root_url}/server_info").json()
    assert info["kv_cache_dtype"] == "int8"
    # 64 MiB of 30 layers x 2 x 3 KV heads x (64 + 4) bytes a token, whole blocks of 16
    assert info["max_total_num_tokens"] == 64 * 2**20 // (30 * 2 * 3 * 68) // 16 * 16

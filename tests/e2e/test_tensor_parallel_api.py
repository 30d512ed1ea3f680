"""The API over two tensor-parallel ranks, through the openai SDK: streaming and not, a json_schema answer, a tool
call, n=2, logprobs, a prefix-cache hit; a rank killed turns /health to 503 and ends the server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import transformers
from helpers import CHATML, ServerThread, openai_client, save_random_hf_model

from tokenmill.config import ServerConfig

MODEL = "tiny-tp"
ASK = [{"role": "user", "content": "Pick a color for the sky, and say why in a few words."}]
# The random model's bytes are its tokens: kept off whitespace, which JSON allows anywhere and it would favour
NO_WHITESPACE = {str(ord(c)): -100 for c in " \t\n\r"}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-model")
    save_random_hf_model(path, transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2), norm_noise=0.3)
    (path / "chat_template.jinja").write_text(CHATML)
    return path


@pytest.fixture(scope="module")
def server(folder: Path):
    with ServerThread(None, MODEL, ServerConfig(tool_call_parser="hermes"),  # type: ignore[arg-type]
                      model=str(folder), tensor_parallel_size=2, dtype="float32", device="cpu", threads=1,
                      max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)


def test_streamed_and_whole_answers_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == 24


def test_a_json_schema_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=60, logit_bias=NO_WHITESPACE,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}})
    assert json.loads(reply.choices[0].message.content)["color"] in ("red", "blue")


def test_a_forced_tool_call(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "paint", "parameters": COLOR}}]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=80, logit_bias=NO_WHITESPACE)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "paint" and json.loads(call.function.arguments)["color"] in ("red", "blue")


def test_n2_with_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, n=2, temperature=1.0, seed=3, max_tokens=8,
                                           logprobs=True, top_logprobs=2)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert len(entries) == 8 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_a_repeated_prompt_hits_the_prefix_cache(client: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "a shared system prompt, " * 20}]
    first = client.chat.completions.create(model=MODEL, messages=long, temperature=0, max_tokens=4)
    again = client.chat.completions.create(model=MODEL, messages=long, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == again.choices[0].message.content


def test_the_dashboards_data_shows_the_ranks(server: ServerThread) -> None:
    ranks = httpx.get(f"{server.root_url}/stats").json()["tensor_parallel"]
    assert ranks["size"] == 2 and [r["up"] for r in ranks["ranks"]] == [True, True]
    assert ranks["collectives"] == "shared memory"


def test_server_info_says_what_a_gateway_reads(server: ServerThread) -> None:
    info = httpx.get(f"{server.root_url}/server_info").json()
    assert info["tp_size"] == 2 and info["served_model_name"] == MODEL


def test_zz_a_killed_rank_turns_health_to_503_and_ends_the_server(server: ServerThread) -> None:
    """Last in the module: it ends the module's server."""
    assert httpx.get(f"{server.root_url}/health").status_code == 200
    tp = server.engine.tensor_parallel
    assert tp is not None
    tp.workers[0].kill()
    killed = time.monotonic()
    status = 200
    while time.monotonic() - killed < 2:
        try:
            status = httpx.get(f"{server.root_url}/health", timeout=1).status_code
        except httpx.TransportError:  # the server has ended already
            status = 503
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503
    server.thread.join(timeout=10)
    assert not server.thread.is_alive() and server.server.exit_code == 1

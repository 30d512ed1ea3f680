"""POST /v1/embeddings through the unmodified `openai` SDK against a live server on the default model."""

from __future__ import annotations

import base64
import struct
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import ServerThread, assert_no_live_blocks

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


def test_inputs_of_every_shape_give_unit_vectors_in_order(client: openai.OpenAI, server: ServerThread) -> None:
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten slept on the rug."]
    listed = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in listed.data] == [0, 1, 2] and listed.model == MODEL
    vectors = torch.tensor([d.embedding for d in listed.data])
    assert vectors.shape == (3, server.engine.hidden_size)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    tokenizer = server.engine.tokenizer
    assert listed.usage.prompt_tokens == listed.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    one = client.embeddings.create(model=MODEL, input=texts[2]).data[0].embedding
    as_ids = client.embeddings.create(model=MODEL, input=tokenizer.encode(texts[2])).data[0].embedding
    assert torch.allclose(torch.tensor(one), vectors[2], atol=1e-5) and one == as_ids
    b64 = httpx.post(f"{server.base_url}/embeddings", timeout=60,
                     json={"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    decoded = [struct.unpack(f"<{len(one)}f", base64.b64decode(d["embedding"])) for d in b64["data"]]
    assert torch.equal(torch.tensor(decoded), vectors)
    assert client.embeddings.create(model=MODEL, input=texts[0], dimensions=len(one)).data[0].embedding
    assert_no_live_blocks(server.engine)


def test_lists_of_token_ids_embed_each_as_its_text_would(client: openai.OpenAI, server: ServerThread) -> None:
    texts = ["Hello there.", "Embeddings are pooled hidden states of the model's final layer."]
    ids = [server.engine.tokenizer.encode(t) for t in texts]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float", user="someone")
    # left out, encoding_format is base64 as the SDK sends it (it decodes the float32s): the same numbers
    by_text = client.embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in by_text.data]
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == sum(map(len, ids))
    assert_no_live_blocks(server.engine)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"), ({"input": [[1, 2], []]}, "input"), ({"input": ["a", 1]}, "input"),
    ({"input": [10**9]}, "input"), ({"input": [[5], [-1]]}, "input"), ({"input": ["a"] * 257}, "input"),
    ({"input": "a", "dimensions": 7}, "dimensions"), ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"), ({"input": "a " * 20000}, "input"),
    ({"input": "a", "pooling": "mean"}, "pooling"),
])
def test_bad_inputs_are_400s_naming_the_field(server: ServerThread, body: dict, param: str) -> None:
    response = httpx.post(f"{server.base_url}/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    # a value that fits none of a union's forms is named with pydantic's path, e.g. input.str (api/errors.py)
    assert response.json()["error"]["param"].split(".")[0] == param
    assert_no_live_blocks(server.engine)


TRIPLES = [("The cat sat on the mat.", "A kitten slept on the rug.", "Stock markets fell sharply today."),
           ("How do I bake bread?", "What is a good recipe for a loaf of bread?", "The train leaves at noon."),
           ("Paris is the capital of France.", "France's capital city is Paris.", "Photosynthesis needs sunlight."),
           ("I love playing football.", "Soccer is my favourite sport.", "The stock price rose by ten percent.")]


@pytest.mark.parametrize(("related", "paraphrase", "unrelated"), TRIPLES)
def test_related_sentences_are_closer_than_unrelated_ones(client: openai.OpenAI, related: str, paraphrase: str,
                                                          unrelated: str) -> None:
    """With the default model (not an embedding model) and last pooling: measured 0.94-0.98 for the pairs against
    0.73-0.86 for the unrelated sentence."""
    data = client.embeddings.create(model=MODEL, input=[related, paraphrase, unrelated]).data
    a, b, u = (torch.tensor(d.embedding) for d in data)
    assert float(a @ b) > max(float(a @ u), float(b @ u))


def test_an_unknown_model_is_a_404(server: ServerThread) -> None:
    response = httpx.post(f"{server.base_url}/embeddings", json={"model": "nope", "input": "a"}, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_chat_answer_runs_alongside_embeddings(client: openai.OpenAI, server: ServerThread) -> None:
    """Embeddings of 32 inputs share the engine's steps with a chat answer being streamed: both complete, the
    answer whole and each vector as it is alone."""
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    chat: dict = {}

    def answer() -> None:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        chunks = list(stream)
        chat["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        chat["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    texts = [f"Sentence number {i} is about {topic}." for i, topic in enumerate(["cats", "stocks", "bread"] * 11)]
    alone = client.embeddings.create(model=MODEL, input=texts[:3]).data
    thread = threading.Thread(target=answer)
    thread.start()
    deadline = time.time() + 30
    while server.engine.num_unfinished == 0 and time.time() < deadline:  # the answer has started
        time.sleep(0.01)
    together = client.embeddings.create(model=MODEL, input=texts[:32]).data
    still_answering = thread.is_alive()
    thread.join(120)
    assert chat["finish"] == "length" and chat["text"]
    assert still_answering  # the embeddings really shared the engine with the answer
    assert [d.index for d in together] == list(range(32))
    for a, b in zip(alone, together[:3], strict=True):
        assert float(torch.tensor(a.embedding) @ torch.tensor(b.embedding)) > 0.9999
    assert_no_live_blocks(server.engine)


def test_a_client_that_leaves_frees_every_sequence(server: ServerThread) -> None:
    body = {"model": MODEL, "input": ["A long input that takes a while to embed. " * 40] * 64}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/embeddings", json=body, timeout=httpx.Timeout(60, read=0.5))
    deadline = time.time() + 60
    while server.engine.num_unfinished and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.num_unfinished == 0
    assert_no_live_blocks(server.engine)

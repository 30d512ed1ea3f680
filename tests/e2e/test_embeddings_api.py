"""POST /v1/embeddings through the unmodified `openai` SDK against a live server on the default model."""

from __future__ import annotations

import base64
import struct

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


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [10**9]}, "input"), ({"input": "a", "dimensions": 7}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"), ({"input": "a " * 20000}, "input"),
])
def test_bad_inputs_are_400s_naming_the_field(server: ServerThread, body: dict, param: str) -> None:
    response = httpx.post(f"{server.base_url}/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
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

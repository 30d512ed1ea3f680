"""LoRA adapters over the API, through the openai SDK: each adapter is a model of /v1/models whose parent is the
base; vLLM's routes load and unload adapters at run time, within the cap, refusing what does not fit with the
reason; and a hundred loads and unloads while streams run lose nothing and give their memory back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType
from helpers import ServerThread, openai_client, write_tiny_gguf

from tokenmill.bench.adapters import write_adapter
from tokenmill.config import WeightPlan
from tokenmill.hosting.pool import resident_bytes
from tokenmill.loader import load_model

MODEL = "tiny"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("lora-api")
    gguf = write_tiny_gguf(folder / "q8.gguf", qtype=GGMLQuantizationType.Q8_0, hidden=256, context_length=4096)
    config = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu")).config
    return gguf, [write_adapter(folder / f"a{i}", config, rank=8, seed=i, scale=0.1) for i in range(3)]


@pytest.fixture
def server(files: tuple[Path, list[Path]]) -> Iterator[ServerThread]:
    gguf, adapters = files
    loaded = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu"))  # its own: LoRA adapts the model
    with ServerThread(loaded, MODEL, threads=2, kv_cache_memory="16MiB", lora=(f"a0={adapters[0]}",),
                      max_loras=2, max_lora_rank=8) as srv:
        yield srv


def complete(client: openai.OpenAI, model: str, prompt: str = "1 2 3", tokens: int = 12) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def post(srv: ServerThread, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/{route}", json=body, timeout=60)


def test_an_adapter_is_a_model_whose_parent_is_the_base(server: ServerThread, files: tuple[Path, list[Path]]) -> None:
    client = openai_client(server)
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert set(cards) == {MODEL, "a0"}
    assert cards["a0"]["parent"] == MODEL and cards["a0"]["root"] == str(files[1][0])  # type: ignore[index]
    adapted, plain = complete(client, "a0"), complete(client, MODEL)
    assert adapted.model == "a0" and plain.model == MODEL
    assert adapted.choices[0].text != plain.choices[0].text
    chat = client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "a0"


def test_adapters_load_and_unload_through_vllms_routes(server: ServerThread, files: tuple[Path, list[Path]]) -> None:
    client = openai_client(server)
    loaded = post(server, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(files[1][1])})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'a1' added successfully."
    assert "a1" in {m.id for m in client.models.list().data}
    first = complete(client, "a1").choices[0].text
    refused = post(server, "load_lora_adapter", {"lora_name": "a2", "lora_path": str(files[1][2])})
    assert refused.status_code == 400 and "as many as --max-loras allows" in refused.json()["error"]["message"]
    assert post(server, "unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "a1")
    assert post(server, "unload_lora_adapter", {"lora_name": "a1"}).status_code == 404
    assert post(server, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(files[1][1])}).status_code == 200
    assert complete(client, "a1").choices[0].text == first


@pytest.mark.parametrize(("body", "status", "said"), [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "has no adapter_config.json"),
    ({"lora_name": MODEL, "lora_path": "/a"}, 400, "the name tiny is taken"),
    ({"lora_name": "a0", "lora_path": "/a"}, 400, "the name a0 is taken"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": "x", "lora_path": "/a", "base_model_name": "nope"}, 404, "does not exist"),
    ({"lora_name": "x", "lora_path": "/a", "colour": 1}, 400, "colour"),
])
def test_a_load_that_cannot_work_is_refused_with_the_reason(server: ServerThread, body: dict, status: int,
                                                            said: str) -> None:
    answer = post(server, "load_lora_adapter", body)
    assert answer.status_code == status and said in answer.text
    assert httpx.get(server.root_url + "/health").status_code == 200


def test_an_adapter_with_other_shapes_is_refused_naming_the_projection(server: ServerThread,
                                                                       tmp_path: Path) -> None:
    other = load_model(str(write_tiny_gguf(tmp_path / "other.gguf")), WeightPlan(dtype="float32", device="cpu"))
    folder = write_adapter(tmp_path / "other", other.config, rank=4, seed=0)  # of a model of 64 features, not 256
    answer = post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(folder)})
    assert answer.status_code == 400
    said = answer.json()["error"]
    assert said["param"] == "lora_path"
    assert "layer 0 down_proj: lora_A (4, 256) and lora_B (64, 4) do not fit the model's projection of 256 -> 256" \
        in said["message"]


def test_a_hundred_loads_and_unloads_while_streams_run_lose_nothing(server: ServerThread,
                                                                    files: tuple[Path, list[Path]]) -> None:
    client = openai_client(server)
    requests = [(MODEL, "5 6 7"), ("a0", "5 6 7"), (MODEL, "8 9"), ("a0", "8 9")]
    alone = [complete(client, model, prompt, 300).choices[0].text for model, prompt in requests]
    results: list[str | None] = [None] * len(requests)

    def stream(i: int) -> None:
        model, prompt = requests[i]
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=300, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    def cycle(count: int) -> None:
        for _ in range(count):
            assert post(server, "load_lora_adapter", {"lora_name": "t", "lora_path": str(files[1][1])}).status_code \
                == 200
            assert complete(client, "t", tokens=2).model == "t"
            assert post(server, "unload_lora_adapter", {"lora_name": "t"}).status_code == 200

    cycle(10)  # the allocator's pools warm up once
    before = resident_bytes()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    cycle(100)
    for t in threads:
        t.join()
    assert results == alone
    grown = resident_bytes() - before
    assert grown < 32 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB over 100 loads"
    assert {m.id for m in client.models.list().data} == {MODEL, "a0"}
    assert server.engine.lora is not None and server.engine.lora.users.total() == 0

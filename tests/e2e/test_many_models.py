"""Several models on one server, through the openai SDK: each answers as it does alone; under a memory budget that
holds two, a request for a third loads it and unloads the least recently used idle one, never one with a stream in
flight; keep_alive unloads an idle model; and the memory of the unloaded models comes back."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import ServerThread, hf_configs, openai_client, save_random_hf_model, write_tiny_gguf

from tokenmill.config import EngineConfig, ServerConfig, WeightPlan
from tokenmill.hosting.pool import ModelPool
from tokenmill.hosting.specs import ModelSpec
from tokenmill.loader import load_model

KV = "4MiB"  # each model's KV memory (4,096 tokens of theirs, what they need): most of their footprint
PROMPTS = ["The quick brown fox", "1, 2, 3,", "Once upon a time"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three different models: two tiny GGUFs of different weights, and a tiny Qwen3 HF folder."""
    folder = tmp_path_factory.mktemp("many")
    hf = folder / "qwen3"
    save_random_hf_model(hf, hf_configs()["qwen3"])
    return {"a": write_tiny_gguf(folder / "a.gguf", seed=1, context_length=4096),
            "b": write_tiny_gguf(folder / "b.gguf", seed=2, context_length=4096),
            "c": hf}


def spec(name: str, source: Path, keep_alive: float | None = None) -> ModelSpec:
    # as many sequences as fill KV's 4,096 tokens at the model's context (Qwen3's is 256): its memory is all used,
    # so the pool's estimate before a first load (files and KV) is near what it measures after
    seqs = 16 if source.is_dir() else 4
    return ModelSpec(name, EngineConfig(model=str(source), dtype="float32", threads=1, kv_cache_memory=KV,
                                        max_num_seqs=seqs), keep_alive=keep_alive)


def footprint(source: Path) -> int:
    """One model's footprint as the pool measures it: its weights and its KV memory."""
    pool = ModelPool([spec("x", source)])
    pool.preload()
    size = pool.first.footprint
    assert pool.first.engine is not None
    pool.first.engine.stop()
    return size


@pytest.fixture(scope="module")
def budget(sources: dict[str, Path]) -> int:
    """Room for any two of the three models, never for all three."""
    sizes = sorted(footprint(path) for path in sources.values())
    return sizes[1] + sizes[2] + (sizes[0] // 2)


@pytest.fixture
def server(sources: dict[str, Path], budget: int) -> Iterator[ServerThread]:
    pool = ModelPool([spec(name, path) for name, path in sources.items()], budget, load_timeout=3)
    with ServerThread(pool, server_config=ServerConfig(keep_alive="-1")) as srv:
        yield srv


def states(srv: ServerThread) -> dict[str, str]:
    return {m["id"]: m["status"]["state"] for m in httpx.get(srv.base_url + "/models").json()["data"]}


def complete(client: openai.OpenAI, model: str, prompt: str, **extra) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body=extra or None).choices[0].text


def test_interleaved_requests_get_what_each_model_gives_alone(sources: dict[str, Path], budget: int) -> None:
    alone = {}
    for name, path in sources.items():
        loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
        seqs = spec(name, path).engine.max_num_seqs
        with ServerThread(loaded, name, threads=1, kv_cache_memory=KV, max_num_seqs=seqs) as srv:
            alone[name] = [complete(openai_client(srv), name, p) for p in PROMPTS]
    pool = ModelPool([spec(name, path) for name, path in sources.items()], budget * 2)  # all three fit
    with ServerThread(pool) as srv:
        client = openai_client(srv)
        results: dict[str, list[str]] = {name: [] for name in sources}
        threads = [threading.Thread(target=lambda n=name: results[n].extend(complete(client, n, p) for p in PROMPTS))
                   for name in sources]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == alone
    assert len({tuple(v) for v in alone.values()}) == 3  # three models that answer differently


def test_a_third_model_loads_in_place_of_the_least_recently_used_idle_one(server: ServerThread) -> None:
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}  # what fits, in order, at start
    client = openai_client(server)
    complete(client, "b", "hi")
    complete(client, "a", "hi")  # b is now the least recently used
    complete(client, "c", "hi")
    assert states(server) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    complete(client, "b", "hi")  # a is the least recently used now
    assert states(server) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
    loads = {m["id"]: m["status"]["loads"] for m in httpx.get(server.base_url + "/models").json()["data"]}
    assert loads == {"a": 1, "b": 2, "c": 1}


def test_a_model_with_a_stream_in_flight_never_unloads(server: ServerThread) -> None:
    client = openai_client(server)
    complete(client, "b", "hi")  # a was used first: the least recently used, but streaming from now on
    stream = client.completions.create(model="a", prompt="Count:", max_tokens=4000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    complete(client, "c", "hi")  # needs room: b goes, idle, though a was used before it
    assert states(server) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    complete(client, "b", "hi")  # needs room again: c goes
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    with client.completions.create(model="b", prompt="Count:", max_tokens=4000, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}) as second:
        next(iter(second))
        with pytest.raises(openai.APIStatusError) as refused:  # both busy: c waits for room, then 503
            complete(client, "c", "hi")
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"
        assert refused.value.body["code"] == "model_not_loaded"  # type: ignore[index]
    stream.close()
    # The streams are over once the server sees their clients leave (on a loaded machine that can outlast one
    # request's 3 s wait): then c loads, its load having gone on after the 503, for the retry.
    deadline = time.monotonic() + 20
    while True:
        try:
            complete(client, "c", "hi")
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline
    assert states(server)["c"] == "loaded"


def test_keep_alive_unloads_an_idle_model_and_a_request_may_set_its_own(server: ServerThread) -> None:
    client = openai_client(server)
    complete(client, "a", "hi", keep_alive=0)
    deadline = time.time() + 5
    while states(server)["a"] != "unloaded" and time.time() < deadline:
        time.sleep(0.05)
    assert states(server)["a"] == "unloaded"
    assert gc.get_freeze_count() > 0  # stopping a's engine thawed the heap; the pool set it aside again for b's
    complete(client, "b", "hi", keep_alive="1h")
    time.sleep(0.6)
    assert states(server)["b"] == "loaded"
    for bad in ("soon", True, "5 m"):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(client, "b", "hi", keep_alive=bad)
        assert refused.value.body["param"] == "keep_alive"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        complete(client, "d", "hi")
    assert httpx.get(server.base_url + "/models/d").status_code == 404
    assert httpx.get(server.base_url + "/models/a").json()["status"]["loaded"] is False


def test_models_loaded_and_unloaded_in_turn_give_their_memory_back(sources: dict[str, Path]) -> None:
    """Two models in a budget of one: every request for the other unloads one and loads the other. What the
    process holds stays where the first rounds left it (the allocator's pools warm up once)."""
    one = max(footprint(sources["a"]), footprint(sources["b"]))
    pool = ModelPool([spec("a", sources["a"]), spec("b", sources["b"])], one + one // 2)
    from tokenmill.hosting.pool import resident_bytes

    with ServerThread(pool) as srv:
        client = openai_client(srv)
        rss = []
        for round_ in range(12):
            assert complete(client, "ab"[round_ % 2], "hi")
            rss.append(resident_bytes())
        assert states(srv) == {"a": "unloaded", "b": "loaded"}
        loads = {m["id"]: m["status"]["loads"] for m in httpx.get(srv.base_url + "/models").json()["data"]}
    assert loads == {"a": 6, "b": 6}
    grown = rss[-1] - rss[3]
    assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB over 8 loads: {rss}"


def test_metrics_label_each_model(server: ServerThread) -> None:
    complete(openai_client(server), "a", "hi")
    text = httpx.get(server.root_url + "/metrics").text
    assert 'tokenmill:generation_tokens_total{model_name="a"}' in text
    assert 'tokenmill:model_loaded{model_name="c"} 0.0' in text
    assert 'tokenmill:model_loaded{model_name="a"} 1.0' in text

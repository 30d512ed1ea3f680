"""LoRA adapters against PEFT on tiny random bases and random adapters made at test time: each adapter's greedy
tokens are its merged model's (fp32); requests for different adapters and the base share steps and each gets what it
gets alone; the fused decode layer adds the adapters as the op-by-op path does; KV is never shared across adapters."""

from __future__ import annotations

import dataclasses
import json
import queue
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import hf_configs, save_random_hf_model, save_two_layer_gemma3, write_tiny_gguf

from tokenmill import backend
from tokenmill.bench.adapters import write_adapter
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.layers import lora as lora_layer
from tokenmill.loader import load_model
from tokenmill.loader.lora import load_adapter
from tokenmill.sampling import SamplingParams

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 200, 1], [250, 12, 64, 9, 33, 81]]
TOKENS = 12


def run(engine: Engine, requests: list[tuple[list[int], str | None]], tokens: int = TOKENS) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter), submitted together so that they share steps."""
    return [[t for t, _ in answer] for answer in run_logprobs(engine, requests, tokens)]


def run_logprobs(engine: Engine, requests: list[tuple[list[int], str | None]],
                 tokens: int = TOKENS) -> list[list[tuple[int, float]]]:
    """run's tokens, each with its logprob."""
    outputs: queue.Queue = queue.Queue()
    ids = [engine.add(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0),
                      outputs.put, lora=adapter) for prompt, adapter in requests]
    got: dict[int, list[tuple[int, float]]] = {i: [] for i in ids}
    done = 0
    while done < len(ids):
        out = outputs.get(timeout=120)
        assert out.error is None, out.error
        got[out.seq_id] += [(t, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        done += out.finish_reason is not None
    return [got[i] for i in ids]


def engine_of(model: Path, **config) -> Engine:
    engine = Engine(EngineConfig(model=str(model), dtype="float32", threads=2, kv_cache_memory="16MiB", **config))
    engine.start()
    return engine


# (family, PEFT settings): every projection, attention only with rsLoRA, MLP only with an alpha pattern
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]),
    "attention-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp-patterns": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                         rank_pattern={"down_proj": 2}, alpha_pattern={"up_proj": 4}),
}


@pytest.fixture(scope="module", params=["qwen3", "llama3-rope", "gemma3"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":  # a sliding layer and a global one, q/k norms and the sandwich norms
        save_two_layer_gemma3(folder, head_dim=32)
    else:
        save_random_hf_model(folder, hf_configs()[request.param], norm_noise=0.1)
    return folder


def peft_adapter(base: Path, folder: Path, settings: dict, seed: int) -> tuple[list[list[int]], list[float]]:
    """A random PEFT adapter on base saved into folder; returns its merged model's greedy tokens of PROMPTS and the
    logprob of each one's first."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0, 1.0)
    adapted.save_pretrained(folder)
    merged = adapted.merge_and_unload()
    with torch.no_grad():
        first = [float(merged(torch.tensor([p])).logits[0, -1].log_softmax(-1).max()) for p in PROMPTS]
    return greedy(merged), first


def greedy(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy tokens of PROMPTS, TOKENS of each whatever they are (the engine runs with ignore_eos:
    EOS neither stops nor is suppressed)."""
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in PROMPTS]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_each_adapter_gives_its_merged_models_tokens(base: Path, tmp_path: Path, kernel: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:  # the products as two matmuls and a mask, as where the C++ kernels do not run
        monkeypatch.setattr(lora_layer.backend, "cpu_kernels", lambda device: False)
    expected = {name: peft_adapter(base, tmp_path / name, settings, seed)
                for seed, (name, settings) in enumerate(ADAPTERS.items())}
    engine = engine_of(base, lora=tuple(f"{name}={tmp_path / name}" for name in ADAPTERS))
    try:
        plain = run_logprobs(engine, [(p, None) for p in PROMPTS])
        for name, (tokens, first) in expected.items():
            answers = run_logprobs(engine, [(p, name) for p in PROMPTS])
            assert [[t for t, _ in a] for a in answers] == tokens, name
            ours = [a[0][1] for a in answers]
            assert ours == pytest.approx(first, abs=1e-4), name
            # the adapter changes the numbers (Gemma's tiny model repeats its prompt's last token whatever they are)
            assert max(abs(a[0][1] - b[0][1]) for a, b in zip(answers, plain, strict=True)) > 1e-2, name
        assert [[t for t, _ in a] for a in plain] == greedy(
            transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A tiny Q8_0 GGUF (the fused decode layer runs it) and four random rank-8 adapters of it."""
    folder = tmp_path_factory.mktemp("lora-q8")
    gguf = write_tiny_gguf(folder / "q8.gguf", qtype=GGMLQuantizationType.Q8_0, hidden=256)
    config = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu")).config
    return gguf, [write_adapter(folder / f"a{i}", config, rank=8, seed=i, scale=0.1) for i in range(4)]


def test_a_batch_over_four_adapters_and_the_base_gives_each_request_its_tokens_alone(
        quantized: tuple[Path, list[Path]]) -> None:
    gguf, adapters = quantized
    names = [None, "a0", "a1", "a2", "a3"]
    requests = [([3 + i, 11, 40 + 2 * i, 7], names[i % 5]) for i in range(16)]
    engine = engine_of(gguf, lora=tuple(f"a{i}={path}" for i, path in enumerate(adapters)), max_loras=4,
                       max_lora_rank=8)
    try:
        alone = [run(engine, [request])[0] for request in requests]
        together = run(engine, requests)
        assert together == alone
        assert len({tuple(alone[i]) for i in range(5)}) == 5  # five models: five answers to the prompts' kin
    finally:
        engine.stop()


def test_the_fused_decode_layer_adds_the_adapters_as_the_op_by_op_path_does(
        quantized: tuple[Path, list[Path]]) -> None:
    if not backend.vector_kernels(torch.device("cpu")):
        pytest.skip("no fused decode layer here: without the vector kernels, GGUF weights load dense")
    gguf, adapters = quantized
    requests = [([3 + i, 11, 40 + 2 * i, 7], f"a{i % 4}" if i % 3 else None) for i in range(8)]
    answers = []
    for fused in (True, False):
        engine = engine_of(gguf, lora=tuple(f"a{i}={path}" for i, path in enumerate(adapters)),
                           max_lora_rank=8, fused_decode_layers=fused)
        try:
            assert (engine.loaded.model.model.fused_decode is not None) == fused  # type: ignore[union-attr]
            answers.append(run(engine, requests, tokens=24))
        finally:
            engine.stop()
    assert answers[0] == answers[1]


def test_the_prefix_cache_never_shares_kv_between_adapters(quantized: tuple[Path, list[Path]]) -> None:
    gguf, adapters = quantized
    engine = engine_of(gguf, lora=(f"a0={adapters[0]}", f"a1={adapters[1]}"), max_lora_rank=8, block_size=16)
    prompt = list(range(3, 60))  # three full blocks and more

    def cached(adapter: str | None) -> int:
        outputs: queue.Queue = queue.Queue()
        engine.add(prompt, SamplingParams(max_tokens=2, temperature=0), outputs.put, lora=adapter)
        while (out := outputs.get(timeout=60)).finish_reason is None:
            pass
        return out.cached_tokens

    try:
        assert cached("a0") == 0
        assert cached("a1") == 0 and cached(None) == 0  # the same tokens, another adapter's KV: not shared
        assert cached("a0") == 48 and cached("a1") == 48 and cached(None) == 48  # each its own, from now on
        engine.unload_lora("a1")
        engine.load_lora("a1", str(adapters[1]))
        assert cached("a1") == 0  # loaded again: a new namespace (its weights could have changed on disk)
    finally:
        engine.stop()


def test_adapters_load_and_unload_at_run_time_within_the_cap(quantized: tuple[Path, list[Path]]) -> None:
    gguf, adapters = quantized
    engine = engine_of(gguf, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        engine.load_lora("x", str(adapters[0]))
        engine.load_lora("y", str(adapters[1]))
        with pytest.raises(Exception, match="2 LoRA adapters are loaded"):
            engine.load_lora("z", str(adapters[2]))
        with pytest.raises(Exception, match="already loaded"):
            engine.load_lora("x", str(adapters[0]))
        first = run(engine, [([5, 6, 7], "x")])
        engine.unload_lora("x")
        assert engine.lora_adapters() == ["y"]
        with pytest.raises(Exception, match="is not loaded"):
            engine.unload_lora("x")
        assert run(engine, [([5, 6, 7], "y")]) != first
        engine.load_lora("x", str(adapters[0]))  # the freed slot, zeroed and filled again
        assert run(engine, [([5, 6, 7], "x")]) == first
        outputs: queue.Queue = queue.Queue()
        engine.add([1, 2], SamplingParams(max_tokens=2), outputs.put, lora="gone")
        assert outputs.get(timeout=30).error == "the LoRA adapter gone is not loaded"
    finally:
        engine.stop()


def adapter_folder(folder: Path, config, **changes) -> Path:
    """A valid rank-4 adapter of config, then its files changed: settings merged into adapter_config.json,
    tensors replaced ("key": tensor) or removed ("key": None)."""
    write_adapter(folder, config, rank=4, seed=0)
    settings = json.loads((folder / "adapter_config.json").read_text())
    settings.update(changes.pop("settings", {}))
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    if changes.get("tensors"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "adapter_model.safetensors"))
        for key, value in changes["tensors"].items():
            if value is None:
                tensors.pop(key)
            else:
                tensors[key] = value
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("changes", "said"), [
    ({"tensors": {f"{Q}.lora_A.weight": torch.zeros(4, 100)}}, "do not fit the model's projection of 64 -> 64"),
    ({"tensors": {f"{Q}.lora_B.weight": torch.zeros(64, 3)}}, "do not fit"),
    ({"tensors": {f"{Q}.lora_B.weight": None}}, "layer 0 q_proj: lora_B is missing"),
    ({"tensors": {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 64)}},
     "no LoRA factor of a projection this server can adapt"),
    ({"tensors": {"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}},
     "the model has 2 layers"),
    ({"settings": {"use_dora": True}}, "DoRA is not supported"),
    ({"settings": {"bias": "all"}}, "bias 'all'"),
    ({"settings": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"settings": {"peft_type": "IA3"}}, "peft_type IA3 is not LORA"),
])
def test_an_adapter_that_does_not_fit_is_refused_with_the_reason(tmp_path: Path, changes: dict, said: str) -> None:
    config = load_model(str(write_tiny_gguf(tmp_path / "m.gguf")), WeightPlan(dtype="float32", device="cpu")).config
    folder = adapter_folder(tmp_path / "adapter", config, **changes)
    with pytest.raises(ModelFormatError, match=said):
        load_adapter("bad", folder, config, max_rank=16)


def test_an_adapter_beyond_the_rank_or_without_files_is_refused(tmp_path: Path) -> None:
    config = load_model(str(write_tiny_gguf(tmp_path / "m.gguf")), WeightPlan(dtype="float32", device="cpu")).config
    folder = adapter_folder(tmp_path / "adapter", config)
    with pytest.raises(ModelFormatError, match="rank 4 is more than --max-lora-rank 2"):
        load_adapter("big", folder, config, max_rank=2)
    with pytest.raises(ModelFormatError, match="has no adapter_config.json and adapter_model.safetensors"):
        load_adapter("none", tmp_path, config, max_rank=16)


def test_a_bad_lora_flag_stops_the_start_before_or_while_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--lora x: give NAME=PATH"):
        EngineConfig(lora=("x",)).check()
    with pytest.raises(ConfigError, match="not served with --tensor-parallel-size"):
        EngineConfig(lora=("x=/y",), tensor_parallel_size=2).check()
    engine = Engine(EngineConfig(model=str(write_tiny_gguf(tmp_path / "m.gguf")), dtype="float32",
                                 lora=(f"x={tmp_path}",), kv_cache_memory="8MiB"))
    with pytest.raises(ModelFormatError, match="LoRA adapter x"):
        engine.start()


# PEFT's module names as llama.cpp names the base's tensors
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def llama_cpp_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k permutation of a Llama's rows (rotate-half pairs to interleaved ones)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf_adapter(path: Path, peft_folder: Path, heads: int, kv_heads: int, alpha: float) -> Path:
    """A PEFT adapter of a Llama as llama.cpp's convert_lora_to_gguf.py writes it: blk.N.attn_q.weight.lora_a and
    .lora_b, B's q and k rows permuted as the base's are, the alpha in adapter.lora.alpha."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in load_file(str(peft_folder / "adapter_model.safetensors")).items():
        parts = key.split(".")  # base_model.model.model.layers.N.(self_attn|mlp).MODULE.lora_(A|B).weight
        layer, module, half = parts[4], parts[6], parts[7]
        if half == "lora_B" and module in ("q_proj", "k_proj"):
            tensor = llama_cpp_permute(tensor, heads if module == "q_proj" else kv_heads)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{half[-1].lower()}", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_adapter_as_llama_cpp_writes_it_is_its_peft_folders_twin(quantized: tuple[Path, list[Path]],
                                                                       tmp_path: Path) -> None:
    gguf, adapters = quantized
    config = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu")).config
    twin = write_gguf_adapter(tmp_path / "a0.gguf", adapters[0], config.num_heads, config.num_kv_heads, alpha=16.0)
    peft_adapter_, gguf_adapter = (load_adapter("a", path, config, max_rank=8) for path in (adapters[0], twin))
    assert peft_adapter_.factors.keys() == gguf_adapter.factors.keys()
    for key, (a, b) in peft_adapter_.factors.items():  # q and k's B back in Hugging Face's row order
        assert torch.equal(a, gguf_adapter.factors[key][0]) and torch.equal(b, gguf_adapter.factors[key][1]), key
    engine = engine_of(gguf, lora=(f"peft={adapters[0]}", f"gguf={twin}"), max_lora_rank=8)
    try:
        prompts = [[3, 11, 40, 7], [9, 9, 2]]
        assert run(engine, [(p, "peft") for p in prompts]) == run(engine, [(p, "gguf") for p in prompts])
    finally:
        engine.stop()
    with pytest.raises(ModelFormatError, match="is no LoRA adapter"):
        load_adapter("model", gguf, config, max_rank=8)  # a model's GGUF, not an adapter's


def test_a_gguf_adapter_of_another_architecture_is_refused(quantized: tuple[Path, list[Path]],
                                                           tmp_path: Path) -> None:
    gguf, adapters = quantized
    config = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu")).config
    twin = write_gguf_adapter(tmp_path / "a0.gguf", adapters[0], config.num_heads, config.num_kv_heads, alpha=16.0)
    qwen3 = dataclasses.replace(config, architecture="qwen3")
    with pytest.raises(ModelFormatError, match="an adapter of a llama model; the model is qwen3"):
        load_adapter("a", twin, qwen3, max_rank=8)

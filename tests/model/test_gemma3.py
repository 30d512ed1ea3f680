"""Gemma 3 against transformers: the real 270M GGUF, and tiny random models (a Hugging Face folder and a GGUF
written from the same weights) whose prompts run past the sliding window; the engine's features on them."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_no_live_blocks,
    counted,
    generate,
    gguf_read_once,
    our_logits,
    save_random_hf_model,
    start_engine,
    write_gguf,
)

from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.config import WeightPlan
from tokenmill.engine.request import SequenceOutput
from tokenmill.layers.attention import SequenceSlice
from tokenmill.loader import LoadedModel, load_model
from tokenmill.loader.sources import pull
from tokenmill.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 8
TOLERANCE = 1e-4  # measured: ~1e-6 on the tiny models
PROMPT = list(range(3, 43))  # 40 tokens: five windows


def tiny_config(query_pre_attn_scalar: int) -> object:
    """Six layers, the sixth global (Gemma 3's pattern, which a GGUF implies); the global RoPE base far from the
    sliding layers' 10,000, so that a swap of the two shows."""
    return transformers.Gemma3TextConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=query_pre_attn_scalar,
        max_position_embeddings=256, initializer_range=0.2, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """query_pre_attn_scalar 24, not head_dim: the scale must come from the config."""
    path = tmp_path_factory.mktemp("gemma3-hf")
    save_random_hf_model(path, tiny_config(24), norm_noise=0.3)
    return path


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Hugging Face folder and the GGUF llama.cpp's converter would write from it (norms as 1 + w, its names;
    a GGUF names no attention scale: llama.cpp takes head_dim, so the folder does too)."""
    path = tmp_path_factory.mktemp("gemma3-twin")
    save_random_hf_model(path, tiny_config(32), norm_noise=0.3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors: dict[str, np.ndarray] = {}
    for name, value in model.state_dict().items():
        array = value.float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = array
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        elif name.startswith("model.layers."):
            layer, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            tensors[f"blk.{layer}.{names[part]}.weight"] = array
    metadata = {"block_count": 6, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
                "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
                "attention.value_length": 32, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
                "attention.sliding_window": WINDOW}
    return path, write_gguf(path / "twin.gguf", "gemma3", metadata, tensors, chat_template=None)


def reference_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def reference_greedy(folder: Path, ids: list[int], steps: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(ids):].tolist()


def greedy(steps: int) -> SamplingParams:
    return SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)


def test_a_gemma3_folder_matches_transformers_past_the_window(folder: Path) -> None:
    """Norms as x * (1 + w), sandwich norms, the scaled embeddings and unscaled tied head, GeGLU, q/k norms
    before RoPE, both RoPE bases, the window: every position's logits, then decoding far past the window."""
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    assert loaded.config.sliding_layers == (True,) * 5 + (False,)
    diff = (our_logits(loaded, PROMPT) - reference_logits(folder, PROMPT)).abs().max().item()
    assert diff < TOLERANCE, diff
    engine = start_engine(loaded)
    try:
        assert generate(engine, [PROMPT[:5]], [greedy(30)])[0] == reference_greedy(folder, PROMPT[:5], 30)
    finally:
        engine.stop()


def test_a_gemma3_gguf_matches_its_folder(twin: tuple[Path, Path]) -> None:
    """The GGUF's norms hold 1 + w already (adding 1 again would double them), its layer pattern and local RoPE
    base are implied, not stored."""
    folder, gguf = twin
    loaded = load_model(str(gguf), WeightPlan(dtype="float32", device="cpu", quantized=False))
    assert loaded.config.architecture == "gemma3" and loaded.config.sliding_window == WINDOW
    diff = (our_logits(loaded, PROMPT) - reference_logits(folder, PROMPT)).abs().max().item()
    assert diff < TOLERANCE, diff


def last_logits(loaded: LoadedModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """The logits after the prompt, prefilled in chunks of the given sizes (a prefix-cache hit is the same thing
    to the model: the first chunk's KV already in the pool when the rest is computed)."""
    c = loaded.config
    cache = PagedKVCache(KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, loaded.dtype), loaded.device,
                         num_blocks=len(ids) // 16 + 1, block_size=16)
    assert cache.reserve(0, len(ids), len(ids))
    start = 0
    with torch.inference_mode():
        for n in chunks:
            meta = metadata.prepare(cache, [SequenceSlice(0, start, n)])
            hidden = loaded.model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), meta)
            start += n
        assert start == len(ids)
        return loaded.model.compute_logits(hidden[-1:])[0]


def test_the_window_holds_across_chunks_and_prefix_hits(folder: Path) -> None:
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    whole = last_logits(loaded, PROMPT, [40])
    for chunks in ([7] * 5 + [5], [32, 8], [16, 23, 1]):
        assert (last_logits(loaded, PROMPT, chunks) - whole).abs().max().item() < 1e-5, chunks
    # The engine: a prompt whose first 32 tokens are cached gives the tokens it gives uncached.
    prompts = [PROMPT[:32] + [50, 51], PROMPT[:32] + [60, 61, 62]]
    engine = start_engine(loaded, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    try:
        cached = [generate(engine, [p], [greedy(12)])[0] for p in prompts]
        assert counted(engine.metrics.prefix_hits) >= 32
    finally:
        engine.stop()
    engine = start_engine(loaded, prefix_caching=False)
    try:
        assert cached == [generate(engine, [p], [greedy(12)])[0] for p in prompts]
    finally:
        engine.stop()


def one_pool_tokens(loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams],
                    config: dict) -> list[list[int]]:
    """The tokens of the layout where every layer keeps every token (--no-sliding-window-kv): the reference of the
    sliding layers' own pool."""
    engine = start_engine(loaded, sliding_window_kv=False, **config)
    try:
        return generate(engine, prompts, params)
    finally:
        engine.stop()


def test_the_sliding_layers_keep_their_windows_alone(folder: Path) -> None:
    """The five sliding layers' KV in a pool of their own, three blocks of 4 a sequence (a window of 8 keys): the
    tokens of the layout where every layer keeps every token, through chunks, prefix hits, and preemptions when
    the global layer's 40 blocks run short."""
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    prompts = [PROMPT, PROMPT[:20] + [70, 71, 72], PROMPT[5:30], PROMPT[:3]]
    # Sampled, seeded: greedy, this random model repeats a token whatever its attention reads.
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    # 240 KiB: 16 blocks of 4 tokens x 5 sliding layers x 512 bytes (4 sequences' windows, one step's 16 prompt
    # tokens), then 40 of the global layer.
    config = {"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 0,
              "kv_cache_memory": "240KiB"}
    full = one_pool_tokens(loaded, prompts, params, config)
    engine = start_engine(loaded, **config)
    try:
        kv = engine.kv_cache
        assert isinstance(kv, PagedKVCache) and kv.sliding is not None
        assert (kv.pool.num_blocks, kv.sliding.blocks.num_blocks) == (40, 16)
        assert generate(engine, prompts[:1], params[:1]) + generate(engine, prompts, params) == full[:1] + full
        assert counted(engine.metrics.preemptions) > 0 and counted(engine.metrics.prefix_hits) >= 20
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_without_chunked_prefill_a_prompt_longer_than_a_step_runs_whole(folder: Path) -> None:
    """--no-chunked-prefill runs a prompt longer than the step's budget alone and whole, so every token of it needs
    a sliding block at once: the sliding pool makes room for a whole context. Before, it held the windows and one
    step's budget; such a prompt never found room, and every request behind it waited for ever."""
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    prompts = [PROMPT * 3, PROMPT[:5]]  # 120 tokens: 30 blocks of 4, where the windows and a step took 8
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(2)]
    config = {"block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8, "chunked_prefill": False,
              "kv_cache_memory": "1MiB"}
    full = one_pool_tokens(loaded, prompts, params, config)
    engine = start_engine(loaded, **config)
    try:
        kv = engine.kv_cache
        assert isinstance(kv, PagedKVCache) and kv.sliding is not None
        assert kv.sliding.blocks.num_blocks == 2 * 3 + 256 // 4  # two windows of 3 blocks, a whole context
        assert generate(engine, prompts, params, timeout=60) == full
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_gemma3_batches_and_aborts(folder: Path) -> None:
    """Greedy alone equals greedy in a batch (prompts shorter and longer than the window); an aborted stream
    gives its blocks back."""
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    prompts = [PROMPT[:3], PROMPT[:11], PROMPT, PROMPT[5:30]]
    engine = start_engine(loaded)
    try:
        alone = [generate(engine, [p], [greedy(16)])[0] for p in prompts]
        assert generate(engine, prompts, [greedy(16)] * len(prompts)) == alone
        done = threading.Event()

        def sink(out: SequenceOutput) -> None:
            if out.finish_reason is not None:
                done.set()

        engine.abort(engine.add(PROMPT, greedy(200), sink))
        assert done.wait(60)
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


@pytest.mark.slow
def test_the_real_gemma3_gguf_matches_transformers() -> None:
    """Gemma 3 270M (Q4_K_M, read by transformers too, dequantized): fp32 logits at every position of three
    prompts, and 16 greedy tokens each."""
    path = pull("gemma3-270m", quiet=True)
    with gguf_read_once():
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model(str(path), WeightPlan(dtype="float32", device="cpu", quantized=False))
    prompts = [loaded.tokenizer.encode(text) for text in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")]
    assert all(ids[0] == 2 and ids[1] != 2 for ids in prompts)  # exactly one <bos>
    engine = start_engine(loaded)
    try:
        ours = generate(engine, prompts, [greedy(16)] * len(prompts))
    finally:
        engine.stop()
    with torch.inference_mode():
        for ids, tokens in zip(prompts, ours, strict=True):
            diff = (our_logits(loaded, ids) - reference(torch.tensor([ids])).logits[0]).abs().max().item()
            assert diff < 1e-3, diff
            out = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert tokens == out[0, len(ids):].tolist()

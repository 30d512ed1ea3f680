"""tokenmill's forward pass against transformers on the same weights: fp32 logits and 64 greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import generate, gguf_read_once, hf_configs, our_logits, save_random_hf_model, start_engine
from tolerances import AGREEMENT_WITH_FP32, KL_AGAINST_FP32, LOGITS_AGAINST_TRANSFORMERS, path_of

from tokenmill import kernels
from tokenmill.bench.noise import against_fp32
from tokenmill.config import WeightPlan
from tokenmill.layers.quantized import QuantizedLinear
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def reference_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, never stopping at EOS."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def our_greedy(loaded: LoadedModel, ids: list[int], steps: int) -> list[int]:
    engine = start_engine(loaded)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        return generate(engine, [ids], [params])[0]
    finally:
        engine.stop()


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm: LoadedModel, smollm_path: Path) -> None:
    with gguf_read_once():
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
        ).eval()
    ids = smollm.tokenizer.encode("The three most important inventions of the twentieth century were")
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([ids])).logits[0]
        diff = (our_logits(smollm, ids) - ref_logits).abs().max().item()
        assert diff < LOGITS_AGAINST_TRANSFORMERS, f"max abs logit diff {diff}"
        assert our_greedy(smollm, ids, 64) == reference_greedy(reference, ids, 64)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama3-rope"])
def test_random_hf_model_matches_transformers(name: str, tmp_path: Path, device: str) -> None:
    config = hf_configs()[name]
    save_random_hf_model(tmp_path, config)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = load_model(str(tmp_path), WeightPlan(dtype="float32", device=device))
    assert loaded.config.qk_norm == (name == "qwen3")
    assert loaded.config.attention_bias == (name == "qwen2")
    assert (loaded.config.rope_freq_factors is not None) == (name == "llama3-rope")
    ids = list(range(3, 200, 7))
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([ids])).logits[0]
        diff = (our_logits(loaded, ids) - ref_logits).abs().max().item()
        assert diff < LOGITS_AGAINST_TRANSFORMERS, f"max abs logit diff {diff}"
        assert our_greedy(loaded, ids, 64) == reference_greedy(reference, ids, 64)


def assert_tracks_fp32(smollm: LoadedModel, other: LoadedModel) -> None:
    """other against fp32 on the same GGUF, within its path's bounds (tests/tolerances.py): prefill logits close in
    distribution, and greedy tokens through the decode path mostly fp32's own top choice."""
    path, versus = path_of(other), against_fp32(smollm, other)
    kl_mean, kl_max = KL_AGAINST_FP32[path]
    assert versus.kl.mean() < kl_mean and versus.kl.max() < kl_max, \
        f"{path}: KL mean {versus.kl.mean():.4f}, max {versus.kl.max():.4f}"
    assert versus.agreement >= AGREEMENT_WITH_FP32[path], \
        f"{path}: only {versus.agreement:.0%} of the greedy tokens are fp32's top choice"


@pytest.mark.slow
@pytest.mark.parametrize(("quantized", "tiles"), [(False, 0), (True, 0), (True, None)],
                         ids=["dense", "quantized", "tiles"])
def test_smollm2_bf16_tracks_fp32(smollm: LoadedModel, smollm_path: Path, quantized: bool, tiles: int | None) -> None:
    """bf16, the default on CPUs with native bf16; its decode steps run
    the fused layer on fp32 rows and the bf16 KV pool, over the weights kept quantized or, dense, kept in bf16 for
    the kernels; on a CPU with AMX its prefill (24 rows or more) runs the quantized matrices on the tiles, weights
    and activations in bf16 (the integer kernel rounds its activations to 8 bits instead)."""
    if tiles is None and not kernels.has_tiles():
        pytest.skip("no AMX tiles here")
    if quantized and not kernels.has_vector_kernels():
        pytest.skip("GGUF weights load dense here: the dense case is this one")
    other = load_model(str(smollm_path), WeightPlan(dtype="bfloat16", device=smollm.device.type, quantized=quantized,
                                                    tiles_from_rows=tiles))
    assert (other.model.model.fused_decode is not None) == (smollm.device.type == "cpu" and kernels.load()
                                                            and kernels.has_vector_kernels())
    linears = [m for m in other.model.modules() if isinstance(m, QuantizedLinear)]
    assert not linears or all(m.weight.bits == 16 for m in linears) != quantized
    assert all(m.tiles_from_rows == (24 if tiles is None else 0) for m in linears)
    assert_tracks_fp32(smollm, other)


@pytest.mark.slow
def test_smollm2_quantized_kernels_track_fp32(smollm: LoadedModel, smollm_path: Path) -> None:
    """The weights kept in Q4_1/Q8_0 and run by the C++ kernels, the default on CPU (their activations are rounded
    to 8 bits per block of 32, as llama.cpp's are)."""
    if smollm.device.type != "cpu" or not (kernels.load() and kernels.has_vector_kernels()):
        pytest.skip("the quantized kernels run on a CPU that builds them")
    quantized = load_model(str(smollm_path), WeightPlan(dtype="float32", device="cpu"))
    assert any(isinstance(m, QuantizedLinear) for m in quantized.model.modules())
    assert_tracks_fp32(smollm, quantized)


def test_a_tied_bf16_table_is_held_once_and_looked_up_as_it_is(tmp_path: Path) -> None:
    """With the kernels' bf16 layout, a tied head's table is the one the lookup reads: one copy, the same rows."""
    from safetensors.torch import load_file

    from tokenmill.layers.quantized import QuantizedEmbedding, QuantizedLinear

    save_random_hf_model(tmp_path, hf_configs()["qwen2"])  # tie_word_embeddings
    loaded = load_model(str(tmp_path), WeightPlan(dtype="bfloat16", device="cpu"))
    head, embed = getattr(loaded.model, "lm_head", None), loaded.model.model.embed_tokens
    if not isinstance(head, QuantizedLinear):
        pytest.skip("this CPU's kernels do not run bf16 matrices")
    assert isinstance(embed, QuantizedEmbedding) and embed.weight is head.weight
    table = load_file(str(tmp_path / "model.safetensors"))["model.embed_tokens.weight"].to(torch.bfloat16)
    ids = torch.tensor([[0, 5, 255, 17], [3, 3, 2, 1]])
    assert torch.equal(embed(ids), table[ids])

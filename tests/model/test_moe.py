"""Mixture-of-experts families against transformers on tiny random models: Qwen3-MoE (renormalised top-k),
OLMoE (no renormalisation, q/k norms over the whole projection, clipped q/k/v) and GraniteMoE (its multipliers),
each as a Hugging Face folder and as the GGUF llama.cpp's converter would write from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import generate, our_logits, save_random_hf_model, start_engine, write_gguf
from safetensors import safe_open
from torch import nn

from tokenmill import kernels
from tokenmill.config import WeightPlan
from tokenmill.layers.moe import QuantizedStacked, StackedWeight
from tokenmill.loader import load_model
from tokenmill.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # measured: ~1e-6
PROMPTS = [list(range(3, 27)), list(range(40, 45)), list(range(100, 150, 3))]
SHARED = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=2,
              eos_token_id=1, pad_token_id=0)


def configs() -> dict[str, object]:
    return {
        "qwen3moe": transformers.Qwen3MoeConfig(**SHARED, intermediate_size=128, moe_intermediate_size=32,
                                                head_dim=16, num_experts=8, norm_topk_prob=True),
        "olmoe": transformers.OlmoeConfig(**SHARED, intermediate_size=32, num_experts=8, norm_topk_prob=False,
                                          clip_qkv=3.0),
        "granitemoe": transformers.GraniteMoeConfig(**SHARED, intermediate_size=32, num_local_experts=8,
                                                    embedding_multiplier=6.0, attention_multiplier=0.2,
                                                    residual_multiplier=0.5, logits_scaling=3.0,
                                                    tie_word_embeddings=True),
    }


@pytest.fixture(scope="module", params=["qwen3moe", "olmoe", "granitemoe"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(architecture, a Hugging Face folder of it)."""
    path = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(path, configs()[request.param], norm_noise=0.3)
    return request.param, path


def reference(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its NORM rope (Granite's), which the loader undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_twin(folder: Path, arch: str, qtype: QType = QType.F32) -> Path:
    """The GGUF of the folder's weights (its safetensors, as the Hub holds them) under llama.cpp's names and keys;
    matrices and expert stacks in qtype."""
    cfg = configs()[arch]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        hf = {name: f.get_tensor(name).float().numpy() for name in f.keys()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
             "block_sparse_moe.router.layer": "ffn_gate_inp", "block_sparse_moe.output_linear": "ffn_down_exps"}
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf and not cfg.tie_word_embeddings:
        tensors["output.weight"] = hf["lm_head.weight"]
    experts = cfg.num_experts if arch != "granitemoe" else cfg.num_local_experts
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for part, gguf_part in names.items():
            if pre + part + ".weight" in hf:
                tensors[f"blk.{i}.{gguf_part}.weight"] = hf[pre + part + ".weight"]
        for proj in ("gate", "up", "down"):
            if f"{pre}mlp.experts.0.{proj}_proj.weight" in hf:
                tensors[f"blk.{i}.ffn_{proj}_exps.weight"] = np.stack(
                    [hf[f"{pre}mlp.experts.{e}.{proj}_proj.weight"] for e in range(experts)])
        if f"{pre}block_sparse_moe.input_linear.weight" in hf:
            gate, up = np.split(hf[f"{pre}block_sparse_moe.input_linear.weight"], 2, axis=1)
            tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = gate, up
        if arch == "granitemoe":
            tensors[f"blk.{i}.attn_q.weight"] = permute(tensors[f"blk.{i}.attn_q.weight"], cfg.num_attention_heads)
            tensors[f"blk.{i}.attn_k.weight"] = permute(tensors[f"blk.{i}.attn_k.weight"], cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    metadata = {"block_count": cfg.num_hidden_layers, "context_length": 256, "embedding_length": cfg.hidden_size,
                "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
                "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": head_dim,
                "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
                "rope.freq_base": float(cfg.rope_parameters["rope_theta"]), "expert_count": experts,
                "expert_used_count": cfg.num_experts_per_tok}
    if arch == "qwen3moe":
        metadata["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if arch == "olmoe":
        metadata["attention.clamp_kqv"] = cfg.clip_qkv
    if arch == "granitemoe":
        metadata |= {"embedding_scale": cfg.embedding_multiplier, "attention.scale": cfg.attention_multiplier,
                     "residual_scale": cfg.residual_multiplier, "logit_scale": cfg.logits_scaling}
    return write_gguf(folder / f"twin-{qtype.name}.gguf", arch, metadata, tensors, chat_template=None, qtype=qtype)


def test_a_moe_folder_matches_transformers(family: tuple[str, Path]) -> None:
    """Every position's logits, then greedy decoding of three sequences in one batch (each step's tokens routed
    to experts together)."""
    _, folder = family
    model = reference(folder)
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    assert loaded.config.num_experts == 8 and loaded.config.num_experts_per_tok == 2
    with torch.inference_mode():
        for ids in PROMPTS:
            diff = (our_logits(loaded, ids) - model(torch.tensor([ids])).logits[0]).abs().max().item()
            assert diff < TOLERANCE, diff
        expected = [model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                   do_sample=False)[0, len(ids):].tolist() for ids in PROMPTS]
    engine = start_engine(loaded)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        assert generate(engine, PROMPTS, [params] * len(PROMPTS)) == expected
    finally:
        engine.stop()


def test_a_moe_gguf_matches_its_folder(family: tuple[str, Path]) -> None:
    """Stacked ffn_*_exps tensors, expert_count / expert_used_count and the family's own keys."""
    arch, folder = family
    loaded = load_model(str(write_twin(folder, arch)), WeightPlan(dtype="float32", device="cpu", quantized=False))
    assert loaded.config.architecture == arch
    model = reference(folder)
    with torch.inference_mode():
        for ids in PROMPTS:
            diff = (our_logits(loaded, ids) - model(torch.tensor([ids])).logits[0]).abs().max().item()
            assert diff < TOLERANCE, diff


@pytest.mark.skipif(not kernels.load() or not kernels.has_vector_kernels(), reason="the quantized path is off here")
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0])
def test_quantized_experts_stay_quantized_and_track_their_dense_twin(family: tuple[str, Path], qtype: QType) -> None:
    """GGUF expert stacks in Q8_0 or Q4_0 run as each expert's slice of one quantized matrix; the same file loaded
    dense (dequantized) is the reference."""
    arch, folder = family
    path = write_twin(folder, arch, qtype)
    kept = load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    dense = load_model(str(path), WeightPlan(dtype="float32", device="cpu", quantized=False))
    stacks = [m for m in kept.model.modules() if isinstance(m, QuantizedStacked | StackedWeight)]
    assert stacks and all(isinstance(m, QuantizedStacked) for m in stacks)
    assert not any(isinstance(m, nn.Linear) for m in kept.model.modules())
    for stack in stacks:  # each item is its own rows of the stack
        x = torch.randn(5, stack.weight.shape[1], generator=torch.Generator().manual_seed(0))
        for item in range(stack.weight.out_features // stack.rows):
            rows = torch.arange(item * stack.rows, (item + 1) * stack.rows)
            exact = x @ stack.weight.dequantize(rows=rows).T
            assert (stack(item, x) - exact).norm() <= 0.02 * exact.norm()
    for ids in PROMPTS:
        ours, reference = our_logits(kept, ids), our_logits(dense, ids)
        # The kernel's 8-bit activations against fp32 ones; random weights make close calls between experts and
        # between tokens (measured: relative error 0.01-0.11, so top-1 agreement is no measure here).
        assert (ours - reference).norm() <= 0.15 * reference.norm()

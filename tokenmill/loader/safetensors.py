"""Hugging Face folders: config.json and *.safetensors."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.errors import ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.loader import hf_quant
from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import MODEL_CLASSES


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc


def _llama3_freq_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> tuple[float, ...]:
    """Divisors that turn RoPE's inverse frequencies into Llama 3's scaled ones."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        inv_freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / inv_freq
        if wavelen < old_len / high:
            scaled = inv_freq
        elif wavelen > old_len / low:
            scaled = inv_freq / factor
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        factors.append(inv_freq / scaled)
    return tuple(factors)


# Hugging Face model_type -> the registry's architecture, where they differ.
_ARCHITECTURE_OF = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}
# Gemma's RMSNorm weights are w in x * (1 + w): the model takes 1 + w (as GGUF files hold them).
_GEMMA_NORMS = ("layernorm.weight", "norm.weight")


def model_config(folder: Path) -> ModelConfig:
    cfg = read_json(folder / "config.json")
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3":
        raise ModelFormatError(f"{folder} is a multimodal Gemma 3 checkpoint; tokenmill serves the text models "
                               f"(model_type gemma3_text, e.g. gemma-3-270m and gemma-3-1b)")
    if _ARCHITECTURE_OF.get(model_type, model_type) not in MODEL_CLASSES:
        hf_names = {arch: hf for hf, arch in _ARCHITECTURE_OF.items()}
        raise ModelFormatError(f"unsupported model_type {model_type!r} in {folder}; supported: "
                               f"{', '.join(hf_names.get(arch, arch) for arch in MODEL_CLASSES)}")
    model_type = _ARCHITECTURE_OF.get(model_type, model_type)
    hf_quant.scheme_of(cfg, folder)  # a quantization it cannot read is refused now, before any weight
    hidden = cfg["hidden_size"]
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    # transformers 5 moved rope_theta and rope_scaling into rope_parameters (keyed by layer type for Gemma 3).
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope = rope.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
    rope = rope.get("full_attention", rope)
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelFormatError(f"unsupported rope scaling {rope_type!r} in {folder}")
    freq_factors = None
    if rope_type == "llama3":
        freq_factors = _llama3_freq_factors(rope, head_dim, theta)
    elif rope_type == "linear":
        freq_factors = (float(rope["factor"]),) * (head_dim // 2)
    config = ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
        qk_norm=model_type in ("qwen3", "gemma3"),
        rope_freq_factors=freq_factors,
    )
    if model_type == "gemma3":
        config.hidden_act = "gelu_tanh"
        config.embedding_multiplier = hidden**0.5
        config.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar", head_dim))
        config.sliding_window = int(cfg.get("sliding_window") or 0)
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_layers)]
        config.sliding_layers = tuple(t == "sliding_attention" for t in types)
        config.rope_local_theta = float(local_rope.get("rope_theta", 10000.0))
    if model_type in ("qwen3moe", "olmoe", "granitemoe"):
        _moe_config(cfg, config, folder)
    return config


def _moe_config(cfg: dict[str, Any], config: ModelConfig, folder: Path) -> None:
    """Qwen3-MoE sizes its experts by moe_intermediate_size, OLMoE and Granite by intermediate_size."""
    config.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    config.num_experts_per_tok = cfg["num_experts_per_tok"]
    config.moe_intermediate_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    config.norm_topk_prob = config.architecture == "granitemoe" or bool(cfg.get("norm_topk_prob", False))
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ModelFormatError(f"{folder}: dense layers between the sparse ones (decoder_sparse_step, "
                               f"mlp_only_layers) are not supported")
    if config.architecture == "olmoe":
        config.qk_norm, config.qk_norm_per_head = True, False
        config.clip_qkv = cfg.get("clip_qkv")
    if config.architecture == "qwen3moe":
        config.qk_norm = True
    if config.architecture == "granitemoe":
        config.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        config.attention_multiplier = float(cfg.get("attention_multiplier", config.head_dim**-0.5))
        config.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        config.logits_scaling = float(cfg.get("logits_scaling", 1.0))


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight")


def _model_names(tensors: Iterator[tuple[str, Any]], num_experts: int) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors under the names and stacking the model takes: per-expert matrices stacked
    [experts, ...] once a layer's last one arrives (Qwen3-MoE, OLMoE), Granite's block_sparse_moe renamed (its
    input_linear holds each expert's gate, then its up)."""
    pending: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for name, tensor in tensors:
        if (match := _EXPERT.fullmatch(name)) is not None:
            prefix, expert, leaf = match.group(1), int(match.group(2)), match.group(3)
            if expert >= num_experts:
                raise ModelFormatError(f"{name}: expert {expert} of {num_experts}")
            group = pending.setdefault((prefix, leaf), [None] * num_experts)
            group[expert] = tensor
            if all(part is not None for part in group):
                yield f"{prefix}.{leaf}.weight", torch.stack(cast(list[torch.Tensor], pending.pop((prefix, leaf))))
        elif ".block_sparse_moe." in name:
            layer, part = name.split(".block_sparse_moe.")
            if part == "input_linear.weight":
                gate, up = tensor.chunk(2, dim=1)
                yield f"{layer}.mlp.experts.gate_proj.weight", gate
                yield f"{layer}.mlp.experts.up_proj.weight", up
            elif part == "output_linear.weight":
                yield f"{layer}.mlp.experts.down_proj.weight", tensor
            elif part == "router.layer.weight":
                yield f"{layer}.mlp.gate.weight", tensor
            else:
                yield name, tensor  # the model has no such parameter: load_weights names it and skips it
        else:
            yield name, tensor
    for (prefix, leaf), group in pending.items():
        missing = [i for i, part in enumerate(group) if part is None]
        raise ModelFormatError(f"the checkpoint lacks {prefix}.{missing[0]}.{leaf}.weight")


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors in `dtype`, under the model's names; a quantized checkpoint's 4-bit matrices in the
    kernels' layout where keep_quantized (and that holds them exactly), its others dequantized."""
    scheme = hf_quant.scheme_of(read_json(folder / "config.json"), folder)
    if scheme is None:
        return _model_names(_read(folder, config, dtype), config.num_experts)
    return _model_names(hf_quant.dequantized(_read(folder, config, None), scheme, dtype, keep_quantized),
                        config.num_experts)


def _read(folder: Path, config: ModelConfig, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's files, in `dtype` (None: as stored, for hf_quant to dequantize)."""
    files = sorted(folder.glob("*.safetensors"))
    gemma = config.architecture == "gemma3"
    if not files:
        raise ModelFormatError(f"no *.safetensors files in {folder}")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except SafetensorError as exc:  # a truncated or corrupt file
            raise ModelFormatError(f"cannot read {file}: {exc}") from exc
        with handle:
            for name in handle.keys():
                # A copy: get_tensor's maps the file, so a file rewritten in place would change a served model.
                tensor = handle.get_tensor(name)
                if gemma and name.endswith(_GEMMA_NORMS):
                    tensor = tensor.float() + 1
                yield name, tensor.clone() if dtype is None else tensor.to(dtype, copy=True)

"""Hugging Face folders: config.json and *.safetensors."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.errors import ModelFormatError
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


def model_config(folder: Path) -> ModelConfig:
    cfg = read_json(folder / "config.json")
    model_type = cfg.get("model_type", "")
    if model_type not in MODEL_CLASSES:
        raise ModelFormatError(
            f"unsupported model_type {model_type!r} in {folder}; supported: {', '.join(MODEL_CLASSES)}"
        )
    hidden = cfg["hidden_size"]
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    # transformers 5 moved rope_theta and rope_scaling into rope_parameters.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelFormatError(f"unsupported rope scaling {rope_type!r} in {folder}")
    return ModelConfig(
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
        qk_norm=model_type == "qwen3",
        rope_freq_factors=_llama3_freq_factors(rope, head_dim, theta) if rope_type == "llama3" else None,
    )


def load_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                # A copy: get_tensor's maps the file, so a file rewritten in place would change a served model.
                yield name, handle.get_tensor(name).to(dtype, copy=True)

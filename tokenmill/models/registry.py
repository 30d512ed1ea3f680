"""Architecture name -> model class, and building a model without paying for a random initialisation."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.errors import ModelFormatError
from tokenmill.layers.linear import can_prepack
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device, max_positions: int, prepack: bool = True) -> nn.Module:
    """prepack: reorder the weights for the CPU's matmul library where it helps (layers/linear.py)."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelFormatError(f"no model for architecture {config.architecture!r}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables()
    model.load_weights(weights)
    if prepack and can_prepack(device, dtype):
        model.prepack_weights()
    return model.eval()

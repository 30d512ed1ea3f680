"""Architecture name -> model class, and building a model without paying for a random initialisation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from tokenmill.errors import ModelFormatError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.linear import can_prepack
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """What the engine needs of a model: hidden states of a flat batch, and logits of chosen rows."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# Every family so far is the Llama decoder; a new one adds its class here (the loaders read this list).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device, max_positions: int, prepack: bool = True) -> CausalLM:
    """prepack: reorder the weights for the CPU's matmul library where it helps (layers/linear.py)."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelFormatError(f"no model for architecture {config.architecture!r}")
    with torch.device("meta"):  # no memory, no random init: the checkpoint's tensors become the parameters
        model = cls(config, max_positions)
    model.load_weights(weights, dtype, device)
    for module in model.modules():  # tables outside the state dict (non-persistent buffers), built where they run
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    if prepack and can_prepack(device, dtype):
        model.prepack_weights()
    return model.eval()

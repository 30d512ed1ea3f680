"""Gemma 3 (text): the Llama decoder's attention (q/k norms, GQA) and gated MLP, with Gemma's differences.

- Four norms a layer ("sandwich"): each of attention and the MLP is normed before and after, then added.
- RMSNorm as x * w, where Gemma's checkpoints hold w - 1 (x * (1 + w)): the safetensors loader adds the 1, as
  llama.cpp's converter did for GGUF files, so the two formats meet in one model.
- The embeddings scaled by sqrt(hidden) (in the compute dtype, as transformers does); the tied head is not.
- GeGLU (the tanh GELU); attention scale query_pre_attn_scalar^-0.5.
- Sliding layers (five of every six, or the config's layer_types) see their last `sliding_window` keys, with RoPE
  base rope_local_theta; the others are global with rope_theta (and its scaling, if any). The KV cache is full for
  every layer; the window is a mask (layers/attention.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM, LlamaModel, fused_decode_weights


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.sliding = bool(config.layer_window(layer))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: pending is the previous layer's normed MLP output, not yet added."""
        x, qkv = self.input_layernorm.norm_linear(x, pending, self.self_attn.qkv_proj)
        attended = self.post_attention_layernorm(self.self_attn.attend(qkv, rope, meta))
        x, gate_up = self.pre_feedforward_layernorm.norm_linear(x, attended, self.mlp.gate_up_proj)
        return x, self.post_feedforward_layernorm(self.mlp.down(gate_up))

    def decode_weights(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """This layer as the fused decode kernel takes it, with its four norms."""
        return fused_decode_weights(self.self_attn, self.mlp,
                                    (self.input_layernorm, self.pre_feedforward_layernorm),
                                    (self.post_attention_layernorm, self.post_feedforward_layernorm))


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.rope_local_theta, max_positions)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global table for the global layers, the local one for the sliding layers."""
        ropes = self.rotary(positions), self.local_rotary(positions)
        return [ropes[layer.sliding] for layer in cast(list[Gemma3DecoderLayer], self.layers)]


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

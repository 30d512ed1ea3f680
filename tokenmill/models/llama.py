"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Works on a flat batch: tokens of every sequence in the step are concatenated, so projections and the MLP run as
single matmuls and only attention looks at sequence boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.cache.kv_cache import AttentionMetadata
from tokenmill.errors import ModelFormatError
from tokenmill.layers.attention import attention
from tokenmill.layers.linear import PackedLinear, prepack_linears
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul; loaded from the three checkpoint tensors.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = attention(self.layer, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, config.rope_freq_factors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return self.norm(x)


# Checkpoint tensors that land in a slice of a fused parameter: (fused name, index of the slice).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a flat batch."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()  # tied to the embeddings

    def prepack_weights(self) -> None:
        """Swap every Linear for a prepacked one (CPU); a tied output head gets a packed copy of the embeddings."""
        if self.config.tie_word_embeddings:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)
        prepack_linears(self)

    def _fused_slice(self, param: torch.Tensor, module: str, index: int) -> torch.Tensor:
        if module == "qkv_proj":
            c = self.config
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            sizes = [self.config.intermediate_size] * 2
        return param.split(sizes, dim=0)[index]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names and layout) into the parameters, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, index = name, None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, index = _FUSED[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            if target not in params:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            param = params[target]
            dest = param if index is None else self._fused_slice(param, target.split(".")[-2], index)
            if dest.shape != tensor.shape:
                raise ModelFormatError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                                       f"{tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}#{index}")
        expected = set()
        for name in params:
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected |= {f"{name}#{i}" for i in range(3)}
            elif name.endswith("gate_up_proj.weight"):
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(f"{name}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ModelFormatError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

"""The architecture of a decoder, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    # Per-frequency divisors of RoPE's inverse frequencies (Llama 3 scaling); GGUF stores them as the tensor
    # rope_freqs, Hugging Face configs as rope_scaling parameters. None: no scaling.
    rope_freq_factors: tuple[float, ...] | None = None

    def num_parameters(self) -> int:
        """The weights this config allocates (norms and biases included)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        per_layer += (q + 2 * kv) * self.attention_bias + 2 * self.head_dim * self.qk_norm
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h


def attention_crossover(config: ModelConfig) -> int:
    """The context length at which a token's attention FLOPs (q.k and p.v over the context) equal those of its
    projections and MLP: the scheduler's measure of how much a prompt chunk deep into a long context costs."""
    per_layer_linear = config.hidden_size * (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim  # q, k, v
        + config.num_heads * config.head_dim  # o
    ) + 3 * config.hidden_size * config.intermediate_size  # gate, up, down
    per_context_token = 2 * config.num_heads * config.head_dim  # q.k and p.v, per layer
    return max(1, per_layer_linear // per_context_token)

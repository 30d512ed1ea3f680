"""The architecture of a decoder, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    architecture: str  # a key of models/registry.py's MODEL_CLASSES
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
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden) (the tied output head is not scaled)
    query_pre_attn_scalar: float | None = None  # attention scale scalar^-0.5 (None: head_dim)
    # Sliding-window layers (Gemma 3): True where layer i attends to its last `sliding_window` keys only, with RoPE
    # base rope_local_theta (and no scaling); () where every layer is global.
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float = 10000.0
    # Mixture of experts (Qwen3-MoE, OLMoE, GraniteMoE): each layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size, of which a router picks num_experts_per_tok per token; 0 experts: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1 (OLMoE's are not)
    qk_norm_per_head: bool = True  # False: the q/k norms span the whole projection (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (an OLMoE option)
    # Granite: the attention scale itself, a factor on attention's and the MLP's outputs before each residual add,
    # and a divisor of the logits.
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # The output head's rows: the vocabulary (None), or a tensor-parallel rank's share of it (parallel/sharding.py).
    head_rows: int | None = None

    @property
    def sandwich_norms(self) -> bool:
        """Gemma's four norms a layer: before and after attention, before and after the MLP."""
        return self.architecture == "gemma3"

    def layer_window(self, layer: int) -> int:
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    def attention_scale(self) -> float:
        return self.attention_multiplier or (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_parameters(self) -> int:
        """The weights this config allocates (norms and biases included)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router and experts
        qk_norms = 2 * self.head_dim if self.qk_norm_per_head else q + kv
        per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        per_layer += (q + 2 * kv) * self.attention_bias + qk_norms * self.qk_norm + 2 * h * self.sandwich_norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h


def attention_crossover(config: ModelConfig) -> int:
    """The context length at which a token's attention FLOPs (q.k and p.v over the context) equal those of its
    projections and MLP: the scheduler's measure of how much a prompt chunk deep into a long context costs."""
    ffn = config.num_experts_per_tok * config.moe_intermediate_size if config.num_experts else config.intermediate_size
    per_layer_linear = config.hidden_size * (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim  # q, k, v
        + config.num_heads * config.head_dim  # o
    ) + 3 * config.hidden_size * ffn  # gate, up, down (of the experts a token takes)
    per_context_token = 2 * config.num_heads * config.head_dim  # q.k and p.v, per layer
    return max(1, per_layer_linear // per_context_token)

"""Which part of a model a tensor-parallel rank holds, as vLLM and nano-vllm shard the Llama family (Megatron's
split): q/k/v by whole heads (a KV head replicated where there are fewer than ranks), gate/up by rows, o and down by
columns (their outputs are partial sums: the ranks all-reduce them), the output head by vocabulary rows (gathered
to rank 0); norms and the embeddings whole on every rank. Applied to the checkpoint's tensors as they stream in, so
a rank never holds more than its share of a matrix at once (a tensor's own copy aside)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.models.config import ModelConfig

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` ranks."""

    rank: int
    size: int

    def span(self, n: int) -> tuple[int, int]:
        """This rank's part of n items, in order: as even as can be (the vocabulary need not divide)."""
        return n * self.rank // self.size, n * (self.rank + 1) // self.size

    def widths(self, n: int) -> list[int]:
        """Every rank's part of n items."""
        return [n * (r + 1) // self.size - n * r // self.size for r in range(self.size)]


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse (ConfigError) a model that `size` ranks cannot split, saying why."""
    why = None
    if config.num_experts:
        why = "mixture-of-experts layers are not sharded yet"
    elif config.qk_norm and not config.qk_norm_per_head:
        why = "its q/k norms span the whole projection (OLMoE), which would need the ranks' heads together"
    elif config.num_heads % size:
        why = f"its {config.num_heads} query heads do not divide among {size} ranks"
    elif config.num_kv_heads % size and size % config.num_kv_heads:
        why = (f"its {config.num_kv_heads} KV heads neither divide among {size} ranks nor divide them (a KV head is "
               "replicated on whole groups of ranks)")
    elif config.intermediate_size % size:
        why = f"its MLP's {config.intermediate_size} rows do not divide among {size} ranks"
    if why:
        raise ConfigError(f"--tensor-parallel-size {size}: {config.architecture}: {why}")


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The architecture a rank runs: its heads, its MLP rows, its rows of the head (untied: a rank's head is its own
    slice of the embeddings)."""
    lo, hi = shard.span(config.vocab_size)
    return dataclasses.replace(
        config, num_heads=config.num_heads // shard.size, num_kv_heads=max(1, config.num_kv_heads // shard.size),
        intermediate_size=config.intermediate_size // shard.size, tie_word_embeddings=False, head_rows=hi - lo)


def shard_weights(weights: Iterable[tuple[str, Weight]], config: ModelConfig,
                  shard: Shard) -> Iterator[tuple[str, Weight]]:
    """The rank's share of each checkpoint tensor (Hugging Face names, config: the whole model's)."""
    head_dim = config.head_dim
    q = shard.span(config.num_heads * head_dim)
    if config.num_kv_heads >= shard.size:
        kv = shard.span(config.num_kv_heads * head_dim)
    else:  # ranks rank * kv // size share KV head: the one their query heads read
        head = shard.rank * config.num_kv_heads // shard.size
        kv = head * head_dim, (head + 1) * head_dim
    mlp = shard.span(config.intermediate_size)
    vocab = shard.span(config.vocab_size)
    for name, value in weights:
        leaf = name.rsplit(".", 2)[-2]
        if leaf == "q_proj":
            yield name, _rows(value, *q)
        elif leaf in ("k_proj", "v_proj"):
            yield name, _rows(value, *kv)
        elif leaf in ("gate_proj", "up_proj"):
            yield name, _rows(value, *mlp)
        elif leaf in ("o_proj", "down_proj"):
            if name.endswith(".bias"):
                raise ConfigError(f"{name}: a bias after a split matmul is not sharded yet (--tensor-parallel-size 1)")
            yield name, _columns(name, value, *(q if leaf == "o_proj" else mlp))
        elif name == "lm_head.weight":
            yield name, _rows(value, *vocab)
        elif name == "model.embed_tokens.weight":
            yield name, value
            if config.tie_word_embeddings:  # the head this rank computes: its rows of the embeddings
                yield "lm_head.weight", _rows(value, *vocab)
        else:
            yield name, value


def _rows(value: Weight, start: int, end: int) -> Weight:
    if isinstance(value, QuantizedWeight):
        return value.rows(torch.arange(start, end))
    return value[start:end].clone()


def _columns(name: str, value: Weight, start: int, end: int) -> Weight:
    if isinstance(value, QuantizedWeight):
        if start % 32 or end % 32:
            raise ModelFormatError(f"{name}: a rank's columns {start}..{end} would cut a quantized block of 32 "
                                   "weights: another --tensor-parallel-size, or --no-quantized-weights")
        return value.columns(start, end)
    return value[:, start:end].contiguous()

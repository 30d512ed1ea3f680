"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm); with a
mixture of experts for an MLP, Qwen3-MoE, OLMoE (q/k norms over the whole projection) and GraniteMoE (its
multipliers); Gemma 3 builds on it (gemma3.py).

Works on a flat batch: tokens of every sequence in the step are concatenated, so projections and the MLP run as
single matmuls and only attention looks at sequence boundaries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import backend
from tokenmill.errors import ModelFormatError
from tokenmill.kernels import gpu
from tokenmill.layers.attention import AttentionMetadata, PagedMetadata, attention, fused_rotary_attention
from tokenmill.layers.linear import (
    PackedLinear,
    linear_of,
    make_row_invariant,
    prepack_linears,
    project,
    row_matmul_takes,
)
from tokenmill.layers.lora import LoRASlots, base_of, fused_factors
from tokenmill.layers.moe import QuantizedStacked, SparseMoE, StackedWeight
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantized import (
    DENSE_FROM_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    bf16_linears,
    linear_module,
    on_device,
)
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.config import ModelConfig

log = logging.getLogger(__name__)


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
        self.qk_norm, self.qk_norm_per_head = config.qk_norm, config.qk_norm_per_head
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim if self.qk_norm_per_head else self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if self.qk_norm_per_head else self.kv_size, config.rms_norm_eps)
        self.clip = config.clip_qkv
        self.scale = config.attention_scale()
        self.window = config.layer_window(layer)

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output from its q|k|v projection's rows: the layer's caller runs qkv_proj, the norm before it
        fused in where it can (RMSNorm.norm_linear)."""
        tokens = qkv.shape[0]
        per_head = self.qk_norm and self.qk_norm_per_head
        if per_head:  # normed in place: the q|k|v rows then take the fused RoPE, as the fused layer does
            q, k = self._heads(qkv)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if (per_head or not self.qk_norm) and self.clip is None:
            out = fused_rotary_attention(self.layer, qkv, rope, meta, self.num_heads, self.num_kv_heads, self.scale,
                                         self.window)
            if out is not None:
                return project(self.o_proj, out.view(tokens, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm and not per_head:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip is not None:  # after the norms, as OLMoE does
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = attention(self.layer, q, k, v, meta, self.scale, self.window)
        return project(self.o_proj, out.reshape(tokens, self.q_size))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of q|k|v rows' query heads [tokens, heads, dim] and key heads [tokens, kv heads, dim]."""
        tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        return q, k


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(act(gate) * up) of the gate|up projection's rows: the layer's caller runs gate_up_proj, the
        norm before it fused in where it can (RMSNorm.norm_linear); a one-sequence decode step's row on a GPU takes
        one kernel (gpu.row_matmul)."""
        if row_matmul_takes(self.down_proj, gate_up):
            return gpu.row_matmul(gate_up, self.down_proj.weight, self.down_proj.bias,
                                    "gelu_mul" if self.gelu else "silu_mul")[0]
        if not self.gelu and backend.gpu_runs(gate_up):
            return self.down_proj(gpu.silu_mul(gate_up))
        if backend.cpu_kernels(gate_up.device):  # one pass (kernels/rope.cpp), the fused layer's too
            act_mul = torch.ops.tokenmill.gelu_tanh_mul if self.gelu else torch.ops.tokenmill.silu_mul
            return self.down_proj(act_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoE = MLP(config)
        if config.num_experts:
            self.mlp = SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                 config.moe_intermediate_size, config.norm_topk_prob)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; pending: the previous layer's MLP output, not yet added (None in the first
        layer), so that each add fuses with the norm after it. Returns the stream and this layer's MLP output."""
        x, qkv = self.input_layernorm.norm_linear(x, pending, self.self_attn.qkv_proj)
        attended = self.self_attn.attend(qkv, rope, meta)
        if self.residual_multiplier != 1.0:
            attended = attended * self.residual_multiplier
        if isinstance(self.mlp, MLP):
            x, gate_up = self.post_attention_layernorm.norm_linear(x, attended, self.mlp.gate_up_proj)
            out = self.mlp.down(gate_up)
        else:
            x, h = self.post_attention_layernorm.add_and_norm(x, attended)
            out = self.mlp(h)
        return x, out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def decode_weights(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """This layer as the fused decode kernel takes it (fused_decode_weights); None with Granite's multipliers."""
        if self.residual_multiplier != 1.0:
            return None
        return fused_decode_weights(self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm))


def fused_decode_weights(attn: Attention, mlp: nn.Module, norms: tuple[RMSNorm, RMSNorm],
                         output_norms: tuple[RMSNorm, RMSNorm] | None = None,
                         ) -> tuple[list[torch.Tensor], list[int]] | None:
    """A layer's tensors as the fused decode kernel takes them (kernels/layer.cpp), and its matrices' weights per
    scale, then their zero points. norms: before attention and before the MLP; output_norms: of the attention's and
    the MLP's outputs (Gemma 3's). None where the kernel cannot run the layer: a projection not kept for the
    kernels, q/k norms over whole projections (OLMoE), experts, clipping. Its rows are fp32: a bf16 or fp16 model's
    norms and bias are given as fp32 copies (a few KiB a layer)."""
    if not isinstance(mlp, MLP) or attn.clip is not None or (attn.qk_norm and not attn.qk_norm_per_head):
        return None
    linears = tuple(base_of(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    if not all(isinstance(m, QuantizedLinear) and (m.bias is None or m is attn.qkv_proj) for m in linears):
        return None
    none = torch.empty(0)

    def parts(m: QuantizedLinear) -> list[torch.Tensor]:
        return [m.weight.qweight, m.weight.scales, none if m.weight.mins is None else m.weight.mins]

    def weight(norm: RMSNorm | None) -> torch.Tensor:
        return none if norm is None else norm.weight.float()

    qkv, o, gate_up, down = cast(tuple[QuantizedLinear, ...], linears)
    q_norm, k_norm = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
    attn_out, mlp_out = output_norms or (None, None)
    weights = [weight(norms[0]), *parts(qkv), none if qkv.bias is None else qkv.bias.float(), *parts(o),
               weight(norms[1]), *parts(gate_up), *parts(down), weight(q_norm), weight(k_norm), weight(attn_out),
               weight(mlp_out)]
    matrices = (qkv, o, gate_up, down)
    return weights, [m.weight.sub for m in matrices] + [m.weight.zero for m in matrices]


class FusedAllReduce(Protocol):
    """A tensor-parallel group whose all-reduces the fused decode layer runs itself (parallel/collectives.py's
    ShmGroup): take_exchanges(count) gives its shared segment's slots and flags, this rank, the ranks, the
    generation after which the layer's `count` exchanges come and the seconds a rank may keep the others waiting,
    and counts the exchanges as done."""

    def take_exchanges(self, count: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int, float]: ...


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Given its (empty) weight, the table skips its random init: on the meta device that init goes through torch's
        # reference ops, which import torch._dynamo (0.9 s of every start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.embed_scale = config.embedding_multiplier
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, config.rope_freq_factors)
        self.fused_decode: list[tuple[list[torch.Tensor], list[int]]] | None = None  # see fuse_decode_layers
        self.fused_decode_below: int | None = None  # decode steps of fewer rows run fused (None: all of them)
        self.fused_all_reduce: FusedAllReduce | None = None  # a tensor-parallel rank's: the fused layer sums itself
        self.decode_stack: DecodeStack | None = None  # the fused layers in one call (see fuse_decode_layers)
        self.lora: LoRASlots | None = None  # the adapters beside the projections (engine/lora.py installs them)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, times the config's multiplier (Gemma, Granite) rounded to the compute dtype
        first, as transformers rounds Gemma's."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale == 1.0 else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos and sin for the step's positions: one table for all."""
        return [self.rotary(positions)] * len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = self.layer_ropes(positions)
        pending = None
        # the fused layer runs adapters through the kernels (kernels/lora.cpp), not through torch
        adapted = self.lora is not None and self.lora.active and not self.lora.kernel
        if self.fused_decode is not None and not adapted and _fused_decode_runs(meta, x, self.fused_decode_below):
            # The fused layer's rows are fp32 (a bf16 model's residual stream widens for it, then narrows).
            dtype, x = x.dtype, x.float()
            pending = self._decode_fused(x, ropes, meta, dtype == torch.bfloat16)
            x, pending = x.to(dtype), pending.to(dtype)
        else:
            for layer, rope in zip(self.layers, ropes, strict=True):
                x, pending = layer(x, pending, rope, meta)
        return self.norm(x) if pending is None else self.norm.add_and_norm(x, pending)[1]

    def fuse_decode_layers(self, stacked: bool = True) -> bool:
        """Run decode steps' layers through the fused kernel, where every layer can (see decode_weights): all of them,
        or where there are dense copies, those of fewer rows than take the copies. stacked: the whole loop over the
        layers in one call (DecodeStack), where the layers share their shapes."""
        layers = [layer.decode_weights() for layer in self.layers]  # type: ignore[operator]
        self.fused_decode = None if any(w is None for w in layers) else cast(list, layers)
        dense = any(isinstance(m, QuantizedLinear) and m.dense is not None for m in self.layers.modules())
        self.fused_decode_below = DENSE_FROM_ROWS if dense else None
        self.decode_stack = DecodeStack.of(self) if stacked and self.fused_decode is not None else None
        return self.fused_decode is not None

    def _decode_fused(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: PagedMetadata, bf16_rows: bool) -> torch.Tensor:
        """Every layer as one op each, in one call where the layers stack (DecodeStack) and no adapter is active; x
        (the residual stream) is updated in place. Returns the last MLP output.
        bf16_rows: a bf16 model's, whose bf16 weights multiply the rows rounded to bf16, as its ops do unfused."""
        first = cast(DecoderLayer, self.layers[0])
        eps = first.input_layernorm.eps
        pools = [meta] if meta.sliding is None else [meta, meta.sliding]  # the steps over each KV pool
        tables = [pool.decode_tables.view(meta.num_decodes, -1) for pool in pools]
        # registry.py sets every layer's alike
        qkv = cast(QuantizedLinear, base_of(first.self_attn.qkv_proj))
        tiles_from_rows, pairs = qkv.tiles_from_rows, qkv.pairs
        if self.decode_stack is not None and not (self.lora is not None and self.lora.active):
            ks, vs, pool_of = self.decode_stack.caches(meta)
            tp = () if self.fused_all_reduce is None else self.fused_all_reduce.take_exchanges(2 * len(ks))
            stack = self.decode_stack
            return torch.ops.tokenmill.decode_layers(
                x, stack.weights, stack.layouts, [cos for cos, _ in ropes], [sin for _, sin in ropes], ks, vs,
                [pool.slot_mapping for pool in pools], tables, meta.decode_lengths, pool_of, stack.windows,
                stack.heads, stack.kv_heads, eps, stack.scale, tiles_from_rows, stack.gelu, bf16_rows, *tp,
                pairs=pairs)
        pending = torch.empty(0)
        layers = zip(cast(list[DecoderLayer], self.layers), cast(list, self.fused_decode), ropes, strict=True)
        for i, (layer, (weights, layouts), (cos, sin)) in enumerate(layers):
            attn = layer.self_attn
            pool, index = meta.of_layer(i)
            tp = () if self.fused_all_reduce is None else self.fused_all_reduce.take_exchanges(2)
            lora = {}
            if self.lora is not None and self.lora.active:  # the step's rows' slots and the adapters' factors
                mlp = cast(MLP, layer.mlp)
                weights = [*weights, self.lora.row_slots,
                           *fused_factors((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))]
                lora = {"lora_rank": self.lora.rank}
            pending = torch.ops.tokenmill.decode_layer(
                x, pending, weights, layouts, cos, sin, *pool.kv_of(index), pool.slot_mapping,
                tables[pool is not meta], meta.decode_lengths, attn.num_heads, attn.num_kv_heads, eps, attn.scale,
                tiles_from_rows, attn.window, cast(MLP, layer.mlp).gelu, bf16_rows, *tp, **lora, pairs=pairs)
        return pending


@dataclass
class DecodeStack:
    """Every layer's fused-decode tensors in one list, as kernels/layer.cpp's decode_layers takes them (the loop over
    the layers in C++: one call a decode step), and what the layers share."""

    weights: list[torch.Tensor]
    layouts: list[int]
    windows: list[int]
    heads: int
    kv_heads: int
    scale: float
    gelu: bool
    # the KV pools' per-layer tensors and each layer's pool, for the pools they were read from (caches())
    _caches: tuple[tuple, list[torch.Tensor], list[torch.Tensor], list[int]] | None = None

    @staticmethod
    def of(model: LlamaModel) -> DecodeStack | None:
        """The stack of model's fused layers; None where they differ in more than the window (one call takes one
        set of head counts, scale, norm epsilon and activation)."""
        layers = cast(list[DecoderLayer], list(model.layers))
        shared = {(layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.scale,
                   layer.input_layernorm.eps, cast(MLP, layer.mlp).gelu) for layer in layers}
        if len(shared) != 1 or model.fused_decode is None:
            return None
        heads, kv_heads, scale, _, gelu = shared.pop()
        return DecodeStack([w for weights, _ in model.fused_decode for w in weights],
                           [n for _, layouts in model.fused_decode for n in layouts],
                           [layer.self_attn.window for layer in layers], heads, kv_heads, scale, gelu)

    def caches(self, meta: PagedMetadata) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Each layer's k and v in its pool, and its pool (0: meta's, 1: meta.sliding's), kept while the pools
        are the same."""
        pools = (meta.k_layers, None if meta.sliding is None else meta.sliding.k_layers)
        if self._caches is None or any(a is not b for a, b in zip(self._caches[0], pools, strict=True)):
            where = [meta.of_layer(i) for i in range(len(self.windows))]
            kv = [pool.kv_of(index) for pool, index in where]
            self._caches = (pools, [k for k, _ in kv], [v for _, v in kv],
                            [0 if pool is meta else 1 for pool, _ in where])
        return self._caches[1], self._caches[2], self._caches[3]


def _fused_decode_runs(meta: AttentionMetadata, x: torch.Tensor, below: int | None) -> TypeGuard[PagedMetadata]:
    """A decode step (one new token per sequence) on a paged pool, of fewer rows than `below` if given."""
    return isinstance(meta, PagedMetadata) and meta.num_decodes == x.shape[0] < (below or x.shape[0] + 1)


# Checkpoint tensors stacked (along dim 0, in this order) into one parameter, so that each group runs as one matmul.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_INTO = {part: (fused, i) for fused, parts in _FUSED.items() for i, part in enumerate(parts)}


class LlamaForCausalLM(nn.Module):
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.head_rows or config.vocab_size,
                                                  bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a flat batch."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(getattr(self, "lm_head", None), QuantizedLinear):
            logits = self.lm_head(hidden, float_out=True).float()
        elif hasattr(self, "lm_head"):
            logits = self.lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()  # tied to the embeddings
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def prepack_weights(self) -> None:
        """Swap every Linear for a prepacked one (CPU); a tied output head gets a packed copy of the embeddings."""
        if self.config.tie_word_embeddings and not hasattr(self, "lm_head"):
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)
        prepack_linears(self)

    def keep_bf16_for_kernels(self, exact_only: bool) -> int:
        """Swap the dense Linears for the kernels' bf16 layout (layers/quantized.py's bf16_linears); a tied output
        head gets the embeddings in that layout, and the lookup then reads the head's rows: one copy of the table,
        not two. Returns how many."""
        tied = self.config.tie_word_embeddings and not hasattr(self, "lm_head")
        if tied:
            self.lm_head = linear_of(self.model.embed_tokens.weight, None)
        kept = bf16_linears(self, exact_only)
        head = self.lm_head
        if tied and isinstance(head, QuantizedLinear) and head.weight.bits == 16:
            self.set_submodule("model.embed_tokens", QuantizedEmbedding(head.weight,
                                                                         self.model.embed_tokens.weight.dtype))
        return kept

    def make_row_invariant(self) -> None:
        """Deterministic mode: every dense matmul, the tied output head's too, on fixed row tiles."""
        if not hasattr(self, "lm_head"):
            self.lm_head = linear_of(self.model.embed_tokens.weight, None)
        make_row_invariant(self)

    def _part_rows(self, target: str) -> list[int]:
        """The rows (along dim 0) each checkpoint tensor takes in a fused parameter, in _FUSED's order."""
        c = self.config
        if target.endswith("qkv_proj.weight") or target.endswith("qkv_proj.bias"):
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if ".experts." in target:  # every expert's gate, then every expert's up (layers/moe.py)
            return [c.num_experts] * 2
        return [c.intermediate_size] * 2

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], dtype: torch.dtype,
                     device: torch.device) -> None:
        """Take checkpoint tensors (Hugging Face names and layout) as the parameters, in dtype on device.

        gpt-fast's way: the tensors are gathered into a state dict, q/k/v and gate/up stacked as they are read, and
        load_state_dict takes it strict (every parameter, each of its shape) and by assignment (the tensors become
        the parameters, so the model can stay on the meta device until now). Names the model has no parameter for
        are skipped: rotary inv_freq buffers some checkpoints carry, lm_head.weight where the head is tied.
        A QuantizedWeight (GGUF weights kept quantized) replaces its Linear or Embedding by the quantized module.
        """
        wanted = self.state_dict(keep_vars=True)  # names and shapes (on the meta device: nothing is allocated)
        state: dict[str, torch.Tensor] = {}
        quantized: dict[str, QuantizedWeight] = {}
        parts: dict[str, list[torch.Tensor | QuantizedWeight | None]] = {}  # fused parameter -> its parts so far
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            fused, index = _FUSED_INTO.get(leaf, (None, 0))
            target = name if fused is None else f"{parent}.{fused}.{kind}"
            if target not in wanted:
                log.debug("skipping checkpoint tensor %s: the model has no parameter %s", name, target)
                continue
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(device=device, dtype=dtype)
            if fused is None:
                _put(state, quantized, target, tensor)
                continue
            rows = self._part_rows(target)
            expected = _as_matrix((rows[index], *wanted[target].shape[1:]), tensor)
            if tuple(tensor.shape) != expected:
                raise ModelFormatError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {expected}")
            group = parts.setdefault(target, [None] * len(rows))
            group[index] = tensor
            if all(part is not None for part in group):
                _put(state, quantized, target, _stack(cast(list, parts.pop(target)), dtype))
        for target, group in parts.items():  # groups with a part missing
            parent, fused, kind = target.rsplit(".", 2)
            lacking = [f"{parent}.{part}.{kind}" for part, got in zip(_FUSED[fused], group, strict=True) if got is None]
            raise ModelFormatError(f"the checkpoint lacks {', '.join(lacking)}")
        for target, weight in quantized.items():
            self._swap_in_quantized(target, weight, state, dtype, device, tuple(wanted[target].shape))
        try:
            self.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:  # torch names each missing tensor and each wrong shape
            stacked = [f"{f} stacks {', '.join(p)}" for f, p in _FUSED.items() if f in str(exc)]
            hint = f" ({'; '.join(stacked)})" if stacked else ""
            raise ModelFormatError(f"the checkpoint does not fit the model: {exc}{hint}") from exc

    def _swap_in_quantized(self, target: str, weight: QuantizedWeight, state: dict[str, torch.Tensor],
                           dtype: torch.dtype, device: torch.device, expected: tuple[int, ...]) -> None:
        """Replace the Linear or Embedding whose weight is target by its quantized module (the bias, if any, moves
        along), in the layout of device's kernels; a tied output head reads the same quantized embeddings."""
        if tuple(weight.shape) != _as_matrix(expected, weight):
            raise ModelFormatError(f"{target}: checkpoint shape {tuple(weight.shape)}, model expects {expected}")
        path = target.removesuffix(".weight")
        if isinstance(self.get_submodule(path), StackedWeight):  # experts: [items, out, in] as items * out rows
            self.set_submodule(path, QuantizedStacked(weight, expected[0]))
        elif isinstance(self.get_submodule(path), nn.Embedding):
            table = on_device(weight, device)
            self.set_submodule(path, QuantizedEmbedding(table, dtype))
            if self.config.tie_word_embeddings:
                self.lm_head = linear_module(table, None)
        else:
            self.set_submodule(path, linear_module(on_device(weight, device), state.pop(f"{path}.bias", None)))


def _as_matrix(shape: tuple[int, ...], value: torch.Tensor | QuantizedWeight) -> tuple[int, ...]:
    """A stacked [items, out, in] shape as a QuantizedWeight holds it (items * out rows); others as they are."""
    if isinstance(value, QuantizedWeight) and len(shape) == 3:
        return shape[0] * shape[1], shape[2]
    return shape


def _put(state: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight], target: str,
         value: torch.Tensor | QuantizedWeight) -> None:
    if isinstance(value, QuantizedWeight):
        quantized[target] = value
    else:
        state[target] = value.contiguous()


def _stack(group: list[torch.Tensor | QuantizedWeight], dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """A fused parameter from its parts: quantized where every part is; else dense."""
    if all(isinstance(part, QuantizedWeight) for part in group):
        return QuantizedWeight.stack(cast(list[QuantizedWeight], group))
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in group])

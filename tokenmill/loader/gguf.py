"""GGUF files through the `gguf` package: metadata, model config and weights, dequantized to the compute dtype or
kept in their quantization (gguf_blocks.py).

Weights come out under Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...) in Hugging Face layout,
so the model has one loading path for GGUF and safetensors.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFEndian, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from tokenmill.errors import ModelFormatError
from tokenmill.layers.quantized import INTERLEAVE, QuantizedWeight
from tokenmill.loader.gguf_blocks import QUANTIZED_TYPES, quantized_weight
from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import MODEL_CLASSES

# The registry's architectures under the names GGUF files carry: llama.cpp converts Mistral models as "llama" (q and
# k rows permuted as Llama's, undone below), so no GGUF says "mistral" (gguf's MODEL_ARCH has no such name).
ARCHITECTURES = tuple(arch for arch in MODEL_CLASSES if arch != "mistral")
SUPPORTED_TYPES = {
    QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router, and the experts' weights stacked [experts, ...]
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Architectures llama.cpp converts with Llama's q/k row permutation (its rope type NORM; undone below).
_PERMUTED = ("llama", "granitemoe")
_MOE = ("qwen3moe", "olmoe", "granitemoe")
# Gemma 3's four norms a layer: llama.cpp names the one before the MLP ffn_norm, as Llama's second norm.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3: the last of every six layers is global (the GGUF names no pattern), the sliding layers'
# RoPE base is 10,000 (no key either), and the attention scale is head_dim^-0.5 but for the 27B model (62 layers),
# whose query_pre_attn_scalar is hidden / heads.
GEMMA3_GLOBAL_EVERY = 6
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _CheckedReader(GGUFReader):
    """GGUFReader that refuses, fast, what a crafted file could make it do: read past the end of the file (the
    stock reader silently returns a short array there) or walk a count that the bytes left cannot hold."""

    _MIN_BYTES: dict[int, int] = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if offset + int(count) * np.dtype(dtype).itemsize > len(self.data):
            raise ValueError(f"a read of {int(count)} x {np.dtype(dtype).name} at byte {offset} runs past the end "
                             f"of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _check_count(self, offset: int, count: int, min_size: int, what: str) -> None:
        if int(count) * min_size > len(self.data) - offset:
            raise ValueError(f"{what} count {int(count)} at byte {offset} cannot fit in the "
                             f"{len(self.data) - offset} bytes left")

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == GGUFValueType.ARRAY:
            item_type, length = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item_type)  # type: ignore[call-overload]
            min_size = np.dtype(scalar).itemsize if scalar is not None else self._MIN_BYTES.get(item_type, 1)
            self._check_count(orig_offs + 12, length, min_size, "array item")
            # The stock reader makes a numpy view per item: a 262,144-token vocabulary (Gemma 3) took ~20 s and
            # ~150 MiB. Arrays of scalars are one view here, arrays of strings a memoryview slice each (the parts
            # ReaderField.contents reads; the items' length fields are left out of parts).
            head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            types = [GGUFValueType.ARRAY, GGUFValueType(item_type)] if length else [GGUFValueType.ARRAY]
            if scalar is not None:
                items = self._get(orig_offs + 12, scalar, length)
                return 12 + items.nbytes, [*head, items], [2], types
            if item_type == GGUFValueType.STRING:
                size, strings = self._strings(orig_offs + 12, length)
                return 12 + size, head + strings, list(range(2, 2 + length)), types
        return super()._get_field_parts(orig_offs, raw_type)

    def _strings(self, offset: int, count: int) -> tuple[int, list[memoryview]]:
        """count strings (a uint64 length, then its bytes) from offset: their bytes, and the size they take."""
        data, end, pos = self.data.data, len(self.data), offset  # .data: the map as a memoryview
        order: Any = "little" if (self.byte_order == "I") == (sys.byteorder == "little") else "big"
        strings = []
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"a string length at byte {pos} runs past the end of the file ({end} bytes)")
            size = int.from_bytes(data[pos:pos + 8], order)
            pos += 8
            if size > end - pos:
                raise ValueError(f"a string of {size} bytes at byte {pos} runs past the end of the file ({end} bytes)")
            strings.append(data[pos:pos + size])
            pos += size
        return pos - offset, strings

    def _build_fields(self, offs: int, count: int) -> int:
        self._check_count(offs, count, 8 + 4 + 1, "metadata key")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> Any:
        self._check_count(offs, count, 8 + 4 + 4 + 8, "tensor")
        return super()._build_tensor_info(offs, count)


class GGUFFile:
    """An opened GGUF file: metadata as plain Python values, tensors memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = _CheckedReader(self.path)
        except Exception as exc:  # the reader raises bare ValueError/KeyError/RecursionError on malformed files
            raise ModelFormatError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        if self.reader.endianess == GGUFEndian.BIG:
            # gguf's dequantize reads tensor data as little-endian whatever the file says
            raise ModelFormatError(f"{self.path} is a big-endian GGUF file; tokenmill loads little-endian ones")
        self.metadata: dict[str, Any] = {}
        for name, field in self.reader.fields.items():
            if name.startswith("GGUF."):
                continue
            self.metadata[name] = field.contents()
        self.architecture: str = self.metadata.get("general.architecture", "")

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


def model_config(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"unsupported architecture {arch!r} in {gguf.path.name}; supported: {', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in gguf.reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{gguf.path.name} has no token_embd.weight tensor")
    hidden = _positive_int(gguf, "embedding_length")
    num_heads = _positive_int(gguf, "attention.head_count")
    embed = tensors["token_embd.weight"]
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = tuple(tensors["rope_freqs.weight"].data.tolist())  # one float32 per frequency
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=_positive_int(gguf, "feed_forward_length"),
        num_layers=_positive_int(gguf, "block_count"),
        num_heads=num_heads,
        num_kv_heads=_positive_int(gguf, "attention.head_count_kv", num_heads),
        head_dim=_positive_int(gguf, "attention.key_length", hidden // num_heads),
        rms_norm_eps=_positive_float(gguf, "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_positive_float(gguf, "rope.freq_base", 10000.0),
        max_position_embeddings=_positive_int(gguf, "context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_freq_factors=freq_factors,
    )
    if arch == "gemma3":
        _gemma3_config(gguf, config)
    if arch in _MOE:
        _moe_config(gguf, config)
    # The model is allocated from the metadata: it must describe the tensors the file holds, or a crafted header
    # could claim a model far larger than the file.
    in_file = sum(int(t.n_elements) for t in gguf.reader.tensors if _hf_name(t.name, arch))
    if config.num_parameters() != in_file:
        raise ModelFormatError(
            f"{gguf.path.name}: the metadata describes a model of {config.num_parameters()} weights, the file holds "
            f"{in_file}")
    return config


def _gemma3_config(gguf: GGUFFile, config: ModelConfig) -> None:
    config.hidden_act = "gelu_tanh"
    config.embedding_multiplier = config.hidden_size**0.5
    if config.num_layers == 62:
        config.query_pre_attn_scalar = config.hidden_size / config.num_heads
    config.sliding_window = _positive_int(gguf, "attention.sliding_window")
    config.sliding_layers = tuple((i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(config.num_layers))
    scaling = gguf.arch_value("rope.scaling.type")
    if scaling == "linear":  # the global layers' (4B and larger); llama.cpp reads the factor as transformers does
        factor = _positive_float(gguf, "rope.scaling.factor", 1.0)
        config.rope_freq_factors = (factor,) * (config.head_dim // 2)
    elif scaling not in (None, "none"):
        raise ModelFormatError(f"{gguf.path.name}: unsupported rope scaling {scaling!r}")


def _moe_config(gguf: GGUFFile, config: ModelConfig) -> None:
    """llama.cpp's keys; it renormalises the chosen experts' weights for Qwen3-MoE and Granite, not for OLMoE."""
    config.num_experts = _positive_int(gguf, "expert_count")
    config.num_experts_per_tok = _positive_int(gguf, "expert_used_count")
    config.moe_intermediate_size = _positive_int(gguf, "expert_feed_forward_length", config.intermediate_size)
    config.norm_topk_prob = bool(gguf.arch_value("expert_weights_norm", config.architecture != "olmoe"))
    if config.architecture == "olmoe":
        config.qk_norm_per_head = False
        clip = gguf.arch_value("attention.clamp_kqv")
        config.clip_qkv = None if clip is None else _positive_float(gguf, "attention.clamp_kqv", 0.0)
    if config.architecture == "granitemoe":
        config.embedding_multiplier = _positive_float(gguf, "embedding_scale", 1.0)
        config.attention_multiplier = _positive_float(gguf, "attention.scale", config.head_dim**-0.5)
        config.residual_multiplier = _positive_float(gguf, "residual_scale", 1.0)
        config.logits_scaling = _positive_float(gguf, "logit_scale", 1.0)


def _positive_int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gguf.arch_value(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ModelFormatError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is {value!r}, not a positive "
                               f"integer")
    return int(value)


def _positive_float(gguf: GGUFFile, key: str, default: float) -> float:
    value = gguf.arch_value(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise ModelFormatError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is {value!r}, not a positive "
                               f"number")
    return float(value)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it converts Hugging Face's rotate-half RoPE to interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def check_tensor_types(gguf: GGUFFile) -> None:
    for tensor in gguf.reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"{gguf.path.name}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, "
                f"which tokenmill does not load; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
            )


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (Hugging Face name, tensor) pairs one tensor at a time, to bound peak memory: dequantized to dtype, or,
    with keep_quantized, matrices of the types gguf_blocks reads as QuantizedWeights (the rest dequantized). The
    file's types are checked first (check_tensor_types: load_model does, before the tokenizer is read)."""
    for tensor in gguf.reader.tensors:
        name = _hf_name(tensor.name, config.architecture)
        if name is None:
            continue  # rope_freqs is read into the config; anything else is not part of the forward pass
        value: torch.Tensor | QuantizedWeight
        if keep_quantized and tensor.tensor_type in QUANTIZED_TYPES and (
                len(tensor.shape) == 2 or (len(tensor.shape) == 3 and tensor.data.shape[1] % INTERLEAVE == 0)):
            # A 3-D tensor (MoE experts, [experts, rows, bytes]) as one matrix of every expert's rows, each
            # expert's rows whole interleaved groups (layers/moe.py slices them); other 3-D tensors are dequantized.
            value = quantized_weight(tensor.data.reshape(-1, tensor.data.shape[-1]), tensor.tensor_type)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            value = torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)  # a copy: the map is read-only
        if config.architecture in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            order = _unpermute(torch.arange(value.shape[0]), heads)
            value = value.rows(order) if isinstance(value, QuantizedWeight) else value[order]
        yield name, value


_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight")


def lora_halves(path: Path, config: ModelConfig) -> tuple[float, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """A LoRA adapter as llama.cpp's convert_lora_to_gguf.py writes it: its alpha (0 where it gives none), and each
    projection's factors by (layer, Hugging Face module name): "A" [rank, in] and "B" [out, rank] in fp32, B's rows
    in Hugging Face's order where llama.cpp permutes q and k."""
    gguf = GGUFFile(path)
    if gguf.metadata.get("general.type") != "adapter" or gguf.metadata.get("adapter.type") != "lora":
        raise ModelFormatError(f"{path} is no LoRA adapter (a GGUF of general.type adapter, adapter.type lora)")
    arch = "llama" if config.architecture == "mistral" else config.architecture
    if gguf.architecture != arch:
        raise ModelFormatError(f"{path} is an adapter of a {gguf.architecture} model; the model is {arch}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in gguf.reader.tensors:
        base, _, half = tensor.name.rpartition(".")
        found = _PROJECTION.fullmatch(_hf_name(base, arch) or "")
        if half not in ("lora_a", "lora_b") or found is None:
            raise ModelFormatError(f"{path}: {tensor.name} is no LoRA factor of a projection (blk.N.attn_q.weight"
                                   ".lora_a, ...)")
        layer, module = int(found.group(1)), found.group(2)
        value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        if half == "lora_b" and arch in _PERMUTED and module in ("q_proj", "k_proj") and value.dim() == 2:
            heads = config.num_heads if module == "q_proj" else config.num_kv_heads
            if value.shape[0] % (2 * heads) == 0:
                value = value[_unpermute(torch.arange(value.shape[0]), heads)]
        halves.setdefault((layer, module), {})["A" if half == "lora_a" else "B"] = value
    return float(gguf.metadata.get("adapter.lora.alpha", 0.0)), halves

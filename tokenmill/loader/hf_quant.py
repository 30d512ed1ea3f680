"""Quantized Hugging Face checkpoints, read by config.json's `quantization_config`, kept in the kernels' 4-bit
layout where it holds their values exactly, else dequantized at load to the model's dtype: GPTQ and AWQ 4-bit
(AutoGPTQ/GPTQModel and AutoAWQ layouts), FP8 block-wise (`quant_method: fp8`, e4m3 weights with
`weight_scale_inv`, as Qwen3-*-FP8 and DeepSeek ship them), and compressed-tensors' `pack-quantized` (W4A16),
`int-quantized` / `naive-quantized` (INT8 W8A8, weights read as int8) and `float-quantized` (FP8 per tensor,
channel or block).

Each module's parts (qweight, scales, zeros, g_idx …) are gathered as the files stream by. A 4-bit matrix whose
groups run along the input in order (no act-order permutation), of a multiple of 32 wide, becomes a QuantizedWeight
(layers/quantized.py): each group's scale and its zero point as the scale and the min (-scale * zero) of its blocks
of 32, which dequantizes to the reference's values bit for bit where scale * q and scale * zero are exact in fp32
(fp16 or bf16 scales: GPTQ and AWQ store fp16; or a symmetric scheme, whose zero is the layout's own). A symmetric
int8 matrix (W8A8's weights) takes the one-byte layout, its scale on each block. Any other matrix is computed in
fp32, exactly as the format's reference dequantization computes it, and cast once. Everything the model does not
quantize (norms, embeddings, the head where ignored) passes through. Anything else is refused at start, naming
what: an unknown quant_method, bit width, group size or strategy, or a scale whose shape does not fit its weight.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight

log = logging.getLogger(__name__)

_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs the 8 nibbles of a word in the order 0 2 4 6 1 3 5 7
_FP8 = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Args:
    """How one module's weights are quantized."""

    kind: str  # int or float
    bits: int
    strategy: str  # tensor, channel, group or block
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class Scheme:
    method: str  # gptq, awq, fp8, compressed-tensors
    args: Args  # the gptq/awq/fp8 settings; compressed-tensors: its first group's (groups: the rest)
    groups: tuple[tuple[tuple[str, ...], Args, str], ...] = ()  # compressed-tensors: (targets, args, format)
    ignore: tuple[str, ...] = ()
    desc_act: bool = False
    zeros_offset: int = 1  # GPTQ v1 checkpoints store each zero point minus one

    def describe(self) -> str:
        a = self.args
        size = f", group {a.group_size}" if a.group_size else f", blocks {a.block}" if a.block else ""
        return f"{self.method} ({a.kind}{a.bits}, {a.strategy}{size})"


def scheme_of(cfg: dict[str, Any], folder: Path) -> Scheme | None:
    """The checkpoint's quantization (None: a dense checkpoint); ModelFormatError naming what is not supported."""
    q = cfg.get("quantization_config")
    if q is None:
        return None

    def refuse(what: str) -> ModelFormatError:
        return ModelFormatError(f"{folder}: quantization_config: {what}")

    method = q.get("quant_method")
    if method in ("gptq", "awq"):
        bits, group = q.get("bits", 4), q.get("group_size", 128)
        if bits != 4:
            raise refuse(f"{method} with {bits} bits: only 4-bit is supported")
        if not isinstance(group, int) or (group != -1 and (group < 32 or group % 32)):
            raise refuse(f"group_size {group}: -1 or a multiple of 32")
        if method == "awq" and q.get("version", "gemm").lower() != "gemm":
            raise refuse(f"awq version {q.get('version')!r}: only gemm is supported")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"checkpoint_format {fmt!r}: gptq or gptq_v2")
        strategy = "channel" if group == -1 else "group"
        args = Args("int", 4, strategy, None if group == -1 else group, symmetric=bool(q.get("sym", True)))
        return Scheme(method, args, desc_act=bool(q.get("desc_act", False)),
                      zeros_offset=1 if method == "gptq" and fmt == "gptq" else 0)
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise refuse(f"fp8 fmt {q.get('fmt')!r}: only e4m3 is supported")
        block = q.get("weight_block_size")
        if block is None:
            return Scheme("fp8", Args("float", 8, "tensor"), ignore=tuple(q.get("modules_to_not_convert") or ()))
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(f"weight_block_size {block!r}: two positive whole numbers")
        return Scheme("fp8", Args("float", 8, "block", block=(block[0], block[1])),
                      ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(q, refuse)
    raise refuse(f"quant_method {method!r}: supported are gptq, awq, fp8 and compressed-tensors")


_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _compressed_tensors(q: dict[str, Any], refuse: Any) -> Scheme:
    groups = []
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights")
        if w is None:
            raise refuse(f"config_groups.{name}: no weights quantization (activations only are not supported)")
        fmt = group.get("format") or q.get("format")
        if fmt not in _CT_FORMATS:
            raise refuse(f"format {fmt!r}: supported are {', '.join(_CT_FORMATS)}")
        kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
        if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
            raise refuse(f"config_groups.{name}.weights: {kind} with {bits} bits: int4, int8 or float8")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise refuse(f"config_groups.{name}.weights.strategy {strategy!r}: tensor, channel, group or block")
        size = w.get("group_size")
        if strategy == "group" and (not isinstance(size, int) or size < 1):
            raise refuse(f"config_groups.{name}.weights.group_size {size!r}: a positive whole number")
        block = w.get("block_structure")
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
            raise refuse(f"config_groups.{name}.weights.block_structure {block!r}: two whole numbers")
        args = Args(kind, bits, strategy, size if strategy == "group" else None,
                    tuple(block) if strategy == "block" else None, bool(w.get("symmetric", True)))
        groups.append((tuple(group.get("targets") or ("Linear",)), args, fmt))
    if not groups:
        raise refuse("compressed-tensors without config_groups")
    return Scheme("compressed-tensors", groups[0][1], tuple(groups), tuple(q.get("ignore") or ()))


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    """A compressed-tensors target or ignore entry: a module name, "re:" and a regex, or a class (Linear: every
    projection)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif pattern == "Linear" or module == pattern or module.endswith("." + pattern):
            return True
    return False


# The parts each format stores for a quantized module, by suffix; None: required, False: where the scheme has it.
_PARTS: dict[str, dict[str, bool | None]] = {
    "gptq": {"qweight": None, "qzeros": None, "scales": None, "g_idx": False},
    "awq": {"qweight": None, "qzeros": None, "scales": None},
    "fp8": {"weight": None, "weight_scale_inv": None},
    "pack-quantized": {"weight_packed": None, "weight_scale": None, "weight_shape": None, "weight_zero_point": False,
                       "weight_g_idx": False},
    "int-quantized": {"weight": None, "weight_scale": None, "weight_zero_point": False, "weight_g_idx": False},
    "float-quantized": {"weight": None, "weight_scale": None, "weight_zero_point": False},
}
_PARTS["naive-quantized"] = _PARTS["int-quantized"]
# Activation settings of W8A8 and FP8 checkpoints: the weights are dequantized, activations run in the model's dtype.
_ACTIVATION_PARTS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "input_global_scale",
                     "weight_global_scale")


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], scheme: Scheme, dtype: torch.dtype,
                keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with every quantized module's parts replaced by its weight (in the kernels' 4-bit
    layout where keep_quantized and it fits exactly, else in `dtype`), the rest cast to `dtype`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    count = kept = 0

    def weight(module: str, fmt: str, args: Args, parts: dict[str, torch.Tensor]) -> torch.Tensor | QuantizedWeight:
        nonlocal count, kept
        count += 1
        blocks = _as_blocks(module, fmt, args, scheme, parts) if keep_quantized else None
        if blocks is not None:
            kept += 1
            return blocks
        return _dequantize(module, fmt, args, scheme, parts).to(dtype)

    for name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        found = _format_of(scheme, module, suffix, tensor)
        if found is None:
            if suffix not in _ACTIVATION_PARTS:
                yield name, tensor.to(dtype, copy=True)
            continue
        fmt, args = found
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if len(parts) == len(_PARTS[fmt]):  # every part it may have: done now (else once the files are read)
            yield f"{module}.weight", weight(module, fmt, args, pending.pop(module))
    for module, parts in pending.items():
        first = next(iter(parts))
        fmt, args = _format_of(scheme, module, first, parts[first])  # type: ignore[misc]
        missing = [p for p, required in _PARTS[fmt].items() if required is None and p not in parts]
        if missing:
            raise ModelFormatError(f"the checkpoint lacks {module}.{missing[0]} ({scheme.method})")
        yield f"{module}.weight", weight(module, fmt, args, parts)
    log.info("%s checkpoint: %d matrices kept quantized in the kernels' layouts, %d dequantized to %s at load",
             scheme.describe(), kept, count - kept, str(dtype).removeprefix("torch."))


def _format_of(scheme: Scheme, module: str, suffix: str, tensor: torch.Tensor) -> tuple[str, Args] | None:
    """The format and settings a tensor is a part of (None: a tensor the model takes as it is)."""
    if scheme.method in ("gptq", "awq"):
        return (scheme.method, scheme.args) if suffix in _PARTS[scheme.method] else None
    if scheme.method == "fp8":
        if _matches(module, scheme.ignore):
            return None
        if suffix == "weight_scale_inv" or (suffix == "weight" and tensor.dtype in _FP8):
            return "fp8", scheme.args
        return None
    if _matches(module, scheme.ignore):
        return None
    for targets, args, fmt in scheme.groups:
        if _matches(module, targets) and suffix in _PARTS[fmt]:
            if suffix == "weight" and tensor.dtype not in (torch.int8, *_FP8):
                return None  # a dense weight of a module the groups do not quantize after all
            return fmt, args
    return None


def _check(module: str, part: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelFormatError(f"{module}.{part} has shape {tuple(tensor.shape)}; its weight needs {shape}")


def _unpack_rows(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words of 8 nibbles along the last dimension -> their 4-bit values, the last dimension 8 times as
    long (nibble i of a word at bits 4i, or at bits 4 * order[i])."""
    shifts = torch.tensor([4 * (order[i] if order else i) for i in range(8)], dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def _dequantize(module: str, fmt: str, args: Args, scheme: Scheme, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt == "gptq":
        return _gptq(module, args, scheme, parts)
    if fmt == "awq":
        return _awq(module, args, parts)
    if fmt == "fp8":
        return _fp8_block(module, args, parts["weight"], parts["weight_scale_inv"])
    if fmt == "pack-quantized":
        shape = tuple(int(v) for v in parts["weight_shape"].tolist())
        q = _unpack_rows(parts["weight_packed"])[:, :shape[1]].to(torch.int32) - 8  # stored with an offset of 8
        _check(module, "weight_packed", parts["weight_packed"], (shape[0], -(-shape[1] // 8)))
        zero = parts.get("weight_zero_point")
        if zero is not None:  # packed along the output dimension
            zero = _unpack_rows(zero.t().contiguous()).t()[:shape[0]].to(torch.int32) - 8
        return _scaled(module, args, q, parts["weight_scale"], zero, parts.get("weight_g_idx"))
    weight = parts["weight"]
    q = weight.float() if weight.dtype in _FP8 else weight.to(torch.int32)
    zero = parts.get("weight_zero_point")
    return _scaled(module, args, q, parts["weight_scale"], None if zero is None else zero.to(torch.int32),
                   parts.get("weight_g_idx"))


def _as_blocks(module: str, fmt: str, args: Args, scheme: Scheme, parts: dict[str, torch.Tensor]
               ) -> QuantizedWeight | None:
    """A 4-bit matrix in the kernels' layout, or None where that would not hold the reference's values exactly."""
    if fmt in ("int-quantized", "naive-quantized"):
        return _as_int8_blocks(args, parts)
    if fmt not in ("gptq", "awq", "pack-quantized"):
        return None
    if fmt == "gptq":
        qweight = parts["qweight"]
        q = _unpack_rows(qweight.t().contiguous())  # [out, in]
        zero = (_unpack_rows(parts["qzeros"]) + scheme.zeros_offset).t()  # [out, groups]
        scale = parts["scales"].t()
        if "g_idx" in parts and not torch.equal(parts["g_idx"].long(), torch.arange(q.shape[1]) //
                                                (args.group_size or q.shape[1])):
            return None  # act-order: a group's columns are scattered along the input
    elif fmt == "awq":
        q = _unpack_rows(parts["qweight"], _AWQ_ORDER).t()
        zero = _unpack_rows(parts["qzeros"], _AWQ_ORDER).t()
        scale = parts["scales"].t()
    else:
        if args.strategy not in ("group", "channel") or parts.get("weight_g_idx") is not None:
            return None
        rows, cols = (int(v) for v in parts["weight_shape"].tolist())
        q = _unpack_rows(parts["weight_packed"])[:, :cols]  # stored with an offset of 8: zero 8 is symmetric's
        scale = parts["weight_scale"]
        stored = parts.get("weight_zero_point")
        zero = torch.full_like(scale, 8, dtype=torch.int32) if stored is None else \
            _unpack_rows(stored.t().contiguous()).t()[:rows]
        if tuple(scale.shape) != (rows, 1 if args.strategy == "channel" else -(-cols // (args.group_size or cols))):
            return None  # _dequantize names the mismatch
    rows, cols = q.shape
    group = args.group_size or cols
    if cols % 32 or group % 32 or tuple(scale.shape) != (rows, -(-cols // group)) or zero.shape != scale.shape:
        return None
    exact = scale.dtype in (torch.float16, torch.bfloat16)
    symmetric = bool((zero == 8).all())
    if not (exact or symmetric):
        return None
    per_block = group // 32
    scales = scale.float().repeat_interleave(per_block, dim=1)[:, :cols // 32]
    nibbles = q.to(torch.uint8).view(rows, cols // 32, 2, 16)
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(rows, cols // 2)
    if symmetric:
        return QuantizedWeight.interleave(packed, _narrowest(scales), None, 8, 32)
    mins = -(scale.float() * zero.float()).repeat_interleave(per_block, dim=1)[:, :cols // 32]
    return QuantizedWeight.interleave(packed, scales, mins, 0, 32)


def _as_int8_blocks(args: Args, parts: dict[str, torch.Tensor]) -> QuantizedWeight | None:
    """A symmetric int8 matrix (W8A8's weights) as the kernels' one-byte layout, its scale repeated over each block
    of 32: q * scale, as the reference computes it."""
    q = parts["weight"]
    rows, cols = q.shape
    if q.dtype != torch.int8 or parts.get("weight_zero_point") is not None or cols % 32:
        return None
    scale = parts["weight_scale"].float()
    if args.strategy == "channel" and tuple(scale.shape) == (rows, 1):
        blocks = scale.expand(rows, cols // 32)
    elif args.strategy == "group" and (args.group_size or 1) % 32 == 0 and \
            tuple(scale.shape) == (rows, -(-cols // (args.group_size or cols))):
        blocks = scale.repeat_interleave((args.group_size or cols) // 32, dim=1)[:, :cols // 32]
    elif args.strategy == "tensor" and scale.numel() == 1:
        blocks = scale.reshape(1, 1).expand(rows, cols // 32)
    else:
        return None
    return QuantizedWeight.interleave(q, _narrowest(blocks.contiguous()), None, 0, 32)


def _narrowest(scales: torch.Tensor) -> torch.Tensor:
    """fp16 where that holds every scale (the kernel reads 2 bytes less a block), else fp32."""
    half = scales.half()
    return half if torch.equal(half.float(), scales) else scales


def _scaled(module: str, args: Args, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
            g_idx: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' (q - zero) * scale in fp32, the scale (and zero) broadcast by the strategy."""
    rows, cols = q.shape
    scale = scale.float()
    if args.strategy == "tensor":
        _check(module, "weight_scale", scale, tuple(scale.shape) if scale.numel() == 1 else (1,))
        scale = scale.reshape(1, 1)
    elif args.strategy == "channel":
        _check(module, "weight_scale", scale, (rows, 1))
    elif args.strategy == "group":
        size = args.group_size or cols
        _check(module, "weight_scale", scale, (rows, -(-cols // size)))
        columns = g_idx.long() if g_idx is not None else torch.arange(cols) // size
        scale = scale[:, columns]
        zero = None if zero is None else zero[:, columns]
    else:
        assert args.block is not None
        (br, bc) = args.block
        _check(module, "weight_scale", scale, (-(-rows // br), -(-cols // bc)))
        scale = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    if zero is not None and args.strategy in ("tensor", "channel"):
        zero = zero.reshape(-1, 1) if args.strategy == "channel" else zero.reshape(1, 1)
    values = q.float() if zero is None else (q - zero).float()
    return values * scale


def _gptq(module: str, args: Args, scheme: Scheme, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPTQ: qweight [in/8, out] packed along the input, qzeros [groups, out/8] and scales [groups, out];
    w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i] (act-order) or i // group_size."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    cols, rows = qweight.shape[0] * 8, qweight.shape[1]
    groups = 1 if args.group_size is None else -(-cols // args.group_size)
    _check(module, "scales", scales, (groups, rows))
    _check(module, "qzeros", qzeros, (groups, rows // 8))
    q = _unpack_rows(qweight.t().contiguous()).t()  # [in, out]
    zero = _unpack_rows(qzeros) + scheme.zeros_offset  # [groups, out]
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check(module, "g_idx", g_idx, (cols,))
        group = g_idx.long()
        if int(group.min()) < 0 or int(group.max()) >= groups:
            raise ModelFormatError(f"{module}.g_idx names a group outside the {groups} its scales hold")
    else:
        group = torch.arange(cols) // (args.group_size or cols)
    return ((q - zero[group]).float() * scales.float()[group]).t().contiguous()


def _awq(module: str, args: Args, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """AWQ (GEMM): qweight [in, out/8] and qzeros [groups, out/8] packed along the output in AWQ's nibble order,
    scales [groups, out]; w[o, i] = scale[i // group_size, o] * (q[i, o] - zero[i // group_size, o])."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    cols, rows = qweight.shape[0], qweight.shape[1] * 8
    groups = 1 if args.group_size is None else -(-cols // args.group_size)
    _check(module, "scales", scales, (groups, rows))
    _check(module, "qzeros", qzeros, (groups, rows // 8))
    q = _unpack_rows(qweight, _AWQ_ORDER)
    zero = _unpack_rows(qzeros, _AWQ_ORDER)
    group = torch.arange(cols) // (args.group_size or cols)
    return ((q - zero[group]).float() * scales.float()[group]).t().contiguous()


def _fp8_block(module: str, args: Args, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Block-wise FP8: each block of weight_block_size is its e4m3 values times its weight_scale_inv."""
    rows, cols = weight.shape
    if args.strategy == "tensor":
        _check(module, "weight_scale_inv", scale_inv, tuple(scale_inv.shape) if scale_inv.numel() == 1 else (1,))
        return weight.float() * scale_inv.float().reshape(1, 1)
    assert args.block is not None
    br, bc = args.block
    _check(module, "weight_scale_inv", scale_inv, (-(-rows // br), -(-cols // bc)))
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scale

"""Architecture name -> model class, and building a model without paying for a random initialisation."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill import backend, cpu
from tokenmill.config import WeightPlan
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.kernels import gpu
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.linear import can_prepack, linear_of
from tokenmill.layers.memory import huge_page_copies
from tokenmill.layers.moe import QuantizedStacked
from tokenmill.layers.quantized import DENSE_FROM_ROWS, GpuQuantizedLinear, QuantizedLinear, QuantizedWeight
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# The dense copies' budget by default, for bf16 on a CPU with AMX whose tiles are not run by our kernel
# (--amx-from-rows 0), where oneDNN's tile matmuls on the copies beat the integer kernel. Elsewhere none: the kernel
# is as fast as the matmul library or faster, and copies take 2-4x the quantized weights' memory
# (docs/performance/tuning.md).
AUTO_DENSE_BUDGET = 1 << 30

# From this many rows a bf16 model's steps run its quantized matrices on AMX tiles by default (kernels/tiles.cpp),
# and then no dense copies are made by default: from about there the tiles beat the integer kernel
# (docs/performance/tuning.md).
AUTO_TILES_FROM_ROWS = 24
# bf16 weights (kept for the kernels: bf16_kernels) are the tiles themselves, nothing to dequantize: every step runs
# on them by default (as fast as the fp32 kernel at one row, faster from 8: docs/performance/tuning.md).
AUTO_BF16_TILES_FROM_ROWS = 1


class CausalLM(Protocol):
    """What the engine needs of a model: hidden states of a flat batch, and logits of chosen rows."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# A new family adds its class here (the loaders read this list). The MoE families are the Llama decoder with a
# sparse MLP (models/config.py says how each differs); Gemma 3 is it with changes of its own.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3moe": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM,
    "granitemoe": LlamaForCausalLM,
}


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], plan: WeightPlan,
                dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    """The model of `config` on `weights`, in `dtype` on `device` (plan's, resolved), laid out as plan says
    (config.WeightPlan): prepacked for the CPU's matmul library where it helps (layers/linear.py); dense copies of
    quantized matrices for many-row steps within dense_budget (all or none; None: AUTO_DENSE_BUDGET for bf16 on an
    AMX CPU, else none), or without them steps of dequantize_from_rows rows or more dequantizing each matrix; decode
    steps fused into one C++ op a layer where the kernels run its weights (CPU: kept quantized, or bf16 ones kept
    for them); deterministic: each row's result depends on that row alone, whatever the batch (check_deterministic);
    tiles_from_rows: a bf16 model's steps of this many rows or more run its quantized matrices on AMX tiles where
    the CPU has them (0: never; None: AUTO_TILES_FROM_ROWS, or AUTO_BF16_TILES_FROM_ROWS where all are bf16
    weights); bf16_kernels: on a CPU where the kernels run, dense matrices of bf16 values are kept in the kernels'
    16-bit layout and run by them, as quantized ones are."""
    deterministic = plan.deterministic
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelFormatError(f"no model for architecture {config.architecture!r}")
    if deterministic:
        check_deterministic(device)
    with torch.device("meta"):  # no memory, no random init: the checkpoint's tensors become the parameters
        model = cls(config, max_positions)
    model.load_weights(weights, dtype, device)
    for module in model.modules():  # tables outside the state dict (non-persistent buffers), built where they run
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    if plan.bf16_kernels and not deterministic and backend.vector_kernels(device):
        kept = model.keep_bf16_for_kernels(exact_only=dtype != torch.bfloat16)
        if kept:
            log.info("%d dense matrices kept in bf16 for tokenmill's kernels (--no-bf16-kernels: oneDNN's)", kept)
    if plan.huge_pages and device.type == "cpu":
        _place_on_huge_pages(model)
    _choose_pairs(model, dtype, plan.bf16_pair_matmul)
    if deterministic:  # the quantized kernel computes each row on its own; a dense copy's library would not
        log.info("deterministic: every step runs the quantized kernels (no dense copies); dense matmuls on fixed "
                 "row tiles; one attention kernel for prefill and decode")
    else:
        quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        tiles = _use_tiles(quantized, dtype, device, plan.tiles_from_rows)
        # bf16 weights are a dense bf16 matrix already: a copy would only double them
        _add_dense_copies([m for m in quantized if m.weight.bits < 16], dtype, plan.dense_budget,
                          plan.dequantize_from_rows, tiles)
        _add_gpu_dense_copies([m for m in model.modules() if isinstance(m, GpuQuantizedLinear)], dtype,
                              plan.dense_budget)
    if plan.prepack and can_prepack(device, dtype):
        model.prepack_weights()  # the dense copies too: they are Linears like the rest
    if deterministic:
        model.make_row_invariant()
    # Deterministic bf16 stays per-op: the fused layer's fp32 residual stream would round otherwise than the per-op
    # layers of a mixed step that holds the same sequence.
    fuse = plan.fused_decode and not (deterministic and dtype != torch.float32)
    if fuse and backend.cpu_kernels(device) and model.model.fuse_decode_layers(plan.stacked_decode):
        below = model.model.fused_decode_below
        log.info("decode steps%s run each layer as one fused op", f" of fewer than {below} rows" if below else "")
    return model.eval()


def _place_on_huge_pages(model: nn.Module) -> None:
    """Move the weights that tokenmill's kernels read as they lie (every module's QuantizedWeight: quantized, or bf16
    kept for the kernels) into one mapping the OS may back with huge pages (layers/memory.py). A weight that two
    modules share (a head tied to the embeddings) is moved once and stays one object."""
    held: list[Any] = [m for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    weights = {id(m.weight): m.weight for m in held}
    tensors = {id(t): t for w in weights.values() for t in (w.qweight, w.scales, w.mins) if t is not None}
    if not tensors:  # a dense model's matrices, run by oneDNN: none kept for the kernels
        return
    copies = huge_page_copies(list(tensors.values()))
    if all(copy is tensor for copy, tensor in zip(copies, tensors.values(), strict=True)):
        log.info("weights the kernels read: on the allocator's pages (no transparent huge pages from this OS)")
        return
    moved = dict(zip(tensors, copies, strict=True))
    placed = {key: dataclasses.replace(w, qweight=moved[id(w.qweight)], scales=moved[id(w.scales)],
                                       mins=None if w.mins is None else moved[id(w.mins)])
              for key, w in weights.items()}
    for m in held:
        m.weight = placed[id(m.weight)]
    log.info("weights the kernels read: %.0f MiB in one mapping advised for huge pages (--no-huge-pages: not)",
             sum(t.nbytes for t in tensors.values()) / 2**20)


def check_deterministic(device: torch.device) -> None:
    """Deterministic mode's kernels: the quantized matmul (each row in a fixed order of blocks), RMSNorm and RoPE
    row by row, and one attention kernel for prefill and decode alike (a query against its keys in order from
    position 0) are tokenmill's C++ kernels, on the CPU."""
    if device.type != "cpu":
        raise ConfigError(f"--deterministic runs on the CPU only (not {device}): its kernels are CPU kernels")
    if not backend.cpu_kernels(device):
        raise ConfigError("--deterministic needs tokenmill's C++ kernels, which are unavailable here (the log says "
                          "why): torch's own attention and matmuls are not batch-invariant")


def _use_tiles(quantized: list[QuantizedLinear], dtype: torch.dtype, device: torch.device,
               tiles_from_rows: int | None) -> bool:
    """Run steps of tiles_from_rows rows or more on AMX tiles, where they can; whether they do."""
    if tiles_from_rows is not None and tiles_from_rows < 0:
        raise ConfigError(f"--amx-from-rows {tiles_from_rows}: a row count, or 0 for never")
    if not quantized or tiles_from_rows == 0:
        return False
    why = None
    if dtype != torch.bfloat16:
        why = f"they multiply in bf16 and the model runs in {str(dtype).removeprefix('torch.')}"
    elif not backend.tiles(device):
        why = "this CPU or build has none"
    if why:
        if tiles_from_rows is not None:  # asked for: say why not
            log.info("AMX tiles unused: %s", why)
        return False
    # One count for the model, as the fused decode layer takes one for its four matrices: from one row where every
    # matrix is bf16 weights (the tiles read them as they lie), else from AUTO_TILES_FROM_ROWS.
    bf16 = all(m.weight.bits == 16 for m in quantized)
    rows = tiles_from_rows or (AUTO_BF16_TILES_FROM_ROWS if bf16 else AUTO_TILES_FROM_ROWS)
    for module in quantized:
        module.tiles_from_rows = rows
    log.info("steps of %d rows or more run the %s matrices on AMX tiles (bf16)", rows, "bf16" if bf16 else "kept")
    return True


def _choose_pairs(model: nn.Module, dtype: torch.dtype, choice: str) -> None:
    """Whether a bf16 model's rows multiply its bf16 weights kept for the kernels as bf16 pairs (asked of the
    backend only where there are such rows and weights). Every kernel matrix gets the answer (only bf16 weights act
    on it): the fused decode layer reads it from its first layer's q|k|v, whatever that one's bits."""
    kernels = [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedStacked)]
    bf16_weights = any(m.weight.bits == 16 for m in kernels)
    if bf16_weights and dtype == torch.bfloat16 and not backend.bf16_pair_matmul(choice):
        for module in kernels:
            module.pairs = False


def _add_dense_copies(quantized: list[QuantizedLinear], dtype: torch.dtype, budget: int | None,
                      dequantize_from_rows: int, tiles: bool) -> None:
    """tiles: whether AMX tiles run the many-row steps (then no copies unless a budget is given)."""
    if not quantized:
        return
    needed = _dense_bytes(quantized, dtype)
    auto = budget is None
    if budget is None:
        budget = AUTO_DENSE_BUDGET if dtype == torch.bfloat16 and cpu.has_amx() and not tiles else 0
    if auto and tiles:
        why = "AMX tiles run the many-row steps (--dense-weights-budget sets them)"
    elif auto and budget == 0:
        why = "they pay for bf16 on a CPU with AMX only (--dense-weights-budget sets them)"
    else:
        why = f"they would take {needed >> 20} MiB, over the budget of {budget >> 20} MiB (--dense-weights-budget)"
    if needed > budget:
        for module in quantized:
            module.dequantize_from_rows = dequantize_from_rows
        after = f"; steps of {dequantize_from_rows} rows or more dequantize each matrix for its matmul" \
            if dequantize_from_rows else ""
        log.info("quantized weights without dense copies: %s; the quantized kernels run the steps%s", why, after)
        return
    _make_dense_copies(quantized, dtype)
    log.info("dense copies of the quantized weights for steps of %d rows or more: %d MiB", DENSE_FROM_ROWS,
             needed >> 20)


def _add_gpu_dense_copies(quantized: list[GpuQuantizedLinear], dtype: torch.dtype, budget: int | None) -> None:
    """On a GPU, steps of more rows than row_matmul takes dequantize each matrix for cuBLAS's matmul, unless the
    budget (none by default: the point of keeping them quantized is the memory) holds dense copies of them all."""
    if not quantized:
        return
    needed = _dense_bytes(quantized, dtype)
    if needed > (budget or 0):
        log.info("quantized weights on the GPU: steps of up to %d rows run row_matmul on them; longer ones dequantize "
                 "each matrix for its matmul (dense copies would take %d MiB: --dense-weights-budget; or "
                 "--no-quantized-weights, dequantized at load)", gpu.QUANTIZED_ROWS, needed >> 20)
        return
    _make_dense_copies(quantized, dtype)
    log.info("quantized weights on the GPU: steps of up to %d rows run row_matmul on them; longer ones dense copies "
             "(%d MiB)", gpu.QUANTIZED_ROWS, needed >> 20)


def _dense_bytes(quantized: list[QuantizedLinear] | list[GpuQuantizedLinear], dtype: torch.dtype) -> int:
    return sum(m.weight.shape[0] * m.weight.shape[1] * dtype.itemsize for m in quantized)


def _make_dense_copies(quantized: list[QuantizedLinear] | list[GpuQuantizedLinear], dtype: torch.dtype) -> None:
    for module in quantized:
        module.dense = linear_of(module.dense_weight(dtype), module.bias)

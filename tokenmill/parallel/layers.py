"""A sharded model's matmuls whose outputs are partial sums (o_proj, down_proj: split by columns) all-reduce them,
wrapping whatever module the weight plan made of them (prepacked, quantized, bf16 for the kernels)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM
from tokenmill.parallel.collectives import Group, ShmGroup


class AllReduced(nn.Module):
    def __init__(self, inner: nn.Module, group: Group) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


def all_reduce_partial_sums(model: LlamaForCausalLM, group: Group) -> None:
    """Wrap each layer's o_proj and down_proj. The fused decode layer (one C++ op a layer) all-reduces through the
    group's shared memory itself; with another group's collectives it no longer runs."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.o_proj = AllReduced(module.o_proj, group)  # type: ignore[assignment]
        elif isinstance(module, MLP):
            module.down_proj = AllReduced(module.down_proj, group)  # type: ignore[assignment]
    if isinstance(group, ShmGroup):
        model.model.fused_all_reduce = group
    else:
        model.model.fused_decode = model.model.decode_stack = None

"""LoRA adapters beside the base model's projections, the S-LoRA/Punica way: every loaded adapter's factors sit in
slots of one stacked tensor per projection, and a step whose rows use different adapters (or none) adds each row's
own adapter's low-rank product, never a merge into the base weights: one op a projection where the C++ kernels run
(kernels/lora.cpp), else two matmuls over all slots with each row's product masked to its own slot's. Ranks below
the slots' are zero-padded, so a padded rank adds exactly zero."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import backend

# The decoder layer's projections that take adapters, and the checkpoint projections stacked in each, in order.
ADAPTED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoRASlots:
    """What every LoRALinear of a model shares: the slots' count and rank, and the step's rows' slots (set by the
    runner before a step, through `begin_step`)."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.rank = slots, rank
        self.dtype, self.device = dtype, device
        self.active = False  # whether the step has a row with an adapter
        # whether the products run as kernels/lora.cpp's op (else two matmuls and a mask)
        self.kernel = backend.cpu_kernels(device) and dtype in _KERNEL_DTYPES
        self.row_slots = torch.empty(0, dtype=torch.long)  # the step's: each row's slot, -1 for the base model
        self._onehot = torch.empty(0)
        self._masks: dict[int, torch.Tensor] = {}

    def begin_step(self, row_slots: list[int]) -> None:
        """The step's rows' slots (-1: the base model alone)."""
        self._masks.clear()
        self.active = any(slot >= 0 for slot in row_slots)
        if self.active:
            self.row_slots = torch.tensor(row_slots, device=self.device)
            if not self.kernel:
                self._onehot = (self.row_slots[:, None] == torch.arange(self.slots, device=self.device)).to(self.dtype)

    def end_step(self) -> None:
        self.active = False
        self._masks.clear()

    def mask(self, parts: int) -> torch.Tensor:
        """[rows, slots * parts * rank]: 1 in the columns of each row's slot, 0 elsewhere."""
        mask = self._masks.get(parts)
        if mask is None:
            mask = self._masks[parts] = self._onehot.repeat_interleave(parts * self.rank, dim=1)
        return mask


class LoRALinear(nn.Module):
    """A projection (any module of x -> base output) with the slots' adapters beside it. parts: the (in, out)
    features of each checkpoint projection stacked in it (q, k, v; gate, up; or one)."""

    def __init__(self, base: nn.Module, slots: LoRASlots, parts: list[tuple[int, int]]) -> None:
        super().__init__()
        self.base = base
        self.lora = slots
        self.parts = parts
        width = len(parts) * slots.rank  # one slot's columns of the shrunk rows
        fan_in = parts[0][0]
        # a: each slot's parts' A stacked [slots * parts * rank, in]; b: each part's B^T [slots * rank, out]
        self.a = torch.zeros(slots.slots * width, fan_in, dtype=slots.dtype, device=slots.device)
        self.b = [torch.zeros(slots.slots * slots.rank, out, dtype=slots.dtype, device=slots.device)
                  for _, out in parts]
        self.offsets = [sum(out for _, out in parts[:i]) for i in range(len(parts))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.lora.active:
            return y
        rows, parts, rank, slots = x.shape[0], len(self.parts), self.lora.rank, self.lora.slots
        if self.lora.kernel:  # each row its own slot's product, one op (kernels/lora.cpp)
            torch.ops.tokenmill.lora_add(y, x, self.lora.row_slots, self.a, self.b, rank)
            return y
        shrunk = torch.mm(x, self.a.t()).mul_(self.lora.mask(parts))  # [rows, slots * parts * rank]
        if parts == 1:
            return y.addmm_(shrunk, self.b[0])
        by_part = shrunk.view(rows, slots, parts, rank)
        for part, (b, offset) in enumerate(zip(self.b, self.offsets, strict=True)):
            y[:, offset:offset + b.shape[1]].addmm_(by_part[:, :, part].reshape(rows, slots * rank), b)
        return y

    def put(self, slot: int, factors: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load one adapter's factors of each part (A [r, in], B [out, r] scaled; None: the part not adapted)
        into a slot, zeros elsewhere."""
        self.clear(slot)
        rank, parts = self.lora.rank, len(self.parts)
        for part, found in enumerate(factors):
            if found is None:
                continue
            a, b = found
            r = a.shape[0]
            first = (slot * parts + part) * rank
            self.a[first:first + r] = a.to(self.a.dtype)
            self.b[part][slot * rank:slot * rank + r] = b.t().to(self.a.dtype)

    def clear(self, slot: int) -> None:
        width = len(self.parts) * self.lora.rank
        self.a[slot * width:(slot + 1) * width] = 0
        for b in self.b:
            b[slot * self.lora.rank:(slot + 1) * self.lora.rank] = 0


def fused_factors(projections: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """A decoder layer's q|k|v, o, gate|up and down LoRALinears' factors as the fused decode layer takes them
    (kernels/layer.cpp): each one's a, then its parts' b."""
    return [t for m in projections if isinstance(m, LoRALinear) for t in (m.a, *m.b)]


def base_of(module: nn.Module) -> nn.Module:
    """The projection under a LoRALinear (the fused decode kernel reads the base weights)."""
    return module.base if isinstance(module, LoRALinear) else module

"""The engine's LoRA adapters: the slots beside the model's projections (layers/lora.py), which adapter holds which
slot, and each adapter's prefix-cache salt, so that KV computed under one adapter is never shared with another (nor
with the base model). Loads and unloads run on the engine thread, between steps."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from tokenmill.errors import RequestError
from tokenmill.layers.lora import ADAPTED, LoRALinear, LoRASlots
from tokenmill.loader.lora import LoRAAdapter, projection_shapes
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSlot:
    slot: int
    salt: int  # the prefix cache's namespace: one per load, never reused


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots = LoRASlots(max_loras, max_rank, dtype, device)
        self.max_rank = max_rank
        self.adapters: dict[str, AdapterSlot] = {}
        self.users: Counter[int] = Counter()  # slot -> unfinished sequences using it
        self._free = list(range(max_loras))
        self._salts = itertools.count(1)
        shapes = projection_shapes(config)
        self.wrapped: list[dict[str, LoRALinear]] = []
        inner = model.model
        for layer in inner.layers:
            wrapped = {}
            for fused, parts in ADAPTED.items():
                parent = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
                wrapper = LoRALinear(getattr(parent, fused), self.slots, [shapes[p] for p in parts])
                setattr(parent, fused, wrapper)
                wrapped[fused] = wrapper
            self.wrapped.append(wrapped)
        inner.lora = self.slots

    def load(self, adapter: LoRAAdapter) -> None:
        """Put an adapter in a free slot (the engine thread, between steps)."""
        if adapter.name in self.adapters:
            raise RequestError(f"the LoRA adapter {adapter.name} is already loaded", param="lora_name")
        if not self._free:
            raise RequestError(f"{self.slots.slots} LoRA adapters are loaded, as many as --max-loras allows: unload "
                               "one first", param="lora_name")
        slot = self._free.pop(0)
        for layer, wrapped in enumerate(self.wrapped):
            for fused, wrapper in wrapped.items():
                wrapper.put(slot, [adapter.factors.get((layer, part)) for part in ADAPTED[fused]])
        self.adapters[adapter.name] = AdapterSlot(slot, next(self._salts))
        log.info("LoRA adapter %s loaded into slot %d (rank %d, %s)", adapter.name, slot, adapter.rank,
                 ", ".join(sorted(adapter.targets)))

    def unload(self, name: str) -> None:
        """Free an adapter's slot; refused while a sequence uses it."""
        found = self.adapters.get(name)
        if found is None:
            raise RequestError(f"the LoRA adapter {name} is not loaded", param="lora_name")
        if self.users[found.slot]:
            raise RequestError(f"the LoRA adapter {name} has {self.users[found.slot]} requests in flight",
                               param="lora_name")
        for wrapped in self.wrapped:
            for wrapper in wrapped.values():
                wrapper.clear(found.slot)
        del self.adapters[name]
        self._free.append(found.slot)
        log.info("LoRA adapter %s unloaded", name)

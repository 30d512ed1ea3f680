"""Turns the scheduler's plan into flat tensors, runs the model once and returns the logits to sample from."""

from __future__ import annotations

import torch

from tokenmill.cache.kv_cache import KVCache
from tokenmill.engine.scheduler import ScheduledSequence
from tokenmill.layers.attention import SequenceSlice
from tokenmill.models.registry import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def run(self, plan: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits [n, vocab] for the plan's n sampling items, in plan order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        for item in plan:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.tokens(start, end)
            positions += range(start, end)
            slices.append(SequenceSlice(seq.seq_id, start, item.num_tokens))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache.prepare(slices))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

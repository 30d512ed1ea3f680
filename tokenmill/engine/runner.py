"""Turns the scheduler's plan into flat tensors, runs the model once and returns the logits to sample from."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.cache.kv_cache import KVCache, SequenceSlice
from tokenmill.engine.request import Sequence
from tokenmill.engine.scheduler import ScheduledSequence


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def execute(self, plan: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits [n, vocab] for the n sequences whose step ends at their last token."""
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for item in plan:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.tokens(start, end)
            positions += range(start, end)
            slices.append(SequenceSlice(seq.seq_id, start, item.num_tokens))
            if end == seq.num_tokens:  # a decode step, or the last chunk of a prompt: a new token is due
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache.prepare(slices))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), sampled

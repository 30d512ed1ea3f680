"""Turns the scheduler's plan into flat tensors, runs the model once and returns the logits to sample from."""

from __future__ import annotations

import torch

from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import KVCache
from tokenmill.engine.graphs import DecodeGraphs
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import token_logprobs
from tokenmill.engine.scheduler import ScheduledSequence
from tokenmill.layers.attention import SequenceSlice
from tokenmill.layers.lora import LoRASlots
from tokenmill.models.registry import CausalLM

PROMPT_ROWS = 256  # prompt logprobs: rows of logits computed at once (SmolLM2's vocabulary: 50 MB in fp32)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs  # decode steps that fit one are replayed from a CUDA graph
        self.lora = lora  # the LoRA adapters' slots: each row of a step runs with its sequence's

    @torch.inference_mode()
    def run(self, plan: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits for the plan's sampling items, in plan order: one row each, or 1 + k rows
        for an item with k proposed tokens (the rows after its decode token and after each proposal)."""
        if self.graphs is not None and self._replays(plan):
            seqs = [item.seq for item in plan]
            at = [seq.num_computed_tokens for seq in seqs]
            return self.graphs.run([seq.tokens(p, p + 1)[0] for seq, p in zip(seqs, at, strict=True)], at,
                                   [seq.seq_id for seq in seqs])
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        pooled: list[tuple[ScheduledSequence, int, int]] = []  # embeddings: (item, first row, end row)
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # prompt logprobs: (seq, first row, position, rows)
        for item in plan:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.tokens(start, end - len(item.draft)) + item.draft
            positions += range(start, end)
            slices.append(SequenceSlice(seq.seq_id, start, item.num_tokens, as_decodes=bool(item.draft)))
            if item.samples:
                sample_rows += range(len(input_ids) - 1 - len(item.draft), len(input_ids))
            if seq.pooling is not None and (item.pools or seq.pooling == "mean"):  # last: the final chunk only
                pooled.append((item, len(input_ids) - item.num_tokens, len(input_ids)))
            if seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids) - 1:
                # a prompt chunk's rows whose next token is the prompt's too
                prompt_rows.append((seq, len(input_ids) - item.num_tokens, start,
                                    min(end, len(seq.prompt_ids) - 1) - start))
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.lora is not None:
            self.lora.begin_step([item.seq.lora_slot for item in plan for _ in range(item.num_tokens)])
        try:
            hidden = self.model(ids, pos, metadata.prepare(self.kv_cache, slices))
        finally:
            if self.lora is not None:
                self.lora.end_step()
        for item, first, end in pooled:
            self._pool(item, hidden[first:end])
        for seq, first, position, count in prompt_rows:
            self._prompt_logprobs(seq, hidden[first:first + count], position)
        if len(sample_rows) == len(input_ids):  # every row samples (a decode step): they are hidden's, in order
            return self.model.compute_logits(hidden)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def _replays(self, plan: list[ScheduledSequence]) -> bool:
        """Whether a captured graph runs the step: one sampled token per sequence, no proposals, no pooling, a batch
        no larger than the largest graph."""
        assert self.graphs is not None
        return self.graphs.size_for(len(plan)) is not None and all(
            item.num_tokens == 1 and item.samples and not item.draft and item.seq.pooling is None for item in plan)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, position: int) -> None:
        """The logprob entries of the prompt tokens after position.. (each row's next token), PROMPT_ROWS rows of
        logits at a time: a whole chunk's would take rows x vocabulary floats at once."""
        k = seq.params.prompt_logprobs
        assert k is not None
        for at in range(0, hidden.shape[0], PROMPT_ROWS):
            rows = hidden[at:at + PROMPT_ROWS]
            first = position + at + 1
            targets = torch.tensor(seq.prompt_ids[first:first + rows.shape[0]], device=self.device)
            for i, entry in enumerate(token_logprobs(self.model.compute_logits(rows).float(), targets, k)):
                seq.prompt_logprobs[first + i] = entry

    @staticmethod
    def _pool(item: ScheduledSequence, hidden: torch.Tensor) -> None:
        """Fold one prompt chunk's hidden states into its sequence's pooled vector: last, the final chunk's last
        row; mean, a running fp32 sum over the chunks (a chunk from position 0 starts it afresh: a recompute after
        preemption). A copy, never a view that would keep the step's hidden states alive."""
        seq = item.seq
        if seq.pooling == "last":
            seq.pooled = hidden[-1].to(torch.float32, copy=True)
            return
        chunk_sum = hidden.float().sum(0)
        seq.pooled = chunk_sum if seq.pooled is None or seq.num_computed_tokens == 0 else seq.pooled + chunk_sum

"""Decides each step's work: which sequences decode, which prompts (or prompt chunks) prefill, who is admitted.

A pure policy over the queues and the KV cache's bookkeeping; it never touches a tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.request import Sequence, Status


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # new tokens to run this step (a prompt chunk, or 1 when decoding)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class KVAllocator(Protocol):
    """What the scheduler needs from KV memory: room for a sequence, and giving it back."""

    def allocate(self, seq_id: int, capacity: int) -> None: ...
    def free(self, seq_id: int) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVAllocator) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        """Running sequences first (decode, or the next chunk of their prompt), then admit waiting ones."""
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledSequence] = []
        for seq in self.running:
            if budget == 0:
                break
            todo = min(seq.num_tokens - seq.num_computed_tokens, budget)
            plan.append(ScheduledSequence(seq, todo))
            budget -= todo
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            self.kv.allocate(seq.seq_id, len(seq.prompt_ids) + seq.max_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            todo = min(len(seq.prompt_ids), budget)
            plan.append(ScheduledSequence(seq, todo))
            budget -= todo
        return plan

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, aborted or failed) and give back its KV memory."""
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

"""Decides each step's work: which sequences decode, which prompt chunks prefill, who is admitted or preempted.

A pure policy over the queues and the KV cache's bookkeeping (reserve/free); it never touches a tensor. Progress is
one number per sequence, num_computed_tokens: prefill, chunked prefill and recompute after preemption are all
"run the tokens from num_computed_tokens on".
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
    chunked_prefill: bool = True
    # A prompt of more than this many tokens is long. While other sequences decode, long
    # prompts together get at most long_prefill_chunk tokens a step, so the decoders' inter-token latency stays
    # low; short prompts go whole, so a burst of ordinary requests is admitted at once. 0: no cap.
    long_prefill_token_threshold: int = 0
    long_prefill_chunk: int = 0
    # Context length at which a token's attention costs as much as its projections and MLP: a long prompt's chunk
    # shrinks as its context grows (tokens x (1 + context / this) stays within long_prefill_chunk). 0: no shrink.
    attention_crossover: int = 0


class KVReserver(Protocol):
    """What the scheduler needs from KV memory."""

    def reserve(self, seq_id: int, num_tokens: int, final_len: int) -> bool: ...
    def free(self, seq_id: int) -> None: ...
    def match_prefix(self, seq_id: int, tokens: list[int]) -> int: ...
    def cache(self, seq_id: int, tokens: list[int]) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVReserver) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at first admission
        self.prefix_hit_tokens = 0  # of those, tokens found
        # Sequences whose batch failed: each runs alone until one of its steps succeeds, to find the culprit.
        self.isolated: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _final_len(self, seq: Sequence) -> int:
        return len(seq.prompt_ids) + seq.max_tokens

    def _chunk(self, seq: Sequence, budget: int, long_budget: float | None) -> int:
        """Tokens of seq to run now: 1 when decoding, else its next prompt chunk within the budgets.

        long_budget: what long prompts may still take this step (None: no cap), in token units where a token at
        context c counts 1 + c / attention_crossover."""
        todo = seq.num_tokens - seq.num_computed_tokens
        if todo == 1:
            return 1
        if not self.config.chunked_prefill:
            # Whole prompts only; one larger than the budget runs when it would be first in the step.
            return todo if todo <= budget or budget == self.config.max_num_batched_tokens else 0
        if long_budget is None or not self._is_long(seq):
            return min(todo, budget)
        if long_budget <= 0:
            return 0
        # At least one token while any of the budget is left: a prompt so deep in its context that one token
        # costs more than the whole cap still advances, rather than waiting until nobody decodes.
        return min(todo, budget, max(1, int(long_budget / self._token_weight(seq))))

    def _is_long(self, seq: Sequence) -> bool:
        """Long by its whole length, so that the tail of a long prompt (deep in its context, the costliest
        tokens) is chunked too."""
        return seq.num_tokens > self.config.long_prefill_token_threshold

    def _token_weight(self, seq: Sequence) -> float:
        """A prompt token's cost in chunk units: its projections and MLP (1) plus attention over its context."""
        crossover = self.config.attention_crossover
        return 1 + seq.num_computed_tokens / crossover if crossover else 1.0

    def _charge(self, seq: Sequence, n: int, long_budget: float | None) -> float | None:
        """What is left of the long-prompt budget after seq, a long prompt, runs n tokens."""
        decode = seq.num_tokens - seq.num_computed_tokens == 1
        if long_budget is None or decode or not self._is_long(seq):
            return long_budget
        return long_budget - n * self._token_weight(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back a sequence's KV, first offering what it computed to the prefix cache."""
        self.kv.cache(seq.seq_id, seq.tokens(0, seq.num_computed_tokens))
        self.kv.free(seq.seq_id)

    def _evict(self, seq: Sequence) -> None:
        """Free a running sequence's KV; it recomputes (from the prefix cache, where it can) and resumes before
        anyone new."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._evict(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSequence]:
        if self.isolated:
            return self._schedule_isolated()
        budget = self.config.max_num_batched_tokens
        decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        cap = self.config.long_prefill_chunk
        long_budget: float | None = cap if decoding and cap and self.config.long_prefill_token_threshold else None
        plan: list[ScheduledSequence] = []
        preempted = False
        for seq in list(self.running):
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget, long_budget)
            if n == 0:
                continue
            # Out of blocks: preempt the newest running sequence until this one fits (or is itself the newest).
            while not self.kv.reserve(seq.seq_id, seq.num_computed_tokens + n, self._final_len(seq)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            plan.append(ScheduledSequence(seq, n))
            budget -= n
            long_budget = self._charge(seq, n, long_budget)
            if budget == 0:
                break
        # Admit only when nothing had to be preempted: memory is short this step. In arrival order, except that a
        # long prompt out of budget for this step lets the prompts behind it through.
        for seq in [] if preempted else list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cached = self.kv.match_prefix(seq.seq_id, seq.tokens(0, seq.num_tokens))
            seq.num_computed_tokens = cached
            n = self._chunk(seq, budget, long_budget)
            fits = n > 0 and self.kv.reserve(seq.seq_id, seq.num_computed_tokens + n, self._final_len(seq))
            if not fits:
                self.kv.free(seq.seq_id)  # drop the prefix references; it is looked up again next time
                seq.num_computed_tokens = 0
                if n == 0:
                    continue
                break  # out of memory: nobody overtakes
            if seq.num_cached_tokens is None:  # first admission (not a resume after preemption)
                seq.num_cached_tokens = cached
                self.prefix_queried_tokens += len(seq.prompt_ids)
                self.prefix_hit_tokens += cached
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append(ScheduledSequence(seq, n))
            budget -= n
            long_budget = self._charge(seq, n, long_budget)
        # Decodes lead the flat batch: the runner and attention treat them as one group.
        plan.sort(key=lambda item: item.num_tokens > 1)
        return plan

    def _schedule_isolated(self) -> list[ScheduledSequence]:
        """One suspect alone, all its remaining tokens in one step."""
        seq = self.isolated[0]
        if seq.status == Status.WAITING:
            if not self.kv.reserve(seq.seq_id, seq.num_tokens, self._final_len(seq)):
                self.isolated.clear()  # no room to run it alone: back to normal scheduling
                return self.schedule()
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        return [ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens)]

    def isolate(self, seqs: list[Sequence]) -> None:
        """After a failed batch: drop the sequences' KV and rerun each alone, to fail only the one that raises."""
        for seq in seqs:
            if seq.status == Status.RUNNING:
                self._evict(seq)
            self.isolated.append(seq)

    def step_succeeded(self, plan: list[ScheduledSequence]) -> None:
        """Record the step's progress; a prompt whose prefill just completed becomes shareable at once."""
        if self.isolated and plan and plan[0].seq is self.isolated[0]:
            self.isolated.popleft()
        for item in plan:
            seq = item.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_tokens
            if before < len(seq.prompt_ids) <= seq.num_computed_tokens:
                self.kv.cache(seq.seq_id, seq.prompt_ids)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, aborted or failed) and give back its KV memory."""
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            if reason == "error":
                self.kv.free(seq.seq_id)
            else:
                self._release(seq)
        else:
            self.waiting.remove(seq)
        if seq in self.isolated:
            self.isolated.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

"""Decides each step's work and records its result: which sequences decode, which prompt chunks prefill, who is
admitted or preempted, which tokens a step appended and which sequences that finished.

A pure policy over the queues and the KV cache's bookkeeping (reserve/free); it never touches a tensor. Progress is
one number per sequence, num_computed_tokens: prefill, chunked prefill and recompute after preemption are all
"run the tokens from num_computed_tokens on".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Owner, Sequence, Status

# The fair share weighs what each owner was served over about the last FAIR_SHARE_HALF_LIFE * 2 tokens the engine
# ran: each token served halves the weight of what came before it over this many tokens.
FAIR_SHARE_HALF_LIFE = 4096
# An owner whose first request in a while arrives while others have work is placed level with the least served of
# them less this many tokens (against its weight): it comes first for about that long, as a newcomer should, but
# what the others were served while it was away (the engine was theirs) is not held against them.
RETURN_CREDIT = 256
# The weight of a decode step's newest time in the running mean of a decode's time (shared_step_ms).
DECODE_TIME_WEIGHT = 0.2


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # new tokens to run this step (a prompt chunk, or 1 when decoding), the draft's included
    # Speculative decoding: proposed tokens run after the decode token, each position then sampled and kept while
    # the sample equals the proposal (engine/spec.py).
    draft: list[int] = field(default_factory=list)
    # A new token is due after this step: a decode, or the last chunk of a prompt.
    samples: bool = field(init=False)
    # An embedding's prompt ends with this step: its pooled vector is done (it never samples).
    pools: bool = field(init=False)

    def __post_init__(self) -> None:
        last = self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens
        self.samples = last and self.seq.pooling is None
        self.pools = last and self.seq.pooling is not None


@dataclass
class SchedulerStats:
    """Counts since the last take_stats()."""

    preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache at first admission
    prefix_hit_tokens: int = 0  # of those, tokens found


@dataclass
class _Budget:
    """What is left of one step: tokens, and what long prompts may still take (None: no cap), in token units
    where a token at context c counts 1 + c / attention_crossover."""

    tokens: int
    long: float | None


class TextStop(Protocol):
    def __call__(self, seq: Sequence, token: int, reason: str | None) -> str | None:
        """The reason `token`, just appended to seq, ends it, given `reason`, the one its id alone gives."""
        ...


class KVReserver(Protocol):
    """What the scheduler needs from KV memory."""

    def reserve(self, seq_id: int, num_tokens: int, final_len: int, computed: int = 0) -> bool: ...
    def free(self, seq_id: int) -> None: ...
    def match_prefix(self, seq_id: int, tokens: list[int], salt: int = 0) -> int: ...
    def cache(self, seq_id: int, tokens: list[int], salt: int = 0) -> None: ...


def _decayed(counts: dict[str, float], decay: float) -> dict[str, float]:
    """Each count times decay, those that come to nothing dropped."""
    return {name: value * decay for name, value in counts.items() if value * decay > 1e-3}


def check_stop(seq: Sequence, token: int, eos_token_ids: set[int] | frozenset[int], max_model_len: int) -> str | None:
    """The finish reason a just-appended token gives its sequence, by token alone (stop strings are text: the
    engine's output side checks them)."""
    p = seq.params
    # A grammar that has ended admits nothing but an end token: it ends the sequence even under ignore_eos.
    ended = seq.grammar is not None and seq.grammar.ended
    if token in p.stop_token_ids or (token in eos_token_ids and (not p.ignore_eos or ended)):
        return "stop"
    if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


class Scheduler:
    """attention_crossover: the context length at which a token's attention costs as much as its projections
    and MLP (models.config); a long prompt's chunk shrinks as its context grows. 0: no shrink."""

    def __init__(self, config: EngineConfig, kv: KVReserver, max_model_len: int,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(), attention_crossover: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.attention_crossover = attention_crossover
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.stats = SchedulerStats()
        # Sequences whose batch failed: each runs alone until one of its steps succeeds, to find the culprit.
        self.isolated: deque[Sequence] = deque()
        # Tokens each owner (a tenant) was served recently, decaying as the engine serves anyone (its share, as the
        # dashboard shows it), and its weight.
        self.served: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        # What the fair share weighs: the same count, but raised for an owner that returns while others have work
        # (_place) and forgotten when the engine empties (service nobody else wanted is owed to nobody). The least
        # standing (against its weight) is admitted first, the most preempted first.
        self.standing: dict[str, float] = {}
        self._newcomers: set[str] = set()  # owners of the sequences this step admits for the first time
        self.decodes = 0  # decodes scheduled so far: each one's turn (Sequence.decode_turn)
        # Seconds a decode costs in a step of decodes (the step's time over its rows, a running mean; None until a
        # step was timed): how many decodes fit in config.shared_step_ms.
        self.decode_seconds: float | None = None

    def add(self, seq: Sequence) -> None:
        if self.config.fair_share:
            self._place(seq.owner)
        self.waiting.append(seq)

    def _place(self, owner: Owner) -> None:
        """An owner with nothing in the engine arrives: at an empty engine everyone starts level (standing
        forgotten); beside others, its standing is raised to RETURN_CREDIT below the least of theirs (against the
        weights), where it was lower."""
        if not self.standing:  # nobody was served lately (or a server without tenants): nothing to be level with
            return
        active = {seq.owner.name for seq in (*self.running, *self.waiting)}
        if not active:
            self.standing.clear()
            return
        if owner.name in active:
            return
        self.weights[owner.name] = owner.weight
        level = (min(map(self._standing, active)) - RETURN_CREDIT) * owner.weight
        if level > self.standing.get(owner.name, 0.0):
            self.standing[owner.name] = level

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_stats(self) -> SchedulerStats:
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    # --- planning a step --------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSequence]:
        if self.isolated:
            return self._schedule_isolated()
        c = self.config
        capped = c.long_prefill_chunk and c.long_prefill_token_threshold and any(s.decoding for s in self.running)
        budget = _Budget(c.max_num_batched_tokens, c.long_prefill_chunk if capped else None)
        plan: list[ScheduledSequence] = []
        self._newcomers = set()
        # Admit only when nothing had to be preempted: memory is short this step.
        if not self._schedule_running(plan, budget, self._sitting_out()):
            self._admit_waiting(plan, budget)
        if c.fair_share and self._newcomers:
            plan = self._favour_newcomers(plan)
        if c.fair_share and c.shared_step_ms:  # the turns _sitting_out keeps
            for seq in sorted((item.seq for item in plan if item.seq.decoding), key=lambda seq: seq.decode_turn):
                self.decodes += 1
                seq.decode_turn = self.decodes
        # Decodes (with their proposals) lead the flat batch: the runner and attention treat them as one group.
        plan.sort(key=lambda item: item.num_tokens > 1 and not item.draft)
        return plan

    def _schedule_running(self, plan: list[ScheduledSequence], budget: _Budget, sitting_out: set[int]) -> bool:
        """Each running sequence's next tokens (but the decodes sitting_out this step, by id), preempting the newest
        while memory is short; True if any was."""
        preempted = False
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.seq_id in sitting_out:
                continue  # preempted earlier in this loop, or sits this step out
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if n > 1 and seq.decoding and not self._reserve(seq, n):
                n = 1  # proposals never preempt anyone: without room for them, a plain decode
            preempted |= self._reserve_preempting(seq, n)
            if seq.status == Status.RUNNING:
                self._take(plan, budget, seq, n)
                if budget.tokens == 0:
                    break
        return preempted

    def _sitting_out(self) -> set[int]:
        """With shared_step_ms, while two or more owners were served recently (or have work): the decodes beyond
        those that fit in that time, the least served owners' (against their weight) taken first and, within an
        owner, whoever decoded longest ago, so that each takes its turn. A newcomer's request waits for the step in
        progress, which this keeps short; the others' decodes then come less often than every step."""
        c = self.config
        if not (c.fair_share and c.shared_step_ms and self.decode_seconds):
            return set()
        decodes = [seq for seq in self.running if seq.decoding]
        fit = max(1, int(c.shared_step_ms / 1000 / self.decode_seconds))
        if len(decodes) <= fit:
            return set()
        owners = {seq.owner.name for seq in (*self.running, *self.waiting)}
        owners |= {name for name, served in self.served.items() if served >= 1.0}
        if len(owners) < 2:
            return set()
        decodes.sort(key=lambda seq: (self._standing(seq.owner.name), seq.decode_turn))
        return {seq.seq_id for seq in decodes[fit:]}

    def time_decodes(self, plan: list[ScheduledSequence], seconds: float) -> None:
        """The time a step took (model and sampling), counted into a decode's time where it ran decodes alone."""
        if not plan or not all(item.seq.decoding for item in plan):
            return
        per = seconds / sum(item.num_tokens for item in plan)
        old = self.decode_seconds
        self.decode_seconds = per if old is None else old + DECODE_TIME_WEIGHT * (per - old)

    def _reserve_preempting(self, seq: Sequence, n: int) -> bool:
        """Room for seq's next n tokens, preempting the newest running sequence until it fits (or seq is itself
        the newest, and goes back to waiting); True if anyone was preempted."""
        preempted = False
        while not self._reserve(seq, n):
            victim = self._victim()
            self._evict(victim)
            self.stats.preemptions += 1
            preempted = True
            if victim is seq:
                break
        return preempted

    def _admit_waiting(self, plan: list[ScheduledSequence], budget: _Budget) -> None:
        """In arrival order, except that a long prompt out of budget for this step lets the prompts behind it
        through (with chunked prefill: its chunk comes in a later step); one that does not fit in memory stops
        admission (nobody overtakes it)."""
        whole_prompts = not self.config.chunked_prefill
        for i, seq in enumerate(self._admission_order()):
            head = i == 0
            if len(self.running) >= self.config.max_num_seqs or (budget.tokens <= 0 and not (head and whole_prompts)):
                return
            # A mean needs every position's hidden state, prompt logprobs every position's logits: such a
            # sequence computes its whole prompt.
            whole = seq.pooling == "mean" or seq.params.prompt_logprobs is not None
            cached = 0 if whole else self.kv.match_prefix(seq.seq_id, seq.tokens(0, seq.num_tokens),
                                                                   seq.cache_salt)
            seq.num_computed_tokens = cached
            n = self._chunk(seq, budget)
            alone = n == 0 and head and whole_prompts
            if alone:
                n = self._alone(seq, plan, budget)
            if n == 0 or not self._reserve(seq, n):
                self.kv.free(seq.seq_id)  # drop the prefix references; it is looked up again next time
                seq.num_computed_tokens = 0
                if n == 0 and not alone:  # out of this step's budget, not of memory
                    continue
                return
            if seq.num_cached_tokens is None:  # first admission (not a resume after preemption)
                seq.num_cached_tokens = cached
                self._newcomers.add(seq.owner.name)
                self.stats.prefix_queried_tokens += len(seq.prompt_ids)
                self.stats.prefix_hit_tokens += cached
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._take(plan, budget, seq, n)

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences in the order they may be admitted: as they came, or with the fair share, each
        owner's in the order they came, the owners taking turns by the service they had (and would have, once
        the prompts before are run), divided by their weight: the least served first."""
        if not self.config.fair_share:
            return list(self.waiting)
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.owner.name, deque()).append(seq)
        if len(queues) < 2:
            return list(self.waiting)
        projected = {name: self._standing(name, queue[0].owner.weight) for name, queue in queues.items()}
        order = []
        while queues:
            name = min(queues, key=projected.__getitem__)  # ties: the owner whose oldest came first
            seq = queues[name].popleft()
            order.append(seq)
            projected[name] += (seq.num_tokens - seq.num_computed_tokens) / seq.owner.weight
            if not queues[name]:
                del queues[name]
        return order

    def _favour_newcomers(self, plan: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The step, or only the work of the owners whose new prompts it admits while their standing is below every
        other owner's in it by more than the lesser of their own standing and half of RETURN_CREDIT (one just
        returned, _place): their first tokens then wait for the step in progress and their own, not for a step of
        everyone's decodes too. The others lose one step to it, which only an owner served so much less can
        cause."""
        owners = {item.seq.owner.name for item in plan}
        if len(owners) < 2:
            return plan
        favoured = set()
        for name in self._newcomers:
            mine = self._standing(name)
            if min(self._standing(other) for other in owners - {name}) - mine > min(mine, RETURN_CREDIT / 2):
                favoured.add(name)
        return [item for item in plan if item.seq.owner.name in favoured] if favoured else plan

    def _victim(self) -> Sequence:
        """Whom to preempt: the newest running sequence, or with the fair share, the newest of the owner served
        most (against its weight)."""
        if not self.config.fair_share or len({seq.owner.name for seq in self.running}) < 2:
            return self.running[-1]
        most = max((seq.owner.name for seq in self.running), key=self._standing)
        return next(seq for seq in reversed(self.running) if seq.owner.name == most)

    def shares(self) -> list[dict[str, object]]:
        """Each owner with work or recent service: its sequences running and waiting, its weight, and its share of
        the tokens served recently (a glance from another thread; the fair share weighs standing, which differs where
        an owner returned or the engine emptied)."""
        owners: dict[str, dict[str, object]] = {}
        for state, group in (("running", tuple(self.running)), ("waiting", tuple(self.waiting))):
            for seq in group:
                entry = owners.setdefault(seq.owner.name, {"tenant": seq.owner.name, "running": 0, "waiting": 0,
                                                           "weight": seq.owner.weight})
                entry[state] += 1  # type: ignore[operator]
        served, weights = dict(self.served), dict(self.weights)
        total = sum(served.values()) or 1.0
        for name in served:
            owners.setdefault(name, {"tenant": name, "running": 0, "waiting": 0, "weight": weights.get(name)})
        for name, entry in owners.items():
            entry["share"] = round(served.get(name, 0.0) / total, 4)
        return sorted(owners.values(), key=lambda entry: str(entry["tenant"]))

    def _count_service(self, plan: list[ScheduledSequence]) -> None:
        """Each owner's service of a step that ran, and the decay of what came before (nothing to count on a server
        without tenants: every sequence is the one nameless owner's)."""
        if not self.served and not any(item.seq.owner.name for item in plan):
            return
        ran = sum(item.num_tokens for item in plan)
        decay = 0.5 ** (ran / FAIR_SHARE_HALF_LIFE)
        # New dicts, filled and then set: shares() reads served from another thread.
        served, standing = _decayed(self.served, decay), _decayed(self.standing, decay)
        for item in plan:
            owner = item.seq.owner
            for counts in (served, standing):
                counts[owner.name] = counts.get(owner.name, 0.0) + item.num_tokens
            self.weights[owner.name] = owner.weight
        self.served, self.standing = served, standing
        if len(self.weights) > 2 * len(served) + 16:  # forget the weights of owners long gone
            self.weights = {name: self.weights[name] for name in served.keys() | standing.keys()}

    def _standing(self, name: str, weight: float | None = None) -> float:
        """An owner's standing against its weight (the one it was last served with, where not given)."""
        weight = self.weights.get(name, 1.0) if weight is None else weight
        return self.standing.get(name, 0.0) / weight

    def _alone(self, seq: Sequence, plan: list[ScheduledSequence], budget: _Budget) -> int:
        """Whole prompts only, and the first in the queue does not fit beside this step's decodes: it runs alone,
        the decodes waiting a step, rather than wait for a step nobody decodes in, which never comes while requests
        keep arriving (the prompts behind it overtook it meanwhile). Its token count, or 0 without KV room."""
        todo = seq.num_tokens - seq.num_computed_tokens
        if not self._reserve(seq, todo):
            return 0
        plan.clear()
        budget.tokens = self.config.max_num_batched_tokens
        return todo

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """KV room for seq's next n tokens."""
        return self.kv.reserve(seq.seq_id, seq.num_computed_tokens + n, seq.final_len, seq.num_computed_tokens)

    def _take(self, plan: list[ScheduledSequence], budget: _Budget, seq: Sequence, n: int) -> None:
        if budget.long is not None and not seq.decoding and self._is_long(seq):
            budget.long -= n * self._token_weight(seq)
        budget.tokens -= n
        plan.append(ScheduledSequence(seq, n, seq.draft[:n - 1] if seq.decoding else []))

    def _chunk(self, seq: Sequence, budget: _Budget) -> int:
        """Tokens of seq to run now: 1 when decoding (with its draft, as far as the budget goes), else its next prompt
        chunk within the budget."""
        if seq.decoding:
            return max(1, min(1 + len(seq.draft), budget.tokens))
        todo = seq.num_tokens - seq.num_computed_tokens
        if not self.config.chunked_prefill:
            # Whole prompts only; one larger than the budget runs when it would be first in the step.
            fits = todo <= budget.tokens or budget.tokens == self.config.max_num_batched_tokens
            return todo if fits else 0
        if budget.long is None or not self._is_long(seq):
            return min(todo, budget.tokens)
        if budget.long <= 0:
            return 0
        # At least one token while any of the budget is left: a prompt so deep in its context that one token
        # costs more than the whole cap still advances, rather than waiting until nobody decodes.
        return min(todo, budget.tokens, max(1, int(budget.long / self._token_weight(seq))))

    def _is_long(self, seq: Sequence) -> bool:
        """Long by its whole length, so that the tail of a long prompt (deep in its context, the costliest
        tokens) is chunked too."""
        return seq.num_tokens > self.config.long_prefill_token_threshold

    def _token_weight(self, seq: Sequence) -> float:
        """A prompt token's cost in chunk units: its projections and MLP (1) plus attention over its context."""
        crossover = self.attention_crossover
        return 1 + seq.num_computed_tokens / crossover if crossover else 1.0

    def _schedule_isolated(self) -> list[ScheduledSequence]:
        """One suspect alone, all its remaining tokens in one step."""
        seq = self.isolated[0]
        if seq.status == Status.WAITING:
            if not self._reserve(seq, seq.num_tokens - seq.num_computed_tokens):
                self.isolated.clear()  # no room to run it alone: back to normal scheduling
                return self.schedule()
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        return [ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens)]

    # --- recording a step -------------------------------------------------------------------------------

    def update(self, plan: list[ScheduledSequence], new_tokens: list[list[int]],
               text: TextStop | None = None) -> list[Sequence]:
        """Record a step that ran: progress for every planned sequence (an embedding whose prompt is done
        finishes), then the sampled tokens (new_tokens[i] for the i-th sampling item of the plan), appended up to
        the first that finishes its sequence, whose KV is then freed. text: the output side's word on each token
        appended (a stop string), which ends the sequence there, the step's later tokens never kept. Returns the
        sequences that finished. Several tokens: a speculative step's accepted proposals and the sample after them;
        the rejected proposals' KV is past num_computed_tokens, so it is overwritten and never cached."""
        if self.isolated and plan and plan[0].seq is self.isolated[0]:
            self.isolated.popleft()
        if self.config.fair_share:
            self._count_service(plan)
        finished = []
        for item in plan:
            seq = item.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_tokens - len(item.draft)  # a draft's KV counts once accepted
            if before < len(seq.prompt_ids):
                # A prompt's full blocks are shareable as each chunk ends: before a sliding window passes them
                # (its layers' blocks are then freed), and for a request that arrives while the prompt still runs.
                self.kv.cache(seq.seq_id, seq.prompt_ids[:seq.num_computed_tokens], seq.cache_salt)
            if item.pools:
                self.finish(seq, "stop")
                finished.append(seq)
        for item, tokens in zip([item for item in plan if item.samples], new_tokens, strict=True):
            seq = item.seq
            for i, token in enumerate(tokens):
                quota = seq.owner.quota
                if quota is not None and not quota.take(1):  # its owner's tokens per minute ran out
                    self.finish(seq, "quota")
                    finished.append(seq)
                    break
                seq.output_ids.append(token)
                if i < len(tokens) - 1:  # an accepted proposal: its KV, computed this step, stands
                    seq.num_computed_tokens += 1
                if seq.grammar is not None:
                    seq.grammar.accept(token)  # the sampler's mask allowed it
                reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
                if text is not None:
                    reason = text(seq, token, reason)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
        return finished

    def isolate(self, seqs: list[Sequence]) -> None:
        """After a failed batch: drop the sequences' KV and rerun each alone, to fail only the one that raises."""
        for seq in seqs:
            if seq.status == Status.RUNNING:
                self._evict(seq)
            self.isolated.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, aborted or failed) and give back its KV memory; the one place a finish reason
        is set. Idempotent, but for an error: a finished sequence whose last output then failed ends with that."""
        if seq.status == Status.FINISHED and reason != "error":
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            if reason == "error":
                self.kv.free(seq.seq_id)  # a failed step's KV is not trusted: not offered to the prefix cache
            else:
                self._release(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        if seq in self.isolated:
            self.isolated.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        """Give back a sequence's KV, first offering what it computed to the prefix cache."""
        self.kv.cache(seq.seq_id, seq.tokens(0, seq.num_computed_tokens), seq.cache_salt)
        self.kv.free(seq.seq_id)

    def _evict(self, seq: Sequence) -> None:
        """Free a running sequence's KV; it recomputes (from the prefix cache, where it can) and resumes before
        anyone new."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

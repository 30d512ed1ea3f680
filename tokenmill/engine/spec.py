"""Speculative decoding: the policy (which sequences get proposals, when they pause) and the proposers, tokens
guessed to follow a sequence, which the next step checks all at once (the scheduler runs them after the decode
token, the sampler's verify keeps those the model would have sampled). Here the lookups in tokens already seen
(prompt lookup, the suffix cache); a draft model's: engine/draft.py.

A decode step reads every weight to produce one token per sequence; checking k proposals in the same forward
costs little more, so when the guesses are often right (answers that copy from the prompt or repeat themselves)
one stream gains several tokens a step.
"""

from __future__ import annotations

import itertools
import logging
import traceback
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Sequence

log = logging.getLogger(__name__)


@dataclass
class AcceptanceGate:
    """Pauses a sequence's proposals while few of them are accepted (each costs a row of the step): an
    exponential average of each check's acceptance (weight `weight`); below `low` the sequence goes `cooldown`
    steps without proposals, the pause doubling with each pause in a row (up to max_cooldown) and back to `cooldown`
    once the average is above `high` again. After a pause the average restarts at `high`: two checks with nothing
    accepted pause it again, so a sequence whose proposals fail costs a few rows now and then, not every step."""

    low: float = 0.2
    high: float = 0.4
    weight: float = 0.3
    cooldown: int = 8
    max_cooldown: int = 256

    def allows(self, seq: Sequence) -> bool:
        """Whether seq proposes this step (one step of its pause goes by if not)."""
        state = seq.speculation
        if state.skip > 0:
            state.skip -= 1
            return False
        return True

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        state = seq.speculation
        state.rate += self.weight * (accepted / proposed - state.rate)
        if state.rate < self.low:
            pause = min(2 * state.cooldown, self.max_cooldown) if state.cooldown else self.cooldown
            state.skip = state.cooldown = pause
            state.rate = self.high
        elif state.rate >= self.high:
            state.cooldown = 0


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens guessed to follow seqs[i]'s tokens (all at once: a draft model batches them)."""
        ...

    def finish(self, seq: Sequence) -> None:
        """seq has finished: what it holds is let go, what it taught is kept for later sequences."""
        ...


class Speculation:
    """The policy around a proposer: which sequences get proposals each step and how many, their acceptance
    recorded (AcceptanceGate), and a proposer that fails let go (proposals only ever save time)."""

    def __init__(self, proposer: Proposer | None, config: EngineConfig, max_model_len: int) -> None:
        self.proposer = proposer
        self.gate = AcceptanceGate()
        self.num_tokens = config.num_speculative_tokens
        self.max_seqs = config.speculative_max_seqs
        self.max_model_len = max_model_len

    def propose(self, running: list[Sequence], waiting: Iterable[Sequence]) -> None:
        """A proposal for each decoding sequence (none with a grammar, whose masks follow accepted tokens only;
        none while its proposals fail), at most what its max_tokens and the context leave room for; none at all
        while more sequences than speculative_max_seqs decode."""
        if self.proposer is None:
            return
        decoding = [s for s in running if s.decoding and s.grammar is None and s.pooling is None]
        going = len([s for s in running if s.decoding]) <= self.max_seqs
        for seq in itertools.chain(running, waiting):
            seq.draft = []
        asking = [seq for seq in (decoding if going else []) if self.gate.allows(seq)]
        ks = [min(self.num_tokens, seq.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens)
              for seq in asking]
        try:
            drafts = self.proposer.propose(asking, ks)
        except Exception:
            log.error("speculative proposals failed, speculation is off from now on:\n%s", traceback.format_exc())
            self.proposer = None
            return
        for seq, draft in zip(asking, drafts, strict=True):
            seq.draft = draft

    def record(self, seqs: list[Sequence], drafts: list[list[int]], tokens: list[list[int]]) -> None:
        """A checked step: each sequence's proposal and the tokens it kept (its accepted proposals, then one)."""
        for seq, draft, kept in zip(seqs, drafts, tokens, strict=True):
            if draft:
                self.gate.record(seq, len(draft), len(kept) - 1)

    def finish(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.finish(seq)


class LookupProposer(ABC):
    """A proposer that looks each sequence's tokens up, one sequence at a time, in what it has seen."""

    @abstractmethod
    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow tokens."""

    @abstractmethod
    def learn(self, tokens: list[int]) -> None:
        """A finished sequence's prompt and output, for the proposals of later ones."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.lookup(seq.tokens(0, seq.num_tokens), k) for seq, k in zip(seqs, ks, strict=True)]

    def finish(self, seq: Sequence) -> None:
        if seq.finish_reason != "error" and seq.pooling is None:
            self.learn(seq.tokens(0, seq.num_tokens))


class NgramProposer(LookupProposer):
    """Prompt lookup: the longest suffix n-gram of the sequence (max_n tokens down to min_n) found earlier in it
    proposes the tokens that followed its latest earlier occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"prompt lookup n-grams of {min_n} to {max_n} tokens"
        self.min_n, self.max_n = min_n, max_n

    def learn(self, tokens: list[int]) -> None:
        """Nothing: each sequence looks in its own tokens only."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        ids = np.asarray(tokens)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself and leave at least one token after them.
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k]
        return []


class SuffixCacheProposer(LookupProposer):
    """Prompt lookup first; where the sequence's own tokens propose nothing, earlier requests' prompts and outputs
    do: every n-gram of theirs (min_n to max_n tokens) maps to what followed it, the latest sequence's winning, up to
    `capacity` n-grams (the least recently used go first). A repeated agent or extraction call is proposed the
    previous answer even where its prompt does not hold it (SuffixDecoding's idea, with a bounded n-gram map in
    place of its suffix tree)."""

    def __init__(self, min_n: int, max_n: int, capacity: int = 200_000) -> None:
        self.own = NgramProposer(min_n, max_n)
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.index: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        draft = self.own.lookup(tokens, k)
        if draft or k <= 0:
            return draft
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            key = tuple(tokens[-n:])
            hit = self.index.get(key)
            if hit is not None:
                self.index.move_to_end(key)
                source, end = hit
                return source[end:end + k]
        return []

    def learn(self, tokens: list[int]) -> None:
        tokens = list(tokens)  # its own copy: the n-grams point into it
        for end in range(self.min_n, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                self.index[key] = (tokens, end)
                self.index.move_to_end(key)
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)

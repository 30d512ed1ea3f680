"""Speculative decoding's draft model: a smaller model of the target's vocabulary guesses each sequence's next k
tokens, greedily, in batched steps of its own over its own paged KV memory.

Greedy guesses are a deterministic proposal, so the target's verify (accept while its sample equals the guess)
keeps the output exactly the target's, whatever the draft. The draft remembers how many of each sequence's tokens
its KV holds: the next proposal runs only what changed since (the accepted guesses, the target's new token), and a
rejected guess's KV is simply overwritten.
"""

from __future__ import annotations

import torch

from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import PagedKVCache
from tokenmill.engine.request import Sequence
from tokenmill.layers.attention import SequenceSlice
from tokenmill.loader import LoadedModel

# Feeds of up to this many tokens (the usual catch-up: the last guess kept and the model's token after it) run as
# decode rows, through the fused decode layer; longer ones (a prompt) as a prefill.
DECODE_ROWS = 8


class DraftModelProposer:
    def __init__(self, draft: LoadedModel, kv_cache: PagedKVCache, vocab_size: int) -> None:
        """vocab_size: the vocabulary's; a draft whose logits are padded wider never proposes past it."""
        self.model = draft.model
        self.device = draft.device
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        # seq id -> what the draft's KV holds from position 0: how many of the sequence's own tokens, then the
        # guesses it ran after them (its last proposal but the final guess), which the target may have rejected
        self.held: dict[int, tuple[int, list[int]]] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        # Per sequence to run: its index, the tokens to feed now, their first position, how many guesses it wants.
        feeds: list[tuple[int, list[int], int, int]] = []
        asking = {seq.seq_id for seq, k in zip(seqs, ks, strict=True) if k > 0}
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k <= 0:
                continue
            # The draft's KV is the sequence's up to the first guess the target did not keep (a sequence may also
            # have gone on for steps without proposals since). The last token always runs: its logits guess.
            own, guesses = self.held.get(seq.seq_id, (0, []))
            kept = seq.tokens(own, own + len(guesses))
            same = next((j for j, (a, b) in enumerate(zip(guesses, kept, strict=False)) if a != b),
                        min(len(guesses), len(kept)))
            start = min(own + same, seq.num_tokens - 1)
            if self._reserve(seq.seq_id, seq.num_tokens + k - 1, asking):
                feeds.append((i, seq.tokens(start, seq.num_tokens), start, k))
        for step in range(max((k for *_, k in feeds), default=0)):
            feeds = [f for f in feeds if f[3] > step]
            feeds.sort(key=lambda f: len(f[1]) > DECODE_ROWS)  # the paged metadata wants decode rows first
            guesses = self._step([(seqs[i].seq_id, fed, start) for i, fed, start, _ in feeds])
            running = []
            for (i, fed, start, k), guess in zip(feeds, guesses, strict=True):
                drafts[i].append(guess)
                running.append((i, [guess], start + len(fed), k))  # the guess runs next, for the one after it
            feeds = running
        for i, draft in enumerate(drafts):
            if draft:
                self.held[seqs[i].seq_id] = (seqs[i].num_tokens, draft[:-1])
        return drafts

    @torch.inference_mode()
    def _step(self, feeds: list[tuple[int, list[int], int]]) -> list[int]:
        """One forward of the draft over each (seq id, tokens, first position): the greedy next token of each."""
        ids = [t for _, fed, _ in feeds for t in fed]
        positions = [p for _, fed, start in feeds for p in range(start, start + len(fed))]
        slices = [SequenceSlice(seq_id, start, len(fed), as_decodes=len(fed) <= DECODE_ROWS)
                  for seq_id, fed, start in feeds]
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            metadata.prepare(self.kv_cache, slices))
        last = torch.tensor([len(fed) for _, fed, _ in feeds], device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last])[:, :self.vocab_size]
        return logits.argmax(-1).tolist()

    def _reserve(self, seq_id: int, num_tokens: int, keep: set[int]) -> bool:
        """Room for seq_id's first num_tokens tokens, taken from sequences not asking now where the pool is short
        (they run their tokens again when they next ask); False if there is none."""
        for other in [s for s in self.held if s not in keep]:
            if self.kv_cache.reserve(seq_id, num_tokens, num_tokens):
                return True
            self._forget(other)
        return self.kv_cache.reserve(seq_id, num_tokens, num_tokens)

    def finish(self, seq: Sequence) -> None:
        self._forget(seq.seq_id)

    def _forget(self, seq_id: int) -> None:
        self.held.pop(seq_id, None)
        self.kv_cache.free(seq_id)

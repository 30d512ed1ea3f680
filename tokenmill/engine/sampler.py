"""Batched sampling with per-request parameters.

Every row of the batch carries its own temperature, filters, penalties, bias and random stream, so a request's
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill import backend
from tokenmill.engine.request import Sequence, TokenLogprob
from tokenmill.structured.backend import GrammarCompiler

_NEG_INF = float("-inf")


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Ragged id lists as one [rows, longest] tensor, padded with -1 (one column of padding if all are empty)."""
    width = max(max(len(r) for r in rows), 1)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _occurrences(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] counts of each token id in each row of a -1-padded id tensor."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    counts.scatter_add_(1, torch.where(ids < 0, vocab, ids), torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A random stream from a 64-bit seed (negative ones as their two's complement). torch's CPU generator keeps a
    seed's low 32 bits alone, so seeds that differed only above them drew the same numbers: a seed of 2**32 or more
    is hashed (splitmix64's finalizer) to the 32 bits it seeds, which leaves no pattern to its collisions; a seed
    below 2**32 is unchanged."""
    seed %= 2**64
    if device.type == "cpu" and seed >= 2**32:
        mask = 2**64 - 1
        z = (seed + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        seed = (z ^ (z >> 31)) & 0xFFFFFFFF
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    def __init__(self, eos_token_ids: set[int], device: torch.device, seed: int,
                 grammars: GrammarCompiler | None = None) -> None:
        """seed: the stream of the requests that bring no seed of their own; grammars: the masks of sequences
        with structured output."""
        self.eos_token_ids = sorted(eos_token_ids)
        self.generator = seeded_generator(seed, device)
        self.grammars = grammars

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 accepted: list[list[int]] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [rows, vocab] fp32, one row per sequence, consumed (modified in place) -> sampled ids and
        (where asked) their logprobs. accepted: tokens each sequence has gained earlier in this step (a speculative
        step's accepted proposals), which count as its output for penalties and min_tokens."""
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw = logits.clone() if wants_logprobs else logits  # sampling works in place
        outputs = [s.output_ids + extra for s, extra in zip(seqs, accepted, strict=True)] if accepted else [
            s.output_ids for s in seqs]
        self._apply_grammars(logits, seqs)
        logits = self._apply_penalties_and_bias(logits, seqs, outputs)
        tokens = self._sample(logits, seqs)
        return tokens.tolist(), self._logprobs(raw, tokens, seqs) if wants_logprobs else [None] * len(seqs)

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Tokens a sequence's grammar does not allow next get -inf: one batched fill and one masked write over the
        constrained rows only; a step without structured output does nothing here."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return
        assert self.grammars is not None, "a sequence has a grammar but the sampler has no grammar backend"
        banned = ~self.grammars.fill_masks([seqs[i].grammar for i in rows]).to(logits.device)  # type: ignore[misc]
        if len(rows) == len(seqs):
            logits.masked_fill_(banned, _NEG_INF)
        else:
            for k, i in enumerate(rows):
                logits[i].masked_fill_(banned[k], _NEG_INF)

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, seqs: list[Sequence],
               drafts: list[list[int]]) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """A speculative step's sampling: seqs[i] has 1 + len(drafts[i]) rows of logits, one after each of its input
        tokens. Position j of every sequence still going is sampled as a plain step would sample it (its output so
        far, this step's accepted tokens included), and the sequence goes on to j + 1 while the sample equals its
        j-th proposal: the tokens are exactly those of plain decoding, one random draw each (lossless for any
        proposer that does not look at the logits). Returns each sequence's tokens (its accepted proposals, then
        the sample that differed or followed them all) and their logprobs."""
        first = [0]
        for draft in drafts:
            first.append(first[-1] + 1 + len(draft))
        tokens: list[list[int]] = [[] for _ in seqs]
        logprobs: list[list[TokenLogprob | None]] = [[] for _ in seqs]
        going = list(range(len(seqs)))
        for j in range(1 + max(len(d) for d in drafts)):
            rows = torch.tensor([first[i] + j for i in going], device=logits.device)
            sampled, lps = self(logits[rows], [seqs[i] for i in going], [tokens[i] for i in going])
            for i, token, lp in zip(going, sampled, lps, strict=True):
                tokens[i].append(token)
                logprobs[i].append(lp)
            going = [i for i in going if j < len(drafts[i]) and tokens[i][-1] == drafts[i][j]]
            if not going:
                break
        return tokens, logprobs

    def _apply_penalties_and_bias(self, logits: torch.Tensor, seqs: list[Sequence],
                                  outputs: list[list[int]]) -> torch.Tensor:
        """outputs: each sequence's generated tokens so far."""
        rows, vocab = logits.shape
        dev = logits.device
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=dev)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=dev)
            # min_tokens gives way to a grammar that has ended: its text is complete and only an end token fits.
            if len(outputs[i]) < p.min_tokens and not (seq.grammar is not None and seq.grammar.ended):
                banned = [*self.eos_token_ids, *p.stop_token_ids]
                if banned:
                    logits[i, torch.tensor(banned, device=dev)] = _NEG_INF
        # Which penalties apply is read from the parameters on the host: no round trip to a GPU to find out.
        if any(s.params.frequency_penalty != 0 or s.params.presence_penalty != 0 for s in seqs):
            # OpenAI's penalties count generated tokens only.
            freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)
            pres = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)
            counts = _occurrences(_padded(outputs, dev), vocab)
            logits -= freq[:, None] * counts + pres[:, None] * (counts > 0)
        if any(s.params.repetition_penalty != 1 for s in seqs):
            # The multiplicative penalty (CTRL, as in transformers and vLLM) covers prompt and output.
            rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)
            seen = _occurrences(_padded([s.prompt_ids + out for s, out in zip(seqs, outputs, strict=True)], dev),
                                vocab) > 0
            factor = torch.where(logits > 0, 1 / rep[:, None], rep[:, None])
            logits = torch.where(seen, logits * factor, logits)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        kernels = backend.cpu_kernels(dev)  # kernels/sample.cpp: argmax's pick and the same draws, in fewer passes
        argmax = torch.ops.tokenmill.argmax_rows(logits) if kernels else logits.argmax(dim=-1)
        if all(s.params.temperature == 0 for s in seqs):
            return argmax
        temperature = torch.tensor([s.params.temperature for s in seqs], device=dev)
        greedy = temperature == 0
        logits.div_(torch.where(greedy, 1.0, temperature)[:, None])
        uniform = self._uniforms(seqs, dev)
        if kernels:  # without sorting the vocabulary
            sampled = torch.ops.tokenmill.sample_rows(
                logits, torch.tensor([s.params.top_k for s in seqs], device=dev),
                torch.tensor([s.params.top_p for s in seqs], device=dev),
                torch.tensor([s.params.min_p for s in seqs], device=dev), uniform)
            return torch.where(greedy, argmax, sampled)
        top_k = [s.params.top_k for s in seqs]
        vocab = logits.shape[-1]
        if any(k > 0 for k in top_k) or any(s.params.top_p < 1 for s in seqs):
            top_p = torch.tensor([s.params.top_p for s in seqs], device=dev)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
            ranks = torch.arange(vocab, device=dev)[None, :]
            drop = ranks >= k[:, None]
            probs = sorted_logits.masked_fill(drop, _NEG_INF).softmax(dim=-1)
            # Keep the smallest head whose mass reaches top_p (the token that crosses it stays).
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
            drop[:, 0] = False
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, _NEG_INF))
        probs = logits.softmax(dim=-1)
        if any(s.params.min_p > 0 for s in seqs):
            min_p = torch.tensor([s.params.min_p for s in seqs], device=dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0)
        # Inverse-CDF sampling: one uniform number per row; far cheaper than vocabulary-sized noise.
        cdf = probs.cumsum_(dim=-1)
        # The first token whose cumulative mass exceeds the draw (a draw of exactly 0 must not land on a leading
        # token of probability 0); the clamp catches a draw that rounding lifted to the total.
        target = (uniform * cdf[:, -1]).unsqueeze(1)
        sampled = torch.searchsorted(cdf, target, side="right").squeeze(1).clamp_(max=vocab - 1)
        return torch.where(greedy, argmax, sampled)

    def _uniforms(self, seqs: list[Sequence], dev: torch.device) -> torch.Tensor:
        """A uniform number for each row: from the row's own stream where its request has a seed (its tokens do not
        depend on its batch neighbours), the others' from the shared stream in one draw (one launch on a GPU, where
        a draw a row took 256 at 256 rows; the same numbers as one at a time)."""
        own = [i for i, s in enumerate(seqs) if s.generator is not None]
        if not own:
            return torch.rand(len(seqs), generator=self.generator, device=dev)
        uniform = torch.empty(len(seqs), device=dev)
        rest = [i for i, s in enumerate(seqs) if s.generator is None]
        if rest:
            uniform[rest] = torch.rand(len(rest), generator=self.generator, device=dev)
        for i in own:
            uniform[i:i + 1] = torch.rand(1, generator=seqs[i].generator, device=dev)
        return uniform

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list[TokenLogprob | None]:
        wanted = [s.params.logprobs for s in seqs]
        # Logprobs of the model's own distribution, before temperature, penalties and filters (as vLLM reports).
        entries = token_logprobs(raw, tokens, max(k for k in wanted if k is not None))
        return [None if k is None else replace(e, top=e.top[:k]) for e, k in zip(entries, wanted, strict=True)]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each row's entry: the logprob of its token under the row's logits, and the k most likely tokens."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    best = logprobs.topk(k, dim=-1)
    top_vals, top_ids = best.values.tolist(), best.indices.tolist()
    return [TokenLogprob(int(t), chosen[i], list(zip(top_ids[i], top_vals[i], strict=True)))
            for i, t in enumerate(tokens.tolist())]

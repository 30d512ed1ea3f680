"""The output side of the engine: each sequence's tokens into what its sink receives (text deltas, logprobs,
prompt logprobs, an embedding's vector, usage), and stop strings, which it reports to the scheduler token by token
as the step is recorded (Scheduler.update), so that a stop ends a sequence where the text does and nothing after it
is ever kept."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.request import Sequence, SequenceOutput, Status, TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling import SamplingParams

log = logging.getLogger(__name__)


class OutputProcessor:
    """end(seq, reason): the engine's, called as a sequence's last output leaves (or as its sink fails): the
    sequence is finished with that reason (an error outranks the one it had) and forgotten."""

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics, end: Callable[[Sequence, str], None]) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._end = end
        self._errors: dict[int, str] = {}  # sequences whose text failed this step
        self._end_token: set[int] = set()  # sequences whose last token ended them and is not part of the answer

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                      params.shown_special_token_ids, params.min_tokens)

    def finish_reason(self, seq: Sequence, token: int, reason: str | None) -> str | None:
        """The reason a token just appended ends its sequence, given the one its id alone gives (scheduler's
        check_stop): an end token is not part of the answer (neither text nor, as OpenAI's, a logprob entry; a
        request's own stop token is with include_stop_str_in_output, as vLLM keeps it); any other token's text
        may complete a stop string, which outranks a limit. Text that fails to decode fails its sequence alone."""
        p = seq.params
        if reason == "stop" and (token in self.tokenizer.eos_token_ids or
                                 token in p.stop_token_ids and not p.include_stop_str_in_output):
            self._end_token.add(seq.seq_id)
            return reason
        try:
            seq.detokenizer.add_token(token)
        except Exception:
            log.error("output of sequence %d failed:\n%s", seq.seq_id, traceback.format_exc())
            self._errors[seq.seq_id] = "internal error while decoding the output"
            return "error"
        return "stop" if seq.detokenizer.stopped else reason

    def emit(self, seqs: list[Sequence], logprobs: list[list[TokenLogprob | None]]) -> None:
        """Send each sampling sequence the step's news: its new tokens' text and logprobs (logprobs[i] has one
        entry per token sampled, those after a stop included), or its error."""
        now = time.perf_counter()
        self.metrics.observe_tokens([now - seq.arrival_time for seq in seqs if not seq.num_sent_tokens],
                                    [now - seq.last_token_time for seq in seqs if seq.num_sent_tokens])
        generated = 0
        for seq, step in zip(seqs, logprobs, strict=True):
            seq.last_token_time = now
            error = self._errors.pop(seq.seq_id, None)
            if error is None:
                new = len(seq.output_ids) - seq.num_sent_tokens
                kept = step[:new - (seq.seq_id in self._end_token)]
                seq.pending_logprobs += [lp for lp in kept if lp is not None]
                generated += new
            self._end_token.discard(seq.seq_id)
            self.send(seq, error)
        self.metrics.generation_tokens.inc(generated)
        self.metrics.rates.add(time.time(), generated=generated)

    def send(self, seq: Sequence, error: str | None = None) -> None:
        """Hand the sequence's news to its sink. An output that fails to build ends the sequence with an error,
        and a sink that raises (its reader's loop closed) ends it unseen: either way that sequence alone, not the
        engine loop, and its blocks go back to the pool."""
        try:
            out = self._output(seq, error)
        except Exception:
            log.error("output of sequence %d failed:\n%s", seq.seq_id, traceback.format_exc())
            out = SequenceOutput(seq.seq_id, "", [], [], "error", len(seq.prompt_ids), len(seq.output_ids),
                                 error="internal error while preparing the output")
        seq.num_sent_tokens, seq.pending_logprobs = len(seq.output_ids), []
        if out.finish_reason is not None:
            self._end(seq, out.finish_reason)
        try:
            seq.sink(out)
        except Exception:
            log.error("sequence %d could not be given its output, it ends:\n%s", seq.seq_id, traceback.format_exc())
            if out.finish_reason is None:
                self._end(seq, "abort")

    def _output(self, seq: Sequence, error: str | None) -> SequenceOutput:
        final = seq.status == Status.FINISHED
        return SequenceOutput(
            seq_id=seq.seq_id, text=seq.detokenizer.take_delta(final=final),
            token_ids=seq.output_ids[seq.num_sent_tokens:], logprobs=seq.pending_logprobs,
            finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_ids),  # None until it finished
            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens or 0, error=error,
            embedding=self._embedding(seq) if final and seq.finish_reason == "stop" else None,
            prompt_logprobs=self._prompt_logprobs(seq),
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
        """With the sequence's first output, where asked: its prompt's logprob entries in order."""
        if seq.params.prompt_logprobs is None or seq.num_sent_tokens or not seq.output_ids:
            return None
        return [seq.prompt_logprobs[p] for p in range(1, len(seq.prompt_ids))]

    @staticmethod
    def _embedding(seq: Sequence) -> list[float] | None:
        if seq.pooling is None or seq.pooled is None:
            return None
        # a mean's running sum: normalized, the sum is the mean
        return torch.nn.functional.normalize(seq.pooled, dim=0).tolist()

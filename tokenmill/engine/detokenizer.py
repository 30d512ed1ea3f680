"""Incremental detokenization: text deltas that never split a UTF-8 character, and stop strings."""

from __future__ import annotations

from tokenmill.loader.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """The tokenizer's decode stream, with stop strings on top."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 include_stop_str: bool = False, shown_special_ids: list[int] | None = None,
                 min_tokens: int = 0) -> None:
        self._decode_next = tokenizer.decode_stream(prompt_ids)
        self._shown = {i: tokenizer.decode([i], skip_special_tokens=False) for i in shown_special_ids or []}
        self._stop = stop
        self._include_stop = include_stop_str
        # A stop string may straddle deltas: hold back this many characters until it can be ruled out.
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded output so far (cut at a stop string once one matched)
        self._emitted = 0  # characters of self.text already returned
        self._min_tokens = min_tokens  # no stop string ends fewer tokens (vLLM's min_tokens holds them back too)
        self._tokens = 0
        self.stopped = False

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets `stopped` when a stop string appears."""
        new_text = self._decode_next(token_id)
        self._tokens += 1
        if token_id in self._shown:
            new_text = (new_text or "") + self._shown[token_id]
        if new_text is None:
            return  # an incomplete UTF-8 sequence or a token with no text: wait for more
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text
        if self._tokens < self._min_tokens:
            return
        matches = [(at, stop) for stop in self._stop if (at := self.text.find(stop, search_from)) >= 0]
        if matches:
            at, stop = min(matches)
            self.text = self.text[: at + len(stop) if self._include_stop else at]
            self.stopped = True

    def take_delta(self, final: bool) -> str:
        """The text not yet returned; unless final, minus a tail that could still begin a stop string."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

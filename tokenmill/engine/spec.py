"""Speculative decoding's proposers: tokens guessed to follow a sequence, which the next step checks all at once
(the scheduler runs them after the decode token, the sampler's verify keeps those the model would have sampled).

A decode step reads every weight to produce one token per sequence; checking k proposals in the same forward
costs little more, so when the guesses are often right (answers that copy from the prompt or repeat themselves)
one stream gains several tokens a step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram of the sequence (max_n tokens down to min_n) found earlier in it
    proposes the tokens that followed its latest earlier occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup n-grams of {min_n} to {max_n} tokens")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
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

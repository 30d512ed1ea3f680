"""The grammar backend: llguidance behind a small interface of our own.

`GrammarCompiler.compile` turns a request's constraint into a `CompiledGrammar` (cached by spec; call it off the
engine loop, it may take milliseconds); each sequence gets its own `Grammar` from it, whose state follows the
sequence's tokens: `fill_masks` says which tokens may come next for a batch of them at once, `accept` advances one,
`rollback` undoes accepted tokens (what speculative decoding needs).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy  # not llguidance.torch: that one imports torch.compile (~110 MiB resident)
import numpy as np
import torch

from tokenmill.errors import RequestError
from tokenmill.structured import JSON_WHITESPACE, StructuredSpec

# The limits llguidance puts on one grammar: its defaults bound a compile to tens of milliseconds of lexer work;
# error messages leave out parser internals (they go back to the client).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def _grammar_text(spec: StructuredSpec) -> str:
    """The spec as an llguidance grammar (not yet checked: the matcher's construction does that)."""
    matcher = llguidance.LLMatcher
    if spec.kind == "json":
        return matcher.grammar_from_json_schema(spec.value, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":  # Lark string literals take JSON's escapes
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.value)))
    if spec.kind == "grammar":  # GBNF (llama.cpp, xgrammar) or Lark
        return llguidance.grammar_from("grammar", spec.value)
    if spec.kind == "lark":
        return matcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def json_schema_error(schema: dict[str, Any]) -> str:
    """Why schema cannot constrain a text ("" when it can), in the backend's words; checked without the tokenizer,
    within the same limits as a compile. For a schema inside a grammar tokenmill writes (a forced tool call), whose
    compile error would show that grammar."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        return str(exc).strip()
    return llguidance.LLMatcher.validate_grammar(grammar, limits=_LIMITS).strip()


class Grammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def ended(self) -> bool:
        """Nothing but an end-of-sequence token may follow (the text is complete, or the matcher failed)."""
        return self.matcher.is_stopped()


class CompiledGrammar:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._fresh = matcher  # never advanced: each sequence starts from a copy

    def new(self) -> Grammar:
        return Grammar(self._fresh.deep_copy())


class GrammarCompiler:
    """Built once per model: llguidance's view of the tokenizer (a token trie) takes a while to build."""

    def __init__(self, tokenizer_json: str, vocab_rows: int, eos_token_ids: set[int], cache_size: int = 256) -> None:
        """vocab_rows: the model's output rows, which may outnumber the tokenizer's entries (those rows are
        never allowed)."""
        self.vocab_rows = vocab_rows
        # Without end tokens of its own (a bare tokenizer), llguidance finds the tokenizer's.
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_rows,
                                                 eos_token=sorted(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec, param: str) -> CompiledGrammar:
        """The compiled grammar of spec (from the cache when it was compiled before); a RequestError naming param
        when it does not compile or uses what the backend does not implement."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            text = _grammar_text(spec)
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}", param=param) from exc
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=_LIMITS)
        # The first mask builds the lexer's states, which every copy shares: build them here, off the engine loop
        # (a regex such as (a{1000}){1000} compiles at once and takes a second over its first mask).
        matcher.compute_bitmask()
        if matcher.is_error():
            raise RequestError(f"{param}: {matcher.get_error().strip()}", param=param)
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def fill_masks(self, grammars: list[Grammar]) -> torch.Tensor:
        """[len(grammars), vocab_rows] bool: the tokens each grammar allows next, computed in parallel."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(grammars), self.vocab_rows)
        if len(grammars) == 1:  # on this thread: the executor's pool would wake (and spin) for one mask
            llguidance.numpy.fill_next_token_bitmask(grammars[0].matcher, bitmask)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :self.vocab_rows]).bool()

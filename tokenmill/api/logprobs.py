"""Logprobs as OpenAI writes them, byte-exact: chat entries (token, logprob, bytes, top_logprobs) and the legacy
completions form (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from tokenmill.api.tools.parsers import ToolParser
from tokenmill.engine.request import TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer


def _escaped(data: bytes) -> str:
    """Bytes as OpenAI writes a token that is not whole UTF-8 (its cookbook shows a piece of an emoji as
    `\\xf0\\x9f\\x92`): printable ASCII as itself, every other byte, a backslash too, as `\\xNN`, so the form
    reads back to the bytes unambiguously."""
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


def _chat_token(data: bytes) -> str:
    """A chat logprob's `token`: the text of its bytes, or for a piece of a character (not whole UTF-8) the escaped
    bytes, as OpenAI shows them (never U+FFFD: the exact value is in `bytes` either way)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return _escaped(data)


def _completion_token(data: bytes) -> str:
    """A legacy logprob's token (and its key in top_logprobs): its text, or OpenAI's `bytes:\\xe4\\xb8` form."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + _escaped(data)


class _Pieces:
    """What each token adds to an answer's text, exactly. A special token that the detokenizer hides (every one but
    those `shown`, the tool-call delimiters a parser reads) adds nothing: its entry keeps its logprob and its name
    as `token`, with `bytes` [] (a zero-width token in text_offset), so that over the content's tokens the entries'
    bytes concatenate to the content's bytes. (The end token that finished an answer has no entry at all: the
    engine leaves it out, as OpenAI never shows one.)"""

    def __init__(self, tk: Tokenizer, shown: frozenset[int] = frozenset()) -> None:
        self._tk = tk
        self._shown = shown

    def name(self, token_id: int) -> bytes:
        """The token's own bytes (a special token's are its text)."""
        return self._tk.token_bytes(token_id)

    def added(self, token_id: int) -> bytes:
        """The bytes the token adds to the text."""
        hidden = token_id in self._tk.special_ids and token_id not in self._shown
        return b"" if hidden else self._tk.token_bytes(token_id)


def shown_tokens(tk: Tokenizer, tool_parser: type[ToolParser] | None) -> frozenset[int]:
    """The special tokens a request's text keeps: those that delimit its model's tool calls (see routes)."""
    return frozenset(tk.special_token_ids(tool_parser.delimiters)) if tool_parser is not None else frozenset()


def chat_logprobs(tk: Tokenizer, logprobs: list[TokenLogprob], shown: frozenset[int] = frozenset()
                  ) -> list[dict[str, Any]]:
    """Each entry's `bytes` are what its token adds to the text: over the content's tokens they concatenate to the
    content's bytes exactly (see _Pieces); an alternative's are the same as that token's would be."""
    pieces = _Pieces(tk, shown)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": _chat_token(pieces.name(token_id)), "logprob": logprob,
                "bytes": list(pieces.added(token_id))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs]


def _alternatives(tokens: Callable[[int], str], top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy API's top_logprobs dict, keyed by token text. Keys never collide, so every token given keeps its
    entry (`logprobs: k`: the k likeliest and the sampled one): a token whose text a likelier one already keys (two
    ids, the same bytes: Gemma's `\\n` and its byte-fallback token <0x0A>, say) is keyed `token_id:<id>` (vLLM's
    form for a token id)."""
    keyed: dict[str, float] = {}
    for token_id, logprob in top:
        text = tokens(token_id)
        keyed[f"token_id:{token_id}" if text in keyed else text] = logprob
    return keyed


def _with_sampled(lp: TokenLogprob) -> list[tuple[int, float]]:
    """The legacy API's alternatives hold the sampled token too, as OpenAI's (up to logprobs + 1 of them) and vLLM's
    do: after the top ones when it is not among them (it is then no likelier than they are)."""
    if any(token_id == lp.token_id for token_id, _ in lp.top):
        return lp.top
    return [*lp.top, (lp.token_id, lp.logprob)]


class TextOffsets:
    """text_offset of a choice's tokens, one after another (across stream chunks too): where each token starts in
    the returned text, in characters (Python str indices, as the text's own length counts them). The pieces of one
    character, which alone are not text, all start where that character does; a byte that never completes a
    character counts as the one U+FFFD the text shows for it; a hidden special token is zero-width. Counted from
    the tokens' bytes, not from the text sent so far, so a stream's offsets are the whole answer's even while stop
    strings hold text back."""

    def __init__(self, start: int = 0) -> None:
        self._chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, added: bytes) -> int:
        """The offset of a token that adds these bytes; counts them."""
        at, pending = self._chars, self._utf8.getstate()[0]
        if pending and added and not _utf8_prefix(pending + added[:1]):
            at += len(pending.decode("utf-8", errors="replace"))  # the bytes before it never made a character
        self._chars += len(self._utf8.decode(added))
        return at


def _utf8_prefix(data: bytes) -> bool:
    """Whether data can begin valid UTF-8 (a token whose first byte goes on with the bytes before it continues
    their character)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data)
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(tk: Tokenizer, logprobs: list[TokenLogprob], offsets: TextOffsets | None = None,
                        echoed: list[int] | None = None) -> dict[str, Any]:
    """offsets: the choice's offsets so far (a stream's, chunk after chunk); a new count from 0 if None.
    echoed: an echoed prompt's ids, whose tokens after the first lead the entries; the first comes before them with
    no logprob (null, as OpenAI gives), and their special tokens show in the echoed text."""
    pieces, offsets = _Pieces(tk), offsets or TextOffsets()
    first, prompt = ([], 0) if echoed is None else (echoed[:1], len(echoed))
    in_prompt = _Pieces(tk, frozenset(tk.special_ids))

    def token(token_id: int) -> str:
        return _completion_token(pieces.name(token_id))

    ids = first + [lp.token_id for lp in logprobs]
    return {
        "tokens": [token(t) for t in ids],
        "token_logprobs": [None for _ in first] + [lp.logprob for lp in logprobs],
        "top_logprobs": [None for _ in first] + [_alternatives(token, _with_sampled(lp)) for lp in logprobs],
        "text_offset": [offsets.next((in_prompt if i < prompt else pieces).added(t)) for i, t in enumerate(ids)],
    }

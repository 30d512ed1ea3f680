"""Token bytes for logprobs, by vocabulary scheme, and the legacy API's alternatives keyed without collisions."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from tokenmill.api.responses import _alternatives, completion_logprobs
from tokenmill.engine.request import TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer


def sentencepiece_like() -> Tokenizer:
    """A SentencePiece-style BPE vocabulary (Gemma, Llama 2): ▁ for a space, <0xNN> byte-fallback tokens."""
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "<0xA0>": 3, "▁hi": 4, "hi": 5, "▁": 6, "h": 7, "i": 8}
    tok = HFTokenizer(models.BPE(vocab, [("h", "i"), ("▁", "hi")], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(tok, None, None, set())


def test_byte_fallback_tokens_are_their_byte_and_the_space_mark_a_space() -> None:
    tk = sentencepiece_like()
    assert [tk.token_bytes(i) for i in (1, 2, 3, 4, 5)] == [b"\xe4", b"\xbd", b"\xa0", b" hi", b"hi"]
    assert b"".join(tk.token_bytes(i) for i in (1, 2, 3)).decode() == "你"


def test_pieces_of_a_character_show_as_bytes_and_share_its_offset() -> None:
    tk = sentencepiece_like()
    lp = completion_logprobs(tk, [TokenLogprob(i, -1.0, []) for i in (4, 1, 2, 3, 5)], text_start=10)
    assert lp["tokens"] == [" hi", "bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0", "hi"]
    assert lp["text_offset"] == [10, 13, 13, 13, 14]


class TwoIdsOneText:
    def token_bytes(self, token_id: int) -> bytes:
        return {1: b"a", 2: b"a", 3: b"b"}[token_id]


def test_alternatives_with_the_same_text_keep_both() -> None:
    keyed = _alternatives(TwoIdsOneText(), [(1, -0.1), (3, -1.0), (2, -2.0)])  # type: ignore[arg-type]
    assert keyed == {"a": -0.1, "b": -1.0, "token_id:2": -2.0}

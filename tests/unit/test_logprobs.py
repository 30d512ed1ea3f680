"""Logprobs as bytes: each token's own bytes by vocabulary scheme, pieces of a character written as OpenAI writes
them, hidden special tokens adding no bytes, text_offset in characters, the legacy API's alternatives keyed without
collisions. (The real vocabularies are checked in test_text.py, the live server in e2e/test_logprobs_api.py.)"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.api.logprobs import (
    TextOffsets,
    _alternatives,
    _chat_token,
    _completion_token,
    chat_logprobs,
    completion_logprobs,
    shown_tokens,
)
from tokenmill.engine.request import TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer

HI, E4, BD, A0, SPACE_HI, F0, BACKSLASH, H, BYTE_H, EOT, CALL = 4, 1, 2, 3, 9, 10, 11, 6, 12, 13, 14


def sentencepiece_like() -> Tokenizer:
    """A SentencePiece-style BPE vocabulary (Gemma, Llama 2): ▁ for a space, <0xNN> byte-fallback tokens, and two
    special tokens: an end of turn and a tool-call delimiter."""
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "<0xA0>": 3, "hi": 4, "▁": 5, "h": 6, "i": 7, "▁h": 8, "▁hi": 9,
             "<0xF0>": 10, "\\": 11, "<0x68>": 12}
    tok = HFTokenizer(models.BPE(vocab, [("h", "i"), ("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken("<eot>", special=True, normalized=False),
                    AddedToken("<call>", special=True, normalized=False)])
    return Tokenizer(tok, None, "<eot>", {EOT})


def lps(*ids: int) -> list[TokenLogprob]:
    return [TokenLogprob(i, -0.5, []) for i in ids]


def test_byte_fallback_tokens_are_their_byte_and_the_space_mark_a_space() -> None:
    tk = sentencepiece_like()
    assert [tk.token_bytes(i) for i in (E4, BD, A0, SPACE_HI, HI, EOT)] == [b"\xe4", b"\xbd", b"\xa0", b" hi", b"hi",
                                                                             b"<eot>"]
    assert b"".join(tk.token_bytes(i) for i in (E4, BD, A0)).decode() == "你"
    assert tk.special_ids == {EOT, CALL}


def test_bytes_not_whole_utf8_are_written_as_openai_writes_them() -> None:
    assert _chat_token(b"\xf0\x9f\x92") == "\\xf0\\x9f\\x92"  # OpenAI's cookbook, a piece of 💙
    assert _completion_token(b"\xe2\x80") == "bytes:\\xe2\\x80"  # the legacy API's form
    assert _completion_token(b" a\\\n\xe4") == "bytes: a\\x5c\\x0a\\xe4"  # a backslash escaped too: reads back
    assert _chat_token("é\\".encode()) == _completion_token("é\\".encode()) == "é\\"  # whole UTF-8: the text


def test_chat_pieces_of_a_character_are_their_bytes_and_rebuild_the_text() -> None:
    entries = chat_logprobs(sentencepiece_like(), lps(SPACE_HI, E4, BD, A0, HI, BACKSLASH))
    assert b"".join(bytes(e["bytes"]) for e in entries) == " hi你hi\\".encode()
    # OpenAI writes a piece that is not whole UTF-8 as its escaped bytes (its cookbook: `\xf0\x9f\x92`), no U+FFFD
    assert [e["token"] for e in entries] == [" hi", "\\xe4", "\\xbd", "\\xa0", "hi", "\\"]
    assert [e["bytes"] for e in entries[1:4]] == [[0xE4], [0xBD], [0xA0]]


def test_completion_pieces_show_as_bytes_and_share_the_offset_of_their_character() -> None:
    lp = completion_logprobs(sentencepiece_like(), lps(SPACE_HI, E4, BD, A0, HI), TextOffsets(10))
    assert lp["tokens"] == [" hi", "bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0", "hi"]
    assert lp["text_offset"] == [10, 13, 13, 13, 14]  # in characters: 你 is one, its three pieces start at it
    assert completion_logprobs(sentencepiece_like(), lps(HI))["text_offset"] == [0]


def test_offsets_go_on_across_stream_chunks_as_over_the_whole_answer() -> None:
    tk, ids = sentencepiece_like(), (HI, E4, BD, A0, SPACE_HI, F0, HI)
    whole = completion_logprobs(tk, lps(*ids))["text_offset"]
    offsets = TextOffsets()
    streamed = [o for part in ((HI, E4), (BD,), (A0, SPACE_HI, F0), (HI,))
                for o in completion_logprobs(tk, lps(*part), offsets)["text_offset"]]
    assert streamed == whole == [0, 2, 2, 2, 3, 6, 7]
    text = tk.decode(list(ids))
    assert text == "hi你 hi\ufffdhi" and text[7:] == "hi"  # a byte that never completes a character: one U+FFFD


def test_a_hidden_special_token_adds_no_bytes_and_no_width() -> None:
    """Its logprob stays (every sampled token has one), its name is its token, its bytes are none: the entries' bytes
    still concatenate to the content, which the detokenizer left it out of."""
    tk = sentencepiece_like()
    entries = chat_logprobs(tk, [TokenLogprob(HI, -0.1, [(EOT, -0.2), (HI, -1.0)]), TokenLogprob(EOT, -0.2, [])])
    assert [(e["token"], e["bytes"]) for e in entries] == [("hi", list(b"hi")), ("<eot>", [])]
    assert [(e["token"], e["bytes"]) for e in entries[0]["top_logprobs"]] == [("<eot>", []), ("hi", list(b"hi"))]
    lp = completion_logprobs(tk, lps(HI, EOT, HI))
    assert lp["tokens"] == ["hi", "<eot>", "hi"] and lp["text_offset"] == [0, 2, 2]


def test_a_special_token_the_text_shows_keeps_its_bytes() -> None:
    """A tool-call delimiter the detokenizer keeps for the parser (routes shows a parser's delimiters) is text like
    any other."""
    class CallParser:
        delimiters = ("<call>", "</call>")  # the second is no token of this vocabulary

    tk = sentencepiece_like()
    assert shown_tokens(tk, CallParser) == {CALL} and shown_tokens(tk, None) == set()  # type: ignore[arg-type]
    entries = chat_logprobs(tk, lps(CALL, EOT), shown=shown_tokens(tk, CallParser))  # type: ignore[arg-type]
    assert [e["bytes"] for e in entries] == [list(b"<call>"), []]


class TwoIdsOneText:
    def __call__(self, token_id: int) -> str:
        return {1: "a", 2: "a", 3: "b", 4: "bytes:\\xe4", 5: "bytes:\\xe4"}[token_id]


def test_alternatives_with_the_same_text_keep_both() -> None:
    keyed = _alternatives(TwoIdsOneText(), [(1, -0.1), (3, -1.0), (2, -2.0), (4, -3.0), (5, -4.0)])
    assert keyed == {"a": -0.1, "b": -1.0, "token_id:2": -2.0, "bytes:\\xe4": -3.0, "token_id:5": -4.0}


def test_a_byte_token_and_the_plain_token_of_its_byte_are_both_alternatives() -> None:
    """Gemma's vocabulary has 110 such pairs (`\\n` and <0x0A>, ...): logprobs: k still gives k."""
    tk = sentencepiece_like()
    assert tk.token_bytes(H) == tk.token_bytes(BYTE_H) == b"h"
    lp = completion_logprobs(tk, [TokenLogprob(H, -0.1, [(H, -0.1), (BYTE_H, -0.2), (HI, -0.3)])])
    assert lp["top_logprobs"] == [{"h": -0.1, f"token_id:{BYTE_H}": -0.2, "hi": -0.3}]


def test_completion_alternatives_hold_the_sampled_token_too() -> None:
    """OpenAI's legacy top_logprobs hold up to logprobs + 1 entries, the sampled token's among them (vLLM's too):
    after the top ones when a temperature picked a less likely token, alone with logprobs: 0."""
    tk = sentencepiece_like()
    unlikely = TokenLogprob(HI, -3.0, [(H, -0.1), (SPACE_HI, -0.5)])
    likely = TokenLogprob(H, -0.1, [(H, -0.1), (SPACE_HI, -0.5)])
    lp = completion_logprobs(tk, [unlikely, likely, TokenLogprob(HI, -3.0, [])])
    assert lp["top_logprobs"] == [{"h": -0.1, " hi": -0.5, "hi": -3.0}, {"h": -0.1, " hi": -0.5}, {"hi": -3.0}]
    # chat lists exactly the top_logprobs asked for: the sampled token's own logprob is its entry's
    assert [len(e["top_logprobs"]) for e in chat_logprobs(tk, [unlikely, TokenLogprob(HI, -3.0, [])])] == [2, 0]
    # a sampled token whose text a likelier alternative already keys keeps its entry, keyed by its id
    assert completion_logprobs(tk, [TokenLogprob(BYTE_H, -2.0, [(H, -0.1)])])["top_logprobs"] == [
        {"h": -0.1, f"token_id:{BYTE_H}": -2.0}]

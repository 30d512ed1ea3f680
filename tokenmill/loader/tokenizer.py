"""The model's own tokenizer, through the `tokenizers` library: from tokenizer.json or rebuilt from GGUF metadata."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from tokenmill.errors import ModelFormatError, RequestError
from tokenmill.loader.safetensors import read_json

log = logging.getLogger(__name__)

# Token texts that end a turn in the chat formats we know; llama.cpp recognises end-of-generation tokens the
# same way. They count only where the vocabulary marks them special.
END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
    "</s>", "<|return|>", "<eos>",
})

# Prompt tokens a decode stream starts from, so that word-boundary spaces come out right.
_STREAM_CONTEXT_TOKENS = 5
# What stands in for each character of special-token text in a request's values (Tokenizer.encode_chat): the first
# that no special token's text holds (so no special token is found across a mask and the template's text around
# it); printable ASCII, which a template's JSON of a tool leaves as it is.
_MASKS = "~^`#$%"

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, in `tokenizers` terms."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in ("gpt2", "default", ""):
        log.warning("pre-tokenizer %r is not known to tokenmill; using GPT-2's, tokenization may differ", pre)
    return gpt2


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list; a pair merges when the joined piece exists, the best score first."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind in (_CONTROL, _BYTE) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _from_gguf_metadata(meta: dict[str, Any]) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=meta.get("tokenizer.ggml.pre") == "llama-bpe"))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
        bpe = models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True)
        tok = HFTokenizer(bpe)
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        steps = [normalizers.Prepend("▁")] if add_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(decode_steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    else:
        raise ModelFormatError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (BPE), llama (SentencePiece)"
        )
    added = [
        AddedToken(token, special=kind_ == _CONTROL, normalized=False)
        for token, kind_ in zip(tokens, types, strict=True)
        if kind_ in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return tok


def _gpt2_byte_chars() -> list[str]:
    """The printable stand-ins of a byte-level BPE vocabulary for the 256 byte values (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Encode, decode and the special tokens a server needs to know about."""

    def __init__(self, tok: HFTokenizer, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: set[int]) -> None:
        self._tok = tok
        # A twin that reads special-token text as plain text: for user content inside a chat prompt.
        self._plain = HFTokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.special_tokens = list(self._special_ids)
        self._mask = next((c for c in _MASKS if not any(c in t for t in self.special_tokens)), _MASKS[0])
        # The ids a decode with special tokens skipped leaves out (the detokenizer's, unless it is told to show one).
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # End-of-generation ids: the declared eos plus every special end-of-turn token of the vocabulary.
        self.eos_token_ids = eos_token_ids | {i for text, i in self._special_ids.items() if text in END_OF_TURN_TEXTS}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        first = tok.encode("", add_special_tokens=True).ids
        self._bos_id = first[0] if first and first[0] in self.special_ids else None  # the BOS it adds, if it does

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> Tokenizer:
        tokens = meta["tokenizer.ggml.tokens"]
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            _from_gguf_metadata(meta),
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            eos_token_ids={eos_id} if eos_id is not None else set(),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(f"{folder} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ModelFormatError(f"cannot read {path}: {exc}") from exc
        cfg = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
        gen = read_json(folder / "generation_config.json") if (folder / "generation_config.json").exists() else {}
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_ids = gen.get("eos_token_id", [])
        eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.add(tok.token_to_id(eos))
        return cls(tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids)

    def special_token_ids(self, texts: tuple[str, ...]) -> list[int]:
        """The ids of those texts that are special tokens of this vocabulary."""
        return [self._special_ids[text] for text in texts if text in self._special_ids]

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Every token has the same id in both (a draft model's guesses mean what they say)."""
        return self._tok.get_vocab(with_added_tokens=True) == other._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what other libraries, such as the grammar backend, load)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode raw text; special-token text in it becomes control tokens (the completions API's prompt)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._one_bos(ids) if add_special_tokens else ids

    def _one_bos(self, ids: list[int]) -> list[int]:
        """Exactly one BOS first, where the tokenizer adds one: a prompt or a chat template that writes its own
        would make two, a template without it none (Gemma's answers degrade with either)."""
        if self._bos_id is None:
            return ids
        start = 0
        while start < len(ids) and ids[start] == self._bos_id:
            start += 1
        return [self._bos_id, *ids[start:]]

    def encode_chat(self, render: Callable[[Any], str], inputs: Any) -> list[int]:
        """Encode the chat prompt render(inputs) makes of a request's values (messages and tools: dicts, lists,
        strings) with special tokens only where the chat template writes them: special-token text in the values
        (a message, a tool's description or arguments) stays text, wherever it lands in the prompt.

        Where the values hold such text, they are rendered a second time with it masked (a character no special
        token holds, for each of its characters): the special tokens of that prompt are the template's own, at the
        same places. Values without it render once and tokenize exactly as the model's reference tokenizer would.
        """
        prompt = render(inputs)
        masked = self._masked(inputs)
        if masked == inputs:
            return self._one_bos(self._tok.encode(prompt, add_special_tokens=False).ids)
        template_only = render(masked)
        if len(template_only) != len(prompt) or any(
                a != b and b != self._mask for a, b in zip(prompt, template_only, strict=True)):
            raise RequestError("a message or tool holds special-token text that the chat template rewrites; "
                               "tokenmill refuses it rather than read it as control tokens", param="messages")
        ids: list[int] = []
        cursor = 0
        for match in self._special_text.finditer(template_only):
            ids += self._plain.encode(prompt[cursor:match.start()], add_special_tokens=False).ids
            ids.append(self._special_ids[match.group()])
            cursor = match.end()
        return self._one_bos(ids + self._plain.encode(prompt[cursor:], add_special_tokens=False).ids)

    def _masked(self, value: Any) -> Any:
        """value with each special token's text in its strings masked, a mask character for each of its own."""
        if isinstance(value, str):
            if not self.special_tokens:
                return value
            return self._special_text.sub(lambda m: self._mask * len(m.group()), value)
        if isinstance(value, dict):  # keys too: a call's arguments, a schema's property names
            return {self._masked(k): self._masked(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._masked(v) for v in value)
        return value

    @cached_property
    def _special_text(self) -> re.Pattern[str]:
        """Any special token's text, the longest first where one begins another."""
        return re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to the text, exactly (a piece of a UTF-8 character stays that piece): what
        logprobs report. Added tokens are their content; the rest are read through the vocabulary's scheme."""
        return self._token_bytes[token_id]

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        gpt2 = {c: b for b, c in enumerate(_gpt2_byte_chars())}

        def of(token_id: int) -> bytes:
            piece = self._tok.id_to_token(token_id)
            if token_id in added or piece is None:
                return added.get(token_id, "").encode()
            if "ByteLevel" in kinds:
                return bytes(gpt2[c] for c in piece) if all(c in gpt2 for c in piece) else piece.encode()
            if "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                return bytes([int(piece[3:5], 16)])
            if "ByteFallback" in kinds or "Metaspace" in kinds:
                return piece.replace("\u2581", " ").encode()
            return self._tok.decode([token_id], skip_special_tokens=False).encode()  # other schemes: as decoded

        return [of(i) for i in range(self.vocab_size)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_ids: list[int]) -> Callable[[int], str | None]:
        """A streaming decode of the tokens that follow prompt_ids, special tokens skipped.

        Call it with each new token id: it returns the text that token adds, or None while that text is still
        an incomplete UTF-8 character (or the token adds none). The library's DecodeStream starts from the last
        prompt ids and keeps their text out of the output: with that context the first token's word-boundary
        space comes out as in a whole decode (a SentencePiece decoder strips the leading space of a decode).
        """
        seen = list(prompt_ids[-_STREAM_CONTEXT_TOKENS:])
        stream = self._stream_after(seen)

        def step(token_id: int) -> str | None:
            nonlocal stream
            try:
                text = stream.step(self._tok, token_id)
            except Exception as exc:
                if "Invalid prefix" not in str(exc):  # the message of tokenizers 0.22-0.23
                    raise
                # Byte-fallback pieces that are no UTF-8 (a model may sample a stray byte, after "é": C3 A9 A9)
                # decode as one run of U+FFFD, which undoes text the stream gave already: it cannot go on (vLLM
                # meets the same). A new stream after the tokens before this one: the stray byte's text is lost.
                stream = self._stream_after(seen)
                text = stream.step(self._tok, token_id)
            seen.append(token_id)
            del seen[:-_STREAM_CONTEXT_TOKENS]
            return text

        return step

    def _stream_after(self, context: list[int]) -> DecodeStream:
        """A DecodeStream whose text starts after context's."""
        context = list(context)
        # DecodeStream holds its context back only where it decodes to text not ending in U+FFFD; a prompt of
        # token ids may end inside a character, and then the context's text would come out with the first token.
        while context and self.decode(context).endswith("\ufffd"):
            context.pop()
        return DecodeStream(context, skip_special_tokens=True)

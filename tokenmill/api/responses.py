"""OpenAI response bodies and stream chunks, shaped exactly as OpenAI's, built from engine outputs."""

from __future__ import annotations

import base64
import codecs
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.api.errors import error_body
from tokenmill.api.tool_parsers import ToolCall, ToolCallDelta, ToolParser, parse_tool_calls
from tokenmill.engine.request import SequenceOutput, TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one answer shares: its id, the model id, the engine's system_fingerprint, and
    the tokenizer that spells its logprobs' tokens."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    fingerprint: str | None = None


@dataclass(frozen=True)
class StreamUsage:
    """A stream's usage: in a last chunk (stream_options.include_usage), and with `continuous` in every chunk, each
    choice's so far (vLLM's continuous_usage_stats)."""

    include: bool = False
    continuous: bool = False


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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


def _shown(tk: Tokenizer, tool_parser: type[ToolParser] | None) -> frozenset[int]:
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


def _joined(outs: list[SequenceOutput]) -> tuple[str, list[TokenLogprob], str | None, int]:
    text = "".join(o.text for o in outs)
    logprobs = [lp for o in outs for lp in o.logprobs]
    last = outs[-1]
    return text, logprobs, last.finish_reason, last.completion_tokens


def _cached(cached_by_choice: dict[int, int], n: int) -> int:
    """Prompt tokens served from the prefix cache, counted like prompt_tokens: once per prompt (its first choice)."""
    return sum(cached for index, cached in cached_by_choice.items() if index % n == 0)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(finish: str | None, called: bool) -> str | None:
    """A sequence that ended on its own after calling tools, every call whole, finished to have them run."""
    return "tool_calls" if called and finish == "stop" else finish


def _message(text: str, tool_parser: type[ToolParser] | None, parallel: bool, finish: str | None
             ) -> tuple[dict[str, Any], list[ToolCall]]:
    if tool_parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, []
    content, calls = parse_tool_calls(tool_parser, text, finish)
    calls = calls if parallel else calls[:1]  # parallel_tool_calls false: the first call is the answer
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, calls


def chat_completion(reply: Reply, prompt_tokens: int, results: list[list[SequenceOutput]],
                    tool_parser: type[ToolParser] | None = None, parallel: bool = True) -> dict[str, Any]:
    """tool_parser: read the text for tool calls (the request has tools), in the model's format; parallel: all
    the calls it wrote, else only the first (parallel_tool_calls)."""
    tk = reply.tokenizer
    choices, completion_tokens = [], 0
    for index, outs in enumerate(results):
        text, logprobs, finish, n_tokens = _joined(outs)
        completion_tokens += n_tokens
        message, calls = _message(text, tool_parser, parallel, finish)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(tk, logprobs, _shown(tk, tool_parser)), "refusal": None}
            if logprobs else None,
            "finish_reason": _finish_reason(finish, bool(calls)),
        })
    cached = results[0][-1].cached_tokens
    return {"id": reply.request_id, "object": "chat.completion", "created": int(time.time()), "model": reply.model,
            "system_fingerprint": reply.fingerprint, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached)}


def completion(reply: Reply, prompt_tokens: int, results: list[list[SequenceOutput]], echoes: list[str],
               prompts: list[list[int]], n: int) -> dict[str, Any]:
    """echoes, prompts: each choice's echoed text (or none) and prompt ids; echoed with logprobs, its first
    output's prompt_logprobs lead the choice's entries."""
    tk = reply.tokenizer
    choices, completion_tokens = [], 0
    for index, (outs, echo, prompt) in enumerate(zip(results, echoes, prompts, strict=True)):
        text, logprobs, finish, n_tokens = _joined(outs)
        completion_tokens += n_tokens
        echoed = outs[0].prompt_logprobs
        choices.append({
            "index": index, "text": echo + text,
            "logprobs": None if not logprobs and echoed is None else completion_logprobs(
                tk, [*(echoed or []), *logprobs], echoed=None if echoed is None else prompt),
            "finish_reason": finish,
        })
    cached = _cached({i: outs[-1].cached_tokens for i, outs in enumerate(results)}, n)
    return {"id": reply.request_id, "object": "text_completion", "created": int(time.time()), "model": reply.model,
            "system_fingerprint": reply.fingerprint, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached)}


def embeddings(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> dict[str, Any]:
    """base64: each vector's little-endian float32 bytes, as OpenAI sends them."""
    def encoded(vector: list[float]) -> list[float] | str:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if encoding == "base64" else vector

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _chunker(reply: Reply, object_: str, include_usage: bool) -> Callable[..., dict[str, Any]]:
    """Chunks of one stream share id, object, created, model and system_fingerprint; with include_usage each
    carries usage: null, or the usage given (vLLM's continuous_usage_stats)."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": reply.request_id, "object": object_, "created": created, "model": reply.model,
                "system_fingerprint": reply.fingerprint, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    return chunk


class _ChoiceUsage:
    """Each choice's completion and cached tokens so far, for the last chunk's usage and, with vLLM's
    continuous_usage_stats (prompt_lengths: each prompt's tokens, choice i's being prompt i // n), every chunk's."""

    def __init__(self, n: int, prompt_lengths: list[int] | None) -> None:
        self.n, self.prompt_lengths = n, prompt_lengths
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def record(self, index: int, out: SequenceOutput) -> None:
        self.completion[index], self.cached[index] = out.completion_tokens, out.cached_tokens

    def of(self, index: int) -> dict[str, Any] | None:
        """Choice index's usage so far where every chunk carries one, else None."""
        if self.prompt_lengths is None:
            return None
        return _usage(self.prompt_lengths[index // self.n], self.completion.get(index, 0), self.cached.get(index, 0))

    def total(self, prompt_tokens: int) -> dict[str, Any]:
        return _usage(prompt_tokens, sum(self.completion.values()), _cached(self.cached, self.n))


def _stream_error(out: SequenceOutput) -> dict[str, Any]:
    return error_body(out.error or "internal error", "server_error")


def _tool_call_delta(delta: ToolCallDelta, call_ids: dict[int, str]) -> dict[str, Any]:
    """OpenAI's streamed call: the first piece carries id, type and name; the rest only argument text."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    call_ids[delta.index] = _call_id()
    return {"index": delta.index, "id": call_ids[delta.index], "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


async def chat_chunks(reply: Reply, prompt_tokens: int, n: int, outputs: AsyncIterator[tuple[int, SequenceOutput]],
                      usage_options: StreamUsage = StreamUsage(), tool_parser: type[ToolParser] | None = None,
                      parallel: bool = True) -> AsyncIterator[dict[str, Any]]:
    """tool_parser, parallel: as in chat_completion; calls stream as tool_calls deltas, the rest as content."""
    tk = reply.tokenizer
    chunk = _chunker(reply, "chat.completion.chunk", usage_options.include)
    usage = _ChoiceUsage(n, [prompt_tokens] if usage_options.continuous else None)

    started: set[int] = set()
    parsers: dict[int, ToolParser] = {}
    call_ids: dict[int, dict[int, str]] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield _stream_error(out)
            return
        if index not in started:
            started.add(index)
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], usage.of(index))
        usage.record(index, out)
        content, calls = out.text, []
        if tool_parser is not None:
            parser = parsers.setdefault(index, tool_parser())
            parsed = [parser.feed(out.text)] + ([parser.finish()] if out.finish_reason is not None else [])
            content = "".join(p.content for p in parsed)
            calls = [d for p in parsed for d in p.calls if parallel or d.index == 0]
        if content or out.logprobs:
            logprobs = {"content": chat_logprobs(tk, out.logprobs, _shown(tk, tool_parser)), "refusal": None} \
                if out.logprobs else None
            yield chunk([{"index": index, "delta": {"content": content}, "logprobs": logprobs,
                          "finish_reason": None}], usage.of(index))
        for delta in calls:
            yield chunk([{"index": index, "delta": {"tool_calls": [
                _tool_call_delta(delta, call_ids.setdefault(index, {}))]}, "logprobs": None, "finish_reason": None}],
                usage.of(index))
        if out.finish_reason is not None:
            called = index in parsers and parsers[index].called
            yield chunk([{"index": index, "delta": {}, "logprobs": None,
                          "finish_reason": _finish_reason(out.finish_reason, called)}], usage.of(index))
    if usage_options.include:
        yield chunk([], usage.total(prompt_tokens))


async def completion_chunks(reply: Reply, prompt_lengths: list[int], n: int,
                            outputs: AsyncIterator[tuple[int, SequenceOutput]],
                            usage_options: StreamUsage = StreamUsage()) -> AsyncIterator[dict[str, Any]]:
    """prompt_lengths: each prompt's tokens (choice i answers prompt i // n)."""
    tk = reply.tokenizer
    chunk = _chunker(reply, "text_completion", usage_options.include)
    usage = _ChoiceUsage(n, prompt_lengths if usage_options.continuous else None)
    offsets: dict[int, TextOffsets] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield _stream_error(out)
            return
        usage.record(index, out)
        if out.text or out.logprobs or out.finish_reason is not None:
            logprobs = completion_logprobs(tk, out.logprobs, offsets.setdefault(index, TextOffsets())) \
                if out.logprobs else None
            yield chunk([{"index": index, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason}], usage.of(index))
    if usage_options.include:
        yield chunk([], usage.total(sum(prompt_lengths)))

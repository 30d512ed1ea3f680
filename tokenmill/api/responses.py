"""OpenAI response bodies and stream chunks, shaped exactly as OpenAI's, built from engine outputs."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.api.errors import error_body
from tokenmill.api.tool_parsers import ToolCall, ToolCallDelta, ToolParser, parse_tool_calls
from tokenmill.engine.request import SequenceOutput, TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_text(data: bytes) -> str:
    """A token's text as logprobs show it: its bytes as UTF-8, or, for a piece of a character, OpenAI's
    `bytes:\\xe4\\xb8` form (its `bytes` carry the exact value either way)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_logprobs(tk: Tokenizer, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Each token's own bytes: over the content's tokens they concatenate to the content's bytes exactly."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        data = tk.token_bytes(token_id)
        return {"token": _token_text(data), "logprob": logprob, "bytes": list(data)}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs]


def _alternatives(tk: Tokenizer, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy API's top_logprobs dict, keyed by token text; a token whose text another (likelier) one already
    has (two ids, the same bytes) is keyed `token_id:<id>` (vLLM's form), so none is lost."""
    keyed: dict[str, float] = {}
    for token_id, logprob in top:
        text = _token_text(tk.token_bytes(token_id))
        keyed[f"token_id:{token_id}" if text in keyed else text] = logprob
    return keyed


def completion_logprobs(tk: Tokenizer, logprobs: list[TokenLogprob], text_start: int = 0) -> dict[str, Any]:
    """text_offset: where each token starts in the text, in characters; the pieces of one character all start
    where it does."""
    data = [tk.token_bytes(lp.token_id) for lp in logprobs]
    offsets, before = [], b""
    for piece in data:
        offsets.append(text_start + len(before.decode("utf-8", errors="ignore")))
        before += piece
    return {
        "tokens": [_token_text(d) for d in data],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_alternatives(tk, lp.top) for lp in logprobs],
        "text_offset": offsets,
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
    """A sequence that ended on its own after calling tools finished to have them run."""
    return "tool_calls" if called and finish == "stop" else finish


def _message(text: str, tool_parser: type[ToolParser] | None, parallel: bool
             ) -> tuple[dict[str, Any], list[ToolCall]]:
    if tool_parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, []
    content, calls = parse_tool_calls(tool_parser, text)
    calls = calls if parallel else calls[:1]  # parallel_tool_calls false: the first call is the answer
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, calls


def chat_completion(request_id: str, model: str, prompt_tokens: int, results: list[list[SequenceOutput]],
                    tk: Tokenizer, tool_parser: type[ToolParser] | None = None, parallel: bool = True
                    ) -> dict[str, Any]:
    """tool_parser: read the text for tool calls (the request has tools), in the model's format; parallel: all
    the calls it wrote, else only the first (parallel_tool_calls)."""
    choices, completion_tokens = [], 0
    for index, outs in enumerate(results):
        text, logprobs, finish, n_tokens = _joined(outs)
        completion_tokens += n_tokens
        message, calls = _message(text, tool_parser, parallel)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(tk, logprobs), "refusal": None} if logprobs else None,
            "finish_reason": _finish_reason(finish, bool(calls)),
        })
    cached = results[0][-1].cached_tokens
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached)}


def completion(request_id: str, model: str, prompt_tokens: int, results: list[list[SequenceOutput]],
               echoes: list[str], n: int, tk: Tokenizer) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    for index, (outs, echo) in enumerate(zip(results, echoes, strict=True)):
        text, logprobs, finish, n_tokens = _joined(outs)
        completion_tokens += n_tokens
        choices.append({
            "index": index, "text": echo + text,
            "logprobs": completion_logprobs(tk, logprobs) if logprobs else None,
            "finish_reason": finish,
        })
    cached = _cached({i: outs[-1].cached_tokens for i, outs in enumerate(results)}, n)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached)}


def embeddings(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> dict[str, Any]:
    """base64: each vector's little-endian float32 bytes, as OpenAI sends them."""
    def encoded(vector: list[float]) -> list[float] | str:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if encoding == "base64" else vector

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _chunker(request_id: str, object_: str, model: str,
             include_usage: bool) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """Chunks of one stream share id, object, created and model; with include_usage each carries usage: null."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": request_id, "object": object_, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return body

    return chunk


def _stream_error(out: SequenceOutput) -> dict[str, Any]:
    return error_body(out.error or "internal error", "server_error")


def _tool_call_delta(delta: ToolCallDelta, call_ids: dict[int, str]) -> dict[str, Any]:
    """OpenAI's streamed call: the first piece carries id, type and name; the rest only argument text."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    call_ids[delta.index] = _call_id()
    return {"index": delta.index, "id": call_ids[delta.index], "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


async def chat_chunks(request_id: str, model: str, prompt_tokens: int, include_usage: bool, n: int,
                      tk: Tokenizer, outputs: AsyncIterator[tuple[int, SequenceOutput]],
                      tool_parser: type[ToolParser] | None = None, parallel: bool = True
                      ) -> AsyncIterator[dict[str, Any]]:
    """tool_parser, parallel: as in chat_completion; calls stream as tool_calls deltas, the rest as content."""
    chunk = _chunker(request_id, "chat.completion.chunk", model, include_usage)

    started: set[int] = set()
    completion_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    parsers: dict[int, ToolParser] = {}
    call_ids: dict[int, dict[int, str]] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield _stream_error(out)
            return
        if index not in started:
            started.add(index)
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        completion_tokens[index] = out.completion_tokens
        cached[index] = out.cached_tokens
        content, calls = out.text, []
        if tool_parser is not None:
            parser = parsers.setdefault(index, tool_parser())
            parsed = [parser.feed(out.text)] + ([parser.finish()] if out.finish_reason is not None else [])
            content = "".join(p.content for p in parsed)
            calls = [d for p in parsed for d in p.calls if parallel or d.index == 0]
        if content or out.logprobs:
            logprobs = {"content": chat_logprobs(tk, out.logprobs), "refusal": None} if out.logprobs else None
            yield chunk([{"index": index, "delta": {"content": content}, "logprobs": logprobs,
                          "finish_reason": None}])
        for delta in calls:
            yield chunk([{"index": index, "delta": {"tool_calls": [
                _tool_call_delta(delta, call_ids.setdefault(index, {}))]}, "logprobs": None, "finish_reason": None}])
        if out.finish_reason is not None:
            called = index in parsers and bool(parsers[index].calls)
            yield chunk([{"index": index, "delta": {}, "logprobs": None,
                          "finish_reason": _finish_reason(out.finish_reason, called)}])
    if include_usage:
        yield {**chunk([]), "usage": _usage(prompt_tokens, sum(completion_tokens.values()), _cached(cached, n))}


async def completion_chunks(request_id: str, model: str, prompt_tokens: int, include_usage: bool, n: int,
                            tk: Tokenizer, outputs: AsyncIterator[tuple[int, SequenceOutput]]
                            ) -> AsyncIterator[dict[str, Any]]:
    chunk = _chunker(request_id, "text_completion", model, include_usage)

    completion_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    text_offsets: dict[int, int] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield _stream_error(out)
            return
        completion_tokens[index] = out.completion_tokens
        cached[index] = out.cached_tokens
        if out.text or out.logprobs or out.finish_reason is not None:
            start = text_offsets.get(index, 0)
            text_offsets[index] = start + len(out.text)
            logprobs = completion_logprobs(tk, out.logprobs, start) if out.logprobs else None
            yield chunk([{"index": index, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason}])
    if include_usage:
        yield {**chunk([]), "usage": _usage(prompt_tokens, sum(completion_tokens.values()), _cached(cached, n))}

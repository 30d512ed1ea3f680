"""/v1/completions: prompts as text or token ids, echo and logprobs as OpenAI's legacy API gives them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.api.answer import (
    ChoiceUsage,
    Reply,
    StreamUsage,
    cached_per_prompt,
    chunker,
    joined_outputs,
    stream_error,
    usage_body,
)
from tokenmill.api.engine_client import merge
from tokenmill.api.logprobs import TextOffsets, completion_logprobs
from tokenmill.api.protocol import CompletionRequest
from tokenmill.api.serving import (
    Serving,
    collect_unless_disconnected,
    compile_grammar,
    reply_of,
    serving_for,
    sse_response,
    usage_options,
)
from tokenmill.engine.request import SequenceOutput
from tokenmill.loader.tokenizer import Tokenizer

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    async with serving_for(request, body) as serving:
        return await _complete(serving, body, request)


async def _complete(serving: Serving, body: CompletionRequest, request: Request) -> Any:
    params = body.sampling_params(serving.config)
    if body.echo and body.logprobs is not None:  # the prompt's tokens get entries too (lm-eval's loglikelihood)
        params = replace(params, prompt_logprobs=body.logprobs)
    tk = serving.engine.tokenizer
    grammar = await compile_grammar(serving, body.structured_spec())
    prompts = await asyncio.to_thread(lambda: [tk.encode(p) if isinstance(p, str) else p for p in body.prompts()])
    streams = serving.client.submit(prompts, params, body.n, grammar=grammar)
    reply = reply_of(serving, f"cmpl-{uuid.uuid4().hex}")
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        chunks = completion_chunks(reply, [len(p) for p in prompts], body.n, merge(streams),
                                             usage_options(body))
        return sse_response(chunks, streams)
    results = await collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    echoes = [_echoed(p, tk) if body.echo else "" for p in body.prompts() for _ in range(body.n)]
    return completion(reply, prompt_tokens, results, echoes, [p for p in prompts for _ in range(body.n)],
                                body.n)


def _echoed(prompt: str | list[int], tk: Tokenizer) -> str:
    """A prompt as echo shows it: as sent, special tokens and all, for clients cut len(prompt) off the text (OpenAI
    and vLLM echo so); token ids decoded with their special tokens."""
    return prompt if isinstance(prompt, str) else tk.decode(prompt, skip_special_tokens=False)


def completion(reply: Reply, prompt_tokens: int, results: list[list[SequenceOutput]], echoes: list[str],
               prompts: list[list[int]], n: int) -> dict[str, Any]:
    """echoes, prompts: each choice's echoed text (or none) and prompt ids; echoed with logprobs, its first
    output's prompt_logprobs lead the choice's entries."""
    tk = reply.tokenizer
    choices, completion_tokens = [], 0
    for index, (outs, echo, prompt) in enumerate(zip(results, echoes, prompts, strict=True)):
        text, logprobs, finish, n_tokens = joined_outputs(outs)
        completion_tokens += n_tokens
        echoed = outs[0].prompt_logprobs
        choices.append({
            "index": index, "text": echo + text,
            "logprobs": None if not logprobs and echoed is None else completion_logprobs(
                tk, [*(echoed or []), *logprobs], echoed=None if echoed is None else prompt),
            "finish_reason": finish,
        })
    cached = cached_per_prompt({i: outs[-1].cached_tokens for i, outs in enumerate(results)}, n)
    return {"id": reply.request_id, "object": "text_completion", "created": int(time.time()), "model": reply.model,
            "system_fingerprint": reply.fingerprint, "choices": choices,
            "usage": usage_body(prompt_tokens, completion_tokens, cached)}


async def completion_chunks(reply: Reply, prompt_lengths: list[int], n: int,
                            outputs: AsyncIterator[tuple[int, SequenceOutput]],
                            stream_usage: StreamUsage) -> AsyncIterator[dict[str, Any]]:
    """prompt_lengths: each prompt's tokens (choice i answers prompt i // n)."""
    tk = reply.tokenizer
    chunk = chunker(reply, "text_completion", stream_usage.include)
    usage = ChoiceUsage(n, prompt_lengths if stream_usage.continuous else None)
    offsets: dict[int, TextOffsets] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield stream_error(out)
            return
        usage.record(index, out)
        if out.text or out.logprobs or out.finish_reason is not None:
            logprobs = completion_logprobs(tk, out.logprobs, offsets.setdefault(index, TextOffsets())) \
                if out.logprobs else None
            yield chunk([{"index": index, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason}], usage.of(index))
    if stream_usage.include:
        yield chunk([], usage.total(sum(prompt_lengths)))

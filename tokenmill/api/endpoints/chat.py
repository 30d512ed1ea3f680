"""/v1/chat/completions: render the chat template, tokenize, submit; the body or the stream of chunks, tool calls
read from the text where the request has tools."""

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
    chunker,
    finish_reason_of,
    joined_outputs,
    new_call_id,
    stream_error,
    usage_body,
)
from tokenmill.api.engine_client import RequestStream, merge
from tokenmill.api.logprobs import chat_logprobs, shown_tokens
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.serving import (
    Serving,
    collect_unless_disconnected,
    compile_grammar,
    reply_of,
    serving_for,
    sse_response,
    usage_options,
)
from tokenmill.api.tools.parsers import ToolCall, ToolCallDelta, ToolParser, choose_parser, parse_tool_calls
from tokenmill.api.tools.request import check_forced_schemas, forced_call_spec, template_inputs
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import ModelFormatError, RequestError
from tokenmill.loader.chat_template import ChatTemplate

router = APIRouter()


def _chat_prompt(serving: Serving, body: ChatCompletionRequest) -> tuple[list[int], type[ToolParser]]:
    """The rendered and tokenized conversation, and the tool-call format of its template (run in a worker thread:
    rendering and tokenizing may take a while)."""
    engine, config = serving.engine, serving.config
    template = engine.chat_template
    if body.chat_template is not None:
        if not config.allow_request_chat_template:
            raise RequestError("this server does not take chat templates from requests "
                               "(--allow-request-chat-template)", param="chat_template")
        try:
            template = ChatTemplate(body.chat_template, engine.tokenizer.bos_token, engine.tokenizer.eos_token)
        except ModelFormatError as exc:
            raise RequestError(str(exc), param="chat_template") from exc
    parser = choose_parser(template.source, config.tool_call_parser)
    messages, tools = template_inputs(body, template, parser)

    def render(inputs: tuple[list[dict], list[dict] | None]) -> str:
        return template.render(inputs[0], add_generation_prompt=body.add_generation_prompt, tools=inputs[1],
                               timeout=config.chat_template_timeout, max_chars=config.chat_template_max_chars)

    return engine.tokenizer.encode_chat(render, (messages, tools)), parser


async def submit_chat(serving: Serving, body: ChatCompletionRequest
                       ) -> tuple[list[RequestStream], int, type[ToolParser] | None]:
    """Render, tokenize, compile the request's constraint and submit it: its streams, its prompt's length, and the
    parser that reads tool calls from its outputs (None: the request has no tools)."""
    params = body.sampling_params(serving.config)
    prompt_ids, parser = await asyncio.to_thread(_chat_prompt, serving, body)
    forced = forced_call_spec(body, parser)
    try:
        grammar = await compile_grammar(serving, (forced, "tools") if forced else body.structured_spec())
    except RequestError:
        if forced:
            await asyncio.to_thread(check_forced_schemas, body, parser)
        raise
    tool_parser = parser if body.uses_tools else None
    if tool_parser is not None:
        tk = serving.engine.tokenizer
        params = replace(params, shown_special_token_ids=tk.special_token_ids(parser.delimiters))
    streams = serving.client.submit([prompt_ids], params, body.n, prompt_param="messages", grammar=grammar,
                                    max_tokens_param=body.max_tokens_param)
    return streams, len(prompt_ids), tool_parser


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    async with serving_for(request, body) as serving:
        return await _chat(serving, body, request)


async def _chat(serving: Serving, body: ChatCompletionRequest, request: Request) -> Any:
    streams, prompt_tokens, tool_parser = await submit_chat(serving, body)
    reply = reply_of(serving, f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        chunks = chat_chunks(reply, prompt_tokens, body.n, merge(streams), usage_options(body),
                                       tool_parser, body.parallel_tool_calls)
        return sse_response(chunks, streams)
    results = await collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)  # nobody is there to read it
    return chat_completion(reply, prompt_tokens, results, tool_parser, body.parallel_tool_calls)


def _message(text: str, tool_parser: type[ToolParser] | None, parallel: bool, finish: str | None
             ) -> tuple[dict[str, Any], list[ToolCall]]:
    if tool_parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, []
    content, calls = parse_tool_calls(tool_parser, text, finish)
    calls = calls if parallel else calls[:1]  # parallel_tool_calls false: the first call is the answer
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, calls


def chat_completion(reply: Reply, prompt_tokens: int, results: list[list[SequenceOutput]],
                    tool_parser: type[ToolParser] | None = None, parallel: bool = True) -> dict[str, Any]:
    """tool_parser: read the text for tool calls (the request has tools), in the model's format; parallel: all
    the calls it wrote, else only the first (parallel_tool_calls)."""
    tk = reply.tokenizer
    choices, completion_tokens = [], 0
    for index, outs in enumerate(results):
        text, logprobs, finish, n_tokens = joined_outputs(outs)
        completion_tokens += n_tokens
        message, calls = _message(text, tool_parser, parallel, finish)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(tk, logprobs, shown_tokens(tk, tool_parser)), "refusal": None}
            if logprobs else None,
            "finish_reason": finish_reason_of(finish, bool(calls)),
        })
    cached = results[0][-1].cached_tokens
    return {"id": reply.request_id, "object": "chat.completion", "created": int(time.time()), "model": reply.model,
            "system_fingerprint": reply.fingerprint, "choices": choices,
            "usage": usage_body(prompt_tokens, completion_tokens, cached)}


def _tool_call_delta(delta: ToolCallDelta, call_ids: dict[int, str]) -> dict[str, Any]:
    """OpenAI's streamed call: the first piece carries id, type and name; the rest only argument text."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    call_ids[delta.index] = new_call_id()
    return {"index": delta.index, "id": call_ids[delta.index], "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


async def chat_chunks(reply: Reply, prompt_tokens: int, n: int, outputs: AsyncIterator[tuple[int, SequenceOutput]],
                      stream_usage: StreamUsage, tool_parser: type[ToolParser] | None = None,
                      parallel: bool = True) -> AsyncIterator[dict[str, Any]]:
    """tool_parser, parallel: as in chat_completion; calls stream as tool_calls deltas, the rest as content."""
    tk = reply.tokenizer
    chunk = chunker(reply, "chat.completion.chunk", stream_usage.include)
    usage = ChoiceUsage(n, [prompt_tokens] if stream_usage.continuous else None)

    started: set[int] = set()
    parsers: dict[int, ToolParser] = {}
    call_ids: dict[int, dict[int, str]] = {}
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield stream_error(out)
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
            logprobs = {"content": chat_logprobs(tk, out.logprobs, shown_tokens(tk, tool_parser)), "refusal": None} \
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
                          "finish_reason": finish_reason_of(out.finish_reason, called)}], usage.of(index))
    if stream_usage.include:
        yield chunk([], usage.total(prompt_tokens))

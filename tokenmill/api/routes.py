"""The routes: validate, render the chat template, tokenize, submit, stream the outputs back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.api import responses
from tokenmill.api.engine_client import EngineClient, RequestStream, collect, merge
from tokenmill.api.errors import error_response
from tokenmill.api.guards import ServingState
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.api.sse import sse_done, sse_event
from tokenmill.api.tool_parsers import ToolParser, choose_parser
from tokenmill.api.tools import forced_call_spec, template_inputs
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import ModelFormatError, ModelNotFoundError, RequestError
from tokenmill.loader.chat_template import ChatTemplate
from tokenmill.structured import StructuredSpec
from tokenmill.structured.backend import CompiledGrammar

router = APIRouter()


@dataclass
class Serving:
    """What the routes read from app.state.serving (api/app.py puts it there)."""

    engine: Engine
    client: EngineClient
    model_id: str  # what /v1/models lists
    accepted_names: set[str]  # model_id and its aliases: what requests may name
    config: ServerConfig
    state: ServingState
    created: int = field(default_factory=lambda: int(time.time()))


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _check_model(serving: Serving, name: str) -> None:
    if name not in serving.accepted_names:
        raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    serving = _serving(request)
    if not serving.engine.alive:
        return error_response(503, "the engine is not running", "service_unavailable")
    if serving.state.draining:
        return error_response(503, "the server is shutting down", "service_unavailable")
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_serving(request).engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    serving = _serving(request)
    return {"object": "list", "data": [{
        "id": serving.model_id, "object": "model", "created": serving.created, "owned_by": "tokenmill",
        "max_model_len": serving.engine.max_model_len,
    }]}


async def _grammar(serving: Serving, found: tuple[StructuredSpec, str] | None) -> CompiledGrammar | None:
    """A request's structured-output constraint (and the field that asked), compiled in a worker thread within
    the server's time budget."""
    if found is None:
        return None
    spec, param = found
    timeout = serving.config.grammar_compile_timeout
    try:
        return await asyncio.wait_for(asyncio.to_thread(serving.engine.grammars.compile, spec, param), timeout)
    except TimeoutError as exc:
        raise RequestError(f"{param}: did not compile within {timeout:g} s", param=param) from exc


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
    prompt = template.render(messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                             timeout=config.chat_template_timeout, max_chars=config.chat_template_max_chars)
    return engine.tokenizer.encode_chat(prompt, [m["content"] for m in messages]), parser


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    serving = _serving(request)
    _check_model(serving, body.model)
    params = body.sampling_params(serving.config)
    prompt_ids, parser = await asyncio.to_thread(_chat_prompt, serving, body)
    forced = forced_call_spec(body, parser)
    grammar = await _grammar(serving, (forced, "tools") if forced else body.structured_spec())
    tk = serving.engine.tokenizer
    tool_parser = parser if body.uses_tools else None
    if tool_parser is not None:
        params = replace(params, shown_special_token_ids=tk.special_token_ids(parser.delimiters))
    streams = serving.client.submit([prompt_ids], params, body.n, prompt_param="messages", grammar=grammar)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = responses.chat_chunks(request_id, serving.model_id, len(prompt_ids), include_usage, body.n, tk,
                                       merge(streams), tool_parser)
        return _sse_response(chunks, streams)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)  # nobody is there to read it
    return responses.chat_completion(request_id, serving.model_id, len(prompt_ids), results, tk, tool_parser)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    serving = _serving(request)
    _check_model(serving, body.model)
    params = body.sampling_params(serving.config)
    if body.echo and body.logprobs is not None:
        raise RequestError("echo with logprobs is not supported", param="echo")
    tk = serving.engine.tokenizer
    grammar = await _grammar(serving, body.structured_spec())
    prompts = await asyncio.to_thread(lambda: [tk.encode(p) if isinstance(p, str) else p for p in body.prompts()])
    streams = serving.client.submit(prompts, params, body.n, grammar=grammar)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = responses.completion_chunks(request_id, serving.model_id, prompt_tokens, include_usage, body.n, tk,
                                             merge(streams))
        return _sse_response(chunks, streams)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    echoes = [tk.decode(p) if body.echo else "" for p in prompts for _ in range(body.n)]
    return responses.completion(request_id, serving.model_id, prompt_tokens, results, echoes, body.n, tk)


async def _collect_unless_disconnected(request: Request, streams: list[RequestStream]
                                      ) -> list[list[SequenceOutput]] | None:
    """collect, unless the client goes away first: then every stream is aborted and None returned."""
    collecting = asyncio.ensure_future(collect(streams))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()  # its finally aborts the streams
    await asyncio.gather(collecting, return_exceptions=True)
    return None if collecting.cancelled() else collecting.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: what comes next on the channel is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse_response(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
            yield sse_done()
        finally:
            # A client that went away mid-stream cancels this generator: free its sequences now.
            for s in streams:
                s.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

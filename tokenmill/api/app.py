"""The OpenAI-compatible HTTP API: validate, render the chat template, tokenize, submit, stream the outputs back.

Handlers never touch tensors; the engine's loop runs the model on its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.api import responses
from tokenmill.api.guards import RequestGuard, ServingState
from tokenmill.api.guards import error_response as _error
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.api.sse import sse_done, sse_event
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine, RequestStream
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import EngineError, ModelFormatError, RequestError
from tokenmill.loader.chat_template import ChatTemplate
from tokenmill.sampling import SamplingParams

log = logging.getLogger(__name__)


def create_app(engine: Engine, model_id: str, aliases: set[str] | None = None, config: ServerConfig | None = None,
               state: ServingState | None = None) -> FastAPI:
    """model_id is what /v1/models lists; requests may name the model by it or by any of aliases. `state` is
    shared with the server, which sets it draining on SIGTERM."""
    accepted = {model_id, *(aliases or set())}
    created = int(time.time())
    config = config or ServerConfig()
    state = state or ServingState()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        yield
        engine.stop()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.add_middleware(RequestGuard, state=state, api_keys=config.api_key, max_body_bytes=config.max_request_bytes,
                       max_json_depth=config.max_json_depth)
    if config.allowed_origins:  # outermost, so preflight requests are answered before the API key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return _error(500, str(exc), "internal_error", code=500)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal server error", "internal_error")

    def check_model(name: str) -> None:
        if name not in accepted:
            raise RequestError(f"The model `{name}` does not exist.", param="model", status=404,
                               code="model_not_found", type="not_found_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return _error(503, "the engine is not running", "service_unavailable")
        if state.draining:
            return _error(503, "the server is shutting down", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_id, "object": "model", "created": created, "owned_by": "tokenmill",
            "max_model_len": engine.max_model_len,
        }]}

    def chat_prompt(body: ChatCompletionRequest) -> list[int]:
        """The rendered and tokenized conversation (run in a worker thread: both may take a while)."""
        template = engine.loaded.chat_template
        if body.chat_template is not None:
            if not config.allow_request_chat_template:
                raise RequestError("this server does not take chat templates from requests "
                                   "(--allow-request-chat-template)", param="chat_template")
            try:
                template = ChatTemplate(body.chat_template, engine.tokenizer.bos_token, engine.tokenizer.eos_token)
            except ModelFormatError as exc:
                raise RequestError(str(exc), param="chat_template") from exc
        messages = body.template_messages()
        prompt = template.render(messages, add_generation_prompt=body.add_generation_prompt,
                                 timeout=config.chat_template_timeout, max_chars=config.chat_template_max_chars)
        return engine.tokenizer.encode_chat(prompt, [m["content"] for m in messages])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        params = body.sampling_params(config)
        prompt_ids = await asyncio.to_thread(chat_prompt, body)
        streams = _submit(engine, [prompt_ids], params, body.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tk = engine.tokenizer
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = responses.chat_chunks(request_id, model_id, len(prompt_ids), include_usage, body.n, tk,
                                           _merge(streams))
            return _sse_response(chunks, streams)
        results = await _collect_unless_disconnected(request, streams)
        if results is None:
            return Response(status_code=499)  # nobody is there to read it
        return responses.chat_completion(request_id, model_id, len(prompt_ids), results, tk)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        params = body.sampling_params(config)
        if body.echo and body.logprobs is not None:
            raise RequestError("echo with logprobs is not supported", param="echo")
        tk = engine.tokenizer
        prompts = await asyncio.to_thread(lambda: [tk.encode(p) if isinstance(p, str) else p for p in body.prompts()])
        streams = _submit(engine, prompts, params, body.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = responses.completion_chunks(request_id, model_id, prompt_tokens, include_usage, body.n, tk,
                                                 _merge(streams))
            return _sse_response(chunks, streams)
        results = await _collect_unless_disconnected(request, streams)
        if results is None:
            return Response(status_code=499)
        echoes = [tk.decode(p) if body.echo else "" for p in prompts for _ in range(body.n)]
        return responses.completion(request_id, model_id, prompt_tokens, results, echoes, body.n, tk)

    return app


def _submit(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int) -> list[RequestStream]:
    """n sequences per prompt, all or none. A seeded request gives choice i the seed + i, so choices differ but
    repeat. No await from the capacity check to the last submit: concurrent handlers cannot both pass it."""
    engine.check_capacity(len(prompts) * n)
    streams = []
    try:
        for prompt_ids in prompts:
            for i in range(n):
                p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
                streams.append(engine.submit(prompt_ids, p))
    except RequestError:
        for s in streams:
            s.abort()
        raise
    return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, SequenceOutput]]:
    """Outputs of several sequences as they come, tagged with the choice index."""
    merged: asyncio.Queue[tuple[int, SequenceOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for out in stream:
            await merged.put((index, out))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, out = await merged.get()
            if out is None:
                remaining -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def _collect(streams: list[RequestStream]) -> list[list[SequenceOutput]]:
    """Every output of every choice, for a non-streaming answer; aborts all if the handler is cancelled."""
    results: list[list[SequenceOutput]] = [[] for _ in streams]
    try:
        async for index, out in _merge(streams):
            results[index].append(out)
    finally:
        for s in streams:
            s.abort()
    for outs in results:
        if outs and outs[-1].finish_reason == "error":
            raise EngineError(outs[-1].error or "internal error while running the model")
    return results


async def _collect_unless_disconnected(request: Request, streams: list[RequestStream]
                                      ) -> list[list[SequenceOutput]] | None:
    """_collect, unless the client goes away first: then every stream is aborted and None returned."""
    collecting = asyncio.ensure_future(_collect(streams))
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

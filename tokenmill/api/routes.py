"""The routes: validate, render the chat template, tokenize, submit, stream the outputs back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.api import responses
from tokenmill.api.engine_client import EngineClient, RequestStream, collect, merge
from tokenmill.api.errors import error_response
from tokenmill.api.guards import ServingState
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, SamplingFields
from tokenmill.api.response_store import ResponseStore
from tokenmill.api.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    listed_items,
    refuse_include,
    response_events,
    response_object,
)
from tokenmill.api.sse import sse_done, sse_event
from tokenmill.api.tool_parsers import ToolParser, choose_parser
from tokenmill.api.tools import check_forced_schemas, forced_call_spec, template_inputs
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import ModelFormatError, ModelNotFoundError, NotFoundError, RequestError
from tokenmill.loader.chat_template import ChatTemplate
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling import SamplingParams
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
    responses: ResponseStore | None  # stored Responses (None: --responses-store off)
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


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    """The dashboard's data, one JSON snapshot of the engine and its counters (docs/features/ui.md); the same
    counters as /metrics."""
    serving = _serving(request)
    engine = serving.engine
    return JSONResponse({"object": "tokenmill.stats", "time": time.time(), "model": serving.model_id,
                         "uptime_s": round(time.time() - serving.created, 1), "max_model_len": engine.max_model_len,
                         "max_num_seqs": engine.config.max_num_seqs, **engine.snapshot()})


def _model_card(serving: Serving) -> dict[str, Any]:
    return {"id": serving.model_id, "object": "model", "created": serving.created, "owned_by": "tokenmill",
            "max_model_len": serving.engine.max_model_len, "deterministic": serving.engine.config.deterministic}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(_serving(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model by its id or an alias (ids may hold slashes, like Hugging Face names)."""
    serving = _serving(request)
    _check_model(serving, model_id)
    return _model_card(serving)


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

    def render(inputs: tuple[list[dict], list[dict] | None]) -> str:
        return template.render(inputs[0], add_generation_prompt=body.add_generation_prompt, tools=inputs[1],
                               timeout=config.chat_template_timeout, max_chars=config.chat_template_max_chars)

    return engine.tokenizer.encode_chat(render, (messages, tools)), parser


async def _submit_chat(serving: Serving, body: ChatCompletionRequest
                       ) -> tuple[list[RequestStream], int, type[ToolParser] | None]:
    """Render, tokenize, compile the request's constraint and submit it: its streams, its prompt's length, and the
    parser that reads tool calls from its outputs (None: the request has no tools)."""
    params = body.sampling_params(serving.config)
    prompt_ids, parser = await asyncio.to_thread(_chat_prompt, serving, body)
    forced = forced_call_spec(body, parser)
    try:
        grammar = await _grammar(serving, (forced, "tools") if forced else body.structured_spec())
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
    serving = _serving(request)
    _check_model(serving, body.model)
    streams, prompt_tokens, tool_parser = await _submit_chat(serving, body)
    reply = _reply(serving, f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        chunks = responses.chat_chunks(reply, prompt_tokens, body.n, merge(streams), _usage_options(body),
                                       tool_parser, body.parallel_tool_calls)
        return _sse_response(chunks, streams)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)  # nobody is there to read it
    return responses.chat_completion(reply, prompt_tokens, results, tool_parser, body.parallel_tool_calls)


# A Responses request runs as a chat request: errors name the Responses field the chat field came from (and
# tools.N.function.X as tools.N.X).
_RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens":
                     "max_output_tokens", "response_format": "text.format"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    serving = _serving(request)
    _check_model(serving, body.model)
    store = serving.responses
    if store is None and body.previous_response_id is not None:
        raise RequestError("this server stores no responses (--responses-store off)", param="previous_response_id")
    history = [] if body.previous_response_id is None or store is None else await asyncio.to_thread(
        store.conversation, body.previous_response_id)
    items = body.input_items()
    try:
        streams, prompt_tokens, tool_parser = await _submit_chat(serving, body.chat_request(history + items))
    except RequestError as exc:  # named as the Responses API names the field, in the param and the message
        old = exc.param or ""
        new = _RESPONSES_PARAMS.get(old, old.replace(".function.", ".", 1) if old.startswith("tools.") else old)
        if old and new != old:
            exc.param = new
            exc.message = new + exc.message[len(old):] if exc.message.startswith(old) else exc.message
        raise
    builder = ResponseBuilder(body, serving.model_id, prompt_tokens)

    async def save(response: dict[str, Any]) -> None:
        """Keep a finished response where asked. One not kept (failed or cancelled, or one the store could not write:
        a full disk) is answered with store false: never an id that GET will not find."""
        if store is None or not body.store:
            return
        kept = response["status"] in ("completed", "incomplete")
        response["store"] = kept and await asyncio.to_thread(store.put, response, listed_items(items, response["id"]))

    if body.stream:
        async def events() -> AsyncIterator[dict[str, Any]]:
            async for event in response_events(builder, merge(streams), tool_parser):
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    await save(event["response"])
                yield event
        return _sse_response(events(), streams, done=False)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    response = response_object(builder, results[0], tool_parser)
    await save(response)
    return response


def _stored(serving: Serving, response_id: str) -> ResponseStore:
    if serving.responses is None:
        raise NotFoundError(f"Response with id '{response_id}' not found (this server stores no responses).",
                            param="response_id")
    return serving.responses


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    found = await asyncio.to_thread(_stored(_serving(request), response_id).get, response_id)
    if found is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return found


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
                           include: Annotated[list[str] | None, Query()] = None,
                           include_: Annotated[list[str] | None, Query(alias="include[]")] = None) -> dict[str, Any]:
    """The items the response's model read (the conversation it continues, then its own input), a page of them as
    OpenAI pages lists: `limit` items after the one named `after`, newest first unless `order` is asc. (The openai
    SDK sends a list as include[]=....)"""
    refuse_include(include or include_)
    turns = await asyncio.to_thread(_stored(_serving(request), response_id).input_items, response_id)
    if turns is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    # rows stored before input items were kept listed get their ids here, the same ones each time
    items = [item for turn_id, turn in turns for item in listed_items(turn, turn_id)]
    if order == "desc":
        items.reverse()
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), None)
        if start is None:
            raise RequestError(f"after: no input item of response '{response_id}' has the id '{after}'",
                               param="after")
        items = items[start:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not await asyncio.to_thread(_stored(_serving(request), response_id).delete, response_id):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    serving = _serving(request)
    _check_model(serving, body.model)
    params = body.sampling_params(serving.config)
    if body.echo and body.logprobs is not None:  # the prompt's tokens get entries too (lm-eval's loglikelihood)
        params = replace(params, prompt_logprobs=body.logprobs)
    tk = serving.engine.tokenizer
    grammar = await _grammar(serving, body.structured_spec())
    prompts = await asyncio.to_thread(lambda: [tk.encode(p) if isinstance(p, str) else p for p in body.prompts()])
    streams = serving.client.submit(prompts, params, body.n, grammar=grammar)
    reply = _reply(serving, f"cmpl-{uuid.uuid4().hex}")
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        chunks = responses.completion_chunks(reply, [len(p) for p in prompts], body.n, merge(streams),
                                             _usage_options(body))
        return _sse_response(chunks, streams)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    echoes = [_echoed(p, tk) if body.echo else "" for p in body.prompts() for _ in range(body.n)]
    return responses.completion(reply, prompt_tokens, results, echoes, [p for p in prompts for _ in range(body.n)],
                                body.n)


def _echoed(prompt: str | list[int], tk: Tokenizer) -> str:
    """A prompt as echo shows it: as sent, special tokens and all, for clients cut len(prompt) off the text (OpenAI
    and vLLM echo so); token ids decoded with their special tokens."""
    return prompt if isinstance(prompt, str) else tk.decode(prompt, skip_special_tokens=False)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    """Each input's prompt runs through the engine like any prefill, batched with what else runs; its final hidden
    states, pooled (--pooling) and L2-normalized, are the embedding."""
    serving = _serving(request)
    _check_model(serving, body.model)
    engine = serving.engine
    inputs = body.inputs()
    if len(inputs) > serving.config.max_embedding_inputs:
        raise RequestError(f"at most {serving.config.max_embedding_inputs} inputs are allowed", param="input")
    size = engine.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise RequestError(f"dimensions: this model's embeddings have {size}", param="dimensions")
    prompts = await asyncio.to_thread(lambda: [engine.tokenizer.encode(x) if isinstance(x, str) else x
                                               for x in inputs])
    streams = serving.client.submit(prompts, SamplingParams(max_tokens=0), prompt_param="input", embed=True)
    results = await _collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    prompt_tokens = sum(len(p) for p in prompts)
    return responses.embeddings(serving.model_id, [outs[-1].embedding or [] for outs in results], prompt_tokens,
                                body.encoding_format)


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


def _usage_options(body: SamplingFields) -> responses.StreamUsage:
    """vLLM's continuous_usage_stats takes effect with include_usage, as in vLLM."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return responses.StreamUsage(include, include and bool(options and options.continuous_usage_stats))


def _reply(serving: Serving, request_id: str) -> responses.Reply:
    return responses.Reply(request_id, serving.model_id, serving.engine.tokenizer, serving.engine.system_fingerprint)


def _sse_response(chunks: AsyncIterator[dict], streams: list[RequestStream], done: bool = True) -> StreamingResponse:
    """Chat and completions chunks end with [DONE] (done); Responses events are named and end with their last."""
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk, None if done else chunk["type"])
            if done:
                yield sse_done()
        finally:
            # A client that went away mid-stream cancels this generator: free its sequences now.
            for s in streams:
                s.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

"""What every endpoint reads and does alike: the serving state the app holds, the model a request names, its
structured-output constraint compiled within the budget, its outputs collected unless the client leaves, a stream
as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.api.answer import Reply, StreamUsage
from tokenmill.api.engine_client import Account, EngineClient, RequestStream, collect
from tokenmill.api.errors import error_body
from tokenmill.api.guards import ServingState
from tokenmill.api.protocol import RequestModel, SamplingFields
from tokenmill.api.response_store import ResponseStore
from tokenmill.api.sse import sse_done, sse_event
from tokenmill.config import ServerConfig, parse_keep_alive
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import Owner, SequenceOutput
from tokenmill.errors import ConfigError, PermissionDeniedError, RequestError
from tokenmill.hosting.pool import UNSET, ModelPool
from tokenmill.structured import StructuredSpec
from tokenmill.structured.backend import CompiledGrammar
from tokenmill.tenants.keys import Tenant
from tokenmill.tenants.tenancy import ANONYMOUS, Tenancy


@dataclass
class Hosting:
    """What the routes read from app.state.hosting (api/app.py puts it there): the models and the server's own."""

    pool: ModelPool
    config: ServerConfig
    state: ServingState
    responses: ResponseStore | None  # stored Responses (None: --responses-store off)
    tenancy: Tenancy
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Serving:
    """What a request for one model is served with: its engine, and the server's settings with the model's own."""

    engine: Engine
    client: EngineClient
    model_id: str  # what /v1/models lists
    config: ServerConfig
    state: ServingState
    responses: ResponseStore | None
    tenant: str  # the name of the tenant it is served for (ANONYMOUS: the server has no keys)


def hosting_of(request: Request) -> Hosting:
    return request.app.state.hosting


def tenant_of(request: Request) -> Tenant | None:
    """The tenant whose key the request carries (api/guards.py; None: the server has no keys)."""
    return getattr(request.state, "tenant", None)


def tenant_name(request: Request) -> str:
    tenant = tenant_of(request)
    return ANONYMOUS if tenant is None else tenant.name


def may_use(hosting: Hosting, tenant: Tenant, name: str) -> bool:
    """Whether the tenant may use the model named: listed by its id or an alias of it; a LoRA adapter only by its
    own name (its base model's does not admit it)."""
    if tenant.may_use(name):
        return True
    return hosting.pool.adapter_of(name) is None and tenant.may_use(hosting.pool.find(name).name)


def account_of(hosting: Hosting, tenant: Tenant | None, model: str) -> Account:
    if tenant is None:
        return Account(ANONYMOUS, model, hosting.tenancy.ledger)
    limits = hosting.tenancy.limits(tenant)
    owner = Owner(tenant.name, tenant.weight, tenant.cache_namespace,
                  limits if tenant.tokens_per_minute is not None else None)
    return Account(tenant.name, model, hosting.tenancy.ledger, limits, owner, tenant.max_tokens)


@contextlib.asynccontextmanager
async def serving_for(request: Request, body: RequestModel) -> AsyncIterator[Serving]:
    """The model the body names, loaded (a request may wait for that), kept from unloading until the handler has
    submitted its sequences (they keep it from then on); 404 for a model this server does not have."""
    hosting = hosting_of(request)
    name: str = body.model  # type: ignore[attr-defined]
    tenant = tenant_of(request)
    if tenant is not None and not may_use(hosting, tenant, name):
        raise PermissionDeniedError(f"this key may not use the model {name!r}", param="model",
                                    code="model_not_allowed")
    keep_alive: object = UNSET
    if (asked := getattr(body, "keep_alive", None)) is not None:
        try:
            keep_alive = parse_keep_alive(asked)
        except ConfigError as exc:
            raise RequestError(str(exc), param="keep_alive") from None
    async with hosting.pool.lease(name, keep_alive) as hosted:
        assert hosted.engine is not None
        config = hosting.config
        if hosted.spec.tool_call_parser is not None:
            config = replace(config, tool_call_parser=hosted.spec.tool_call_parser)
        adapter = hosting.pool.adapter_of(name)  # a LoRA adapter answers as itself
        model_id = adapter or hosted.name
        account = account_of(hosting, tenant, model_id)
        yield Serving(hosted.engine, EngineClient(hosted.engine, adapter, account), model_id, config, hosting.state,
                      hosting.responses, account.tenant)


async def compile_grammar(serving: Serving, found: tuple[StructuredSpec, str] | None) -> CompiledGrammar | None:
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


async def collect_unless_disconnected(request: Request, streams: list[RequestStream]
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


def usage_options(body: SamplingFields) -> StreamUsage:
    """vLLM's continuous_usage_stats takes effect with include_usage, as in vLLM."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return StreamUsage(include, include and bool(options and options.continuous_usage_stats))


def reply_of(serving: Serving, request_id: str) -> Reply:
    return Reply(request_id, serving.model_id, serving.engine.tokenizer, serving.engine.system_fingerprint)


def _quota_error(done: bool) -> str:
    """The last event of a stream that its tenant's tokens per minute cut: each answer ended there ("length")."""
    message = ("Rate limit reached on tokens per min (TPM): the answer was cut where the limit was reached; "
               "retry later for the rest.")
    if done:
        return sse_event(error_body(message, "tokens", code="rate_limit_exceeded"), None)
    return sse_event({"type": "error", "code": "rate_limit_exceeded", "message": message, "param": None}, "error")


def sse_response(chunks: AsyncIterator[dict], streams: list[RequestStream], done: bool = True) -> StreamingResponse:
    """Chat and completions chunks end with [DONE] (done); Responses events are named and end with their last."""
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk, None if done else chunk["type"])
            if any(s.cut for s in streams):
                yield _quota_error(done)
            if done:
                yield sse_done()
        finally:
            # A client that went away mid-stream cancels this generator: free its sequences now.
            for s in streams:
                s.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

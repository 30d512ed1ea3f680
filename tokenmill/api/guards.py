"""What every request passes before a handler sees it: draining, the API key (whose tenant the handler finds in
`request.state.tenant`), the admin's routes, the tenant's request limits, the size and nesting of its body; and
the tenant's x-ratelimit-* headers on every response.

A pure ASGI middleware, so a body is bounded while it arrives, before anything parses it, and the handler still
receives the client's disconnect afterwards (the body is replayed, then the real channel is handed over).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from tokenmill.api.errors import domain_error_response, error_response
from tokenmill.errors import RateLimitError
from tokenmill.tenants.keys import Tenant
from tokenmill.tenants.limits import TenantLimits
from tokenmill.tenants.tenancy import Tenancy

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_ROUTES = {"/health"}  # no API key needed; answers 503 itself while draining (the app adds its pages)
# Routes only an admin's key may use where keys are set: what they show or change is every tenant's.
ADMIN_ROUTES = {"/metrics", "/stats", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # possessive: no backtracking over long strings
_BRACKET_STEP = np.zeros(256, dtype=np.int32)  # +1 for an opening bracket, -1 for a closing one, by byte value
_BRACKET_STEP[[ord("["), ord("{")]], _BRACKET_STEP[[ord("]"), ord("}")]] = 1, -1


@dataclass
class ServingState:
    """Shared by the app and the server: set `draining` and new requests get 503 while in-flight ones finish."""
    draining: bool = False
    # Requests let through whose handler has not returned, a body still arriving or a prompt still being rendered
    # included: a drain waits for them too, not only for the engine's sequences.
    in_flight: int = 0


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects, counted outside string literals, without parsing."""
    outside_strings = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    return int(np.cumsum(_BRACKET_STEP[outside_strings]).max(initial=0))


def bearer_token(header: bytes | None) -> str | None:
    scheme, _, token = (header or b"").partition(b" ")
    return token.strip().decode("latin-1") if scheme.lower() == b"bearer" else None


class RequestGuard:
    def __init__(self, app: ASGIApp, state: ServingState, tenancy: Tenancy, max_body_bytes: int,
                 max_json_depth: int, open_routes: frozenset[str] = frozenset(OPEN_ROUTES)) -> None:
        self.app = app
        self.open_routes = open_routes
        self.state = state
        self.tenancy = tenancy
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_routes:
            return await self.app(scope, receive, send)
        refusal, tenant = self._refuse(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        limits = None if tenant is None else self.tenancy.limits(tenant)
        if limits is not None:
            send = _with_rate_headers(send, limits)
            if scope["method"] == "POST" and scope["path"].startswith("/v1/"):  # a request for the models
                try:
                    limits.admit()
                except RateLimitError as exc:
                    return await domain_error_response(exc)(scope, receive, send)
            else:
                limits = None  # not counted, nothing to release
        self.state.in_flight += 1
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                if isinstance(body, JSONResponse):
                    return await body(scope, receive, send)
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
            if limits is not None:
                limits.done()

    def _refuse(self, scope: Scope) -> tuple[JSONResponse | None, Tenant | None]:
        """The refusal of a request, or the tenant whose key it carries (None: the server has no keys)."""
        if self.state.draining:
            return error_response(503, "the server is shutting down", "service_unavailable",
                                  headers={"Retry-After": "5", "Connection": "close"}), None
        if not self.tenancy.keyed:
            return None, None
        token = bearer_token(dict(scope["headers"]).get(b"authorization"))
        tenant = None if token is None else self.tenancy.authenticate(token)
        if tenant is None:
            return error_response(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                                  "invalid_request_error", code="invalid_api_key"), None
        if scope["path"] in ADMIN_ROUTES and not tenant.admin:
            return error_response(403, f"{scope['path']} needs an admin's key", "permission_error",
                                  code="admin_only"), None
        return None, tenant

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | JSONResponse:
        """The whole body, or the refusal of it."""
        too_large = error_response(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                   "invalid_request_error", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return error_response(400, "the client went away", "invalid_request_error")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return too_large
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_depth(body) > self.max_json_depth:
            return error_response(400, f"the request body nests deeper than {self.max_json_depth} levels",
                                  "invalid_request_error")
        return body


def _with_rate_headers(send: Send, limits: TenantLimits) -> Send:
    """send, adding the tenant's x-ratelimit-* headers to the response's start (as they stand then)."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k.encode(), v.encode()) for k, v in limits.headers().items()]
            message = {**message, "headers": [*message.get("headers", []), *headers]}
        await send(message)

    return sending


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, when it comes

    return replay

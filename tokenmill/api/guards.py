"""What every request passes before a handler sees it: draining, the API key, the size and nesting of its body.

A pure ASGI middleware, so a body is bounded while it arrives, before anything parses it, and the handler still
receives the client's disconnect afterwards (the body is replayed, then the real channel is handed over).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from tokenmill.api.errors import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_ROUTES = {"/health"}  # no API key needed; answers 503 itself while draining (the app adds its pages)
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


def _api_key_ok(header: bytes | None, keys: tuple[bytes, ...]) -> bool:
    scheme, _, token = (header or b"").partition(b" ")
    matches = [hmac.compare_digest(token.strip(), key) for key in keys]  # every key compared: no early exit
    return scheme.lower() == b"bearer" and any(matches)


class RequestGuard:
    def __init__(self, app: ASGIApp, state: ServingState, api_keys: tuple[str, ...], max_body_bytes: int,
                 max_json_depth: int, open_routes: frozenset[str] = frozenset(OPEN_ROUTES)) -> None:
        self.app = app
        self.open_routes = open_routes
        self.state = state
        self.keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_routes:
            return await self.app(scope, receive, send)
        refusal = self._refuse(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
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

    def _refuse(self, scope: Scope) -> JSONResponse | None:
        if self.state.draining:
            return error_response(503, "the server is shutting down", "service_unavailable",
                                  headers={"Retry-After": "5", "Connection": "close"})
        if self.keys and not _api_key_ok(dict(scope["headers"]).get(b"authorization"), self.keys):
            return error_response(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                                  "invalid_request_error", code="invalid_api_key")
        return None

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


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, when it comes

    return replay

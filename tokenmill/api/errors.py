"""The one place where failures become HTTP: OpenAI error objects, their status codes and headers."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import (
    EngineError,
    EngineUnavailableError,
    ModelUnavailableError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestError,
    ServerBusyError,
    TokenmillError,
)

log = logging.getLogger(__name__)

# Domain error -> (HTTP status, OpenAI error type, headers); the most specific class first.
_HTTP: list[tuple[type[TokenmillError], int, str, dict[str, str] | None]] = [
    (NotFoundError, 404, "not_found_error", None),
    (PermissionDeniedError, 403, "permission_error", None),
    (RequestError, 400, "invalid_request_error", None),
    (ServerBusyError, 429, "rate_limit_error", {"Retry-After": "1"}),
    (RateLimitError, 429, "rate_limit_error", None),
    (EngineUnavailableError, 503, "service_unavailable", None),
    (EngineError, 500, "server_error", None),
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _http(exc: TokenmillError) -> tuple[int, str, dict[str, str] | None]:
    return next((status, type_, headers) for cls, status, type_, headers in _HTTP if isinstance(exc, cls))


def http_status(exc: TokenmillError) -> int:
    return _http(exc)[0]


def domain_error_response(exc: TokenmillError) -> JSONResponse:
    status, type_, headers = _http(exc)
    if isinstance(exc, ModelUnavailableError):
        return error_response(status, str(exc), type_, code="model_not_loaded",
                              headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RateLimitError):
        return rate_limit_response(exc)
    if isinstance(exc, RequestError):
        return error_response(status, exc.message, type_, exc.param, exc.code, headers)
    if isinstance(exc, ServerBusyError):
        return error_response(status, str(exc), type_, code="server_busy", headers=headers)
    return error_response(status, str(exc), type_, headers=headers)


def rate_limit_response(exc: RateLimitError) -> JSONResponse:
    """OpenAI's 429: the limit that ran out as the error's type, and when to retry (the SDK reads retry-after-ms)."""
    headers = {}
    if exc.retry_after != float("inf"):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after))),
                   "retry-after-ms": str(math.ceil(exc.retry_after * 1000))}
    return error_response(429, str(exc), exc.kind, code="rate_limit_exceeded", headers=headers)


def _not_json(error: dict[str, Any], body: str) -> str:
    """FastAPI's JSON decode error (the offset of the fault in its loc, the parser's message in its ctx, the body as
    text) as a message that says where, in lines and columns."""
    fault = json.JSONDecodeError(error["ctx"]["error"], body, error["loc"][-1])
    return f"the body is not valid JSON: {fault.msg} at line {fault.lineno} column {fault.colno}"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "bytes"}


def _union_tag(part: Any) -> bool:
    """Whether a part of a pydantic error's loc names the branch of a union that failed ('str', 'list[...]',
    "literal['none','auto']", a model's class name) rather than a field or an index of the request."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or re.fullmatch(r"[A-Z][A-Za-z0-9]*", part)
                                      is not None)


def validation_fault(errors: Sequence[Any]) -> tuple[str | None, str]:
    """The field a pydantic validation's errors fault (dotted, without "body" and union tags) and pydantic's message
    for it, of the first field at fault; where every branch of a union failed on it, the branch that got furthest
    into the value says why (["hi"] for a list of objects: its item 0, not "a valid string")."""
    def path(error: Any) -> list[str]:
        loc = error.get("loc", ())
        loc = loc[1:] if loc[:1] == ("query",) else loc  # a query parameter is named as it is (limit)
        return [str(p) for p in loc if p != "body" and not _union_tag(p)]

    if not errors:
        return None, "invalid request"
    field = path(errors[0])[:1]
    deepest = max((e for e in errors if path(e)[:1] == field), key=lambda e: len(path(e)))
    return ".".join(path(deepest)) or None, deepest.get("msg", "invalid request")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    @app.exception_handler(ServerBusyError)
    @app.exception_handler(RateLimitError)
    @app.exception_handler(EngineUnavailableError)
    @app.exception_handler(EngineError)
    async def _domain(_: Request, exc: TokenmillError) -> JSONResponse:
        return domain_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc holds the offset of the fault, not a field
            return error_response(400, _not_json(first, exc.body), "invalid_request_error")
        param, message = validation_fault(exc.errors())
        return error_response(400, f"{param}: {message}" if param else message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal server error", "server_error")

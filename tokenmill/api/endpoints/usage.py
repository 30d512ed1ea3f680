"""/v1/usage: tokens and requests by tenant and model over a time window, in buckets (the shape of OpenAI's
organization usage API). An admin's key reads every tenant's (or one's, ?tenant=); a user's key its own."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from tokenmill.api.serving import hosting_of, tenant_of
from tokenmill.errors import PermissionDeniedError, RequestError
from tokenmill.tenants.usage import BUCKET_WIDTHS

router = APIRouter()
MAX_BUCKETS = 1440


@router.get("/v1/usage")
async def usage(request: Request, start_time: int | None = None, end_time: int | None = None,
                bucket_width: str = "1d", tenant: str | None = None) -> dict[str, Any]:
    width = BUCKET_WIDTHS.get(bucket_width)
    if width is None:
        raise RequestError(f"bucket_width {bucket_width!r}: 1m, 1h or 1d", param="bucket_width")
    now = int(time.time())
    end = end_time if end_time is not None else now + 1
    start = start_time if start_time is not None else end - width
    if not 0 <= start < end:
        raise RequestError("start_time must be before end_time, both Unix seconds", param="start_time")
    if -(-(end - start) // width) > MAX_BUCKETS:
        raise RequestError(f"the window holds more than {MAX_BUCKETS} buckets of {bucket_width}: narrow it or "
                           "widen the buckets", param="bucket_width")
    caller = tenant_of(request)
    if caller is not None and not caller.admin:
        if tenant not in (None, caller.name):
            raise PermissionDeniedError("a user's key reads its own usage only", param="tenant")
        tenant = caller.name
    buckets = hosting_of(request).tenancy.ledger.buckets(start, end, width, tenant)
    return {"object": "page", "has_more": False, "next_page": None, "data": [
        {"object": "bucket", "start_time": at, "end_time": min(at + width, end), "results": [
            {"object": "usage.result", "tenant": name, "model": model, "input_tokens": u.prompt_tokens,
             "output_tokens": u.completion_tokens, "input_cached_tokens": u.cached_tokens,
             "num_model_requests": u.requests} for name, model, u in rows]}
        for at, rows in buckets]}

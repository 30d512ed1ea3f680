"""The server's own routes: /health, /metrics (Prometheus), /stats (the dashboard's data), and /version and
/server_info, which gateways (smg) read to learn what a replica serves."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.api.errors import error_response
from tokenmill.api.serving import serving_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    serving = serving_of(request)
    if not serving.engine.alive:
        return error_response(503, "the engine is not running", "service_unavailable")
    if serving.state.draining:
        return error_response(503, "the server is shutting down", "service_unavailable")
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(serving_of(request).engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    """The dashboard's data, one JSON snapshot of the engine and its counters (docs/features/ui.md); the same
    counters as /metrics."""
    serving = serving_of(request)
    engine = serving.engine
    return JSONResponse({"object": "tokenmill.stats", "time": time.time(), "model": serving.model_id,
                         "uptime_s": round(time.time() - serving.created, 1), "max_model_len": engine.max_model_len,
                         "max_num_seqs": engine.config.max_num_seqs, **engine.snapshot()})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/server_info")
async def server_info(request: Request) -> JSONResponse:
    """What this replica serves, under the names SGLang's /server_info gives them (smg reads it when it adds a
    worker)."""
    serving = serving_of(request)
    engine = serving.engine
    return JSONResponse({
        "model_path": str(engine.model_path), "served_model_name": serving.model_id,
        "tokenizer_path": str(engine.model_path), "tp_size": engine.config.tensor_parallel_size, "dp_size": 1,
        "context_length": engine.max_model_len, "max_running_requests": engine.config.max_num_seqs,
        "max_total_num_tokens": engine.kv_cache.capacity_tokens, "is_generation": True, "version": __version__})

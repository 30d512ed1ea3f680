"""The server's own routes: /health, /metrics (Prometheus), /stats (the dashboard's data), and /version and
/server_info, which gateways (smg) read to learn what a replica serves."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.api.errors import error_response
from tokenmill.api.serving import hosting_of
from tokenmill.hosting.metrics import render_metrics
from tokenmill.hosting.pool import HostedModel, ModelPool

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    hosting = hosting_of(request)
    if dead := hosting.pool.dead():
        return error_response(503, f"the engine of {', '.join(dead)} is not running", "service_unavailable")
    if hosting.state.draining:
        return error_response(503, "the server is shutting down", "service_unavailable")
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    hosting = hosting_of(request)
    return Response(render_metrics(hosting.pool, hosting.tenancy.ledger), media_type=CONTENT_TYPE_LATEST)


def _shown(pool: ModelPool, name: str | None) -> HostedModel:
    """The model /stats and /server_info describe: the one named, else the first loaded, else the first."""
    if name is not None:
        return pool.find(name)
    return next(iter(pool.loaded()), pool.first)


@router.get("/stats")
async def stats(request: Request, model: str | None = None) -> JSONResponse:
    """The dashboard's data, one JSON snapshot of a model's engine (?model=, by default the first loaded) and its
    counters (docs/features/ui.md), the same counters as /metrics; and every hosted model's state."""
    hosting = hosting_of(request)
    hosted = _shown(hosting.pool, model)
    engine = hosted.engine
    body: dict[str, object] = {
        "object": "tokenmill.stats", "time": time.time(), "model": hosted.name,
        "uptime_s": round(time.time() - hosting.created, 1),
        "models": [{"id": h.name, **h.describe()} for h in hosting.pool.models],
        "memory": {"budget_bytes": hosting.pool.max_memory, "used_bytes": hosting.pool.used_bytes()}}
    if engine is not None:
        body.update({"max_model_len": engine.max_model_len, "max_num_seqs": engine.config.max_num_seqs,
                     **engine.snapshot()})
    return JSONResponse(body)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/server_info")
async def server_info(request: Request) -> JSONResponse:
    """What this replica serves, under the names SGLang's /server_info gives them (smg reads it when it adds a
    worker): its first loaded model."""
    hosted = _shown(hosting_of(request).pool, None)
    engine, settings = hosted.engine, hosted.spec.engine
    info: dict[str, object] = {
        "model_path": settings.model, "served_model_name": hosted.name, "tokenizer_path": settings.model,
        "tp_size": settings.tensor_parallel_size, "dp_size": 1, "max_running_requests": settings.max_num_seqs,
        "kv_cache_dtype": settings.kv_cache_dtype, "is_generation": True, "version": __version__}
    if engine is not None:
        info.update({"model_path": str(engine.model_path), "tokenizer_path": str(engine.model_path),
                     "context_length": engine.max_model_len,
                     "max_total_num_tokens": engine.kv_cache.capacity_tokens})
    return JSONResponse(info)

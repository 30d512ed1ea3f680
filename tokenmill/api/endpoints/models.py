"""/v1/models: every model the server hosts, by its id or an alias, and whether it is loaded now; each LoRA adapter
as a model of its own whose parent is its base (as vLLM lists them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.api.serving import Hosting, hosting_of
from tokenmill.hosting.pool import HostedModel

router = APIRouter()


def _model_card(hosting: Hosting, hosted: HostedModel, adapter: str | None = None) -> dict[str, Any]:
    engine, settings = hosted.engine, hosted.spec.engine
    return {"id": adapter or hosted.name, "object": "model", "created": hosting.created, "owned_by": "tokenmill",
            "root": hosted.adapters[adapter] if adapter else settings.model, "parent": hosted.name if adapter else None,
            "max_model_len": engine.max_model_len if engine is not None else settings.max_model_len,
            "deterministic": settings.deterministic, "status": hosted.describe()}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    hosting = hosting_of(request)
    return {"object": "list", "data": [card for hosted in hosting.pool.models
                                       for card in (_model_card(hosting, hosted),
                                                    *(_model_card(hosting, hosted, a) for a in hosted.adapters))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model by its id or an alias (ids may hold slashes, like Hugging Face names)."""
    hosting = hosting_of(request)
    return _model_card(hosting, hosting.pool.find(model_id), hosting.pool.adapter_of(model_id))

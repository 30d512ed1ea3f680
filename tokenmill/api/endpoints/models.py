"""/v1/models: every model the server hosts, by its id or an alias, and whether it is loaded now."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.api.serving import Hosting, hosting_of
from tokenmill.hosting.pool import HostedModel

router = APIRouter()


def _model_card(hosting: Hosting, hosted: HostedModel) -> dict[str, Any]:
    engine, settings = hosted.engine, hosted.spec.engine
    return {"id": hosted.name, "object": "model", "created": hosting.created, "owned_by": "tokenmill",
            "root": settings.model, "parent": None,
            "max_model_len": engine.max_model_len if engine is not None else settings.max_model_len,
            "deterministic": settings.deterministic, "status": hosted.describe()}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    hosting = hosting_of(request)
    return {"object": "list", "data": [_model_card(hosting, hosted) for hosted in hosting.pool.models]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model by its id or an alias (ids may hold slashes, like Hugging Face names)."""
    hosting = hosting_of(request)
    return _model_card(hosting, hosting.pool.find(model_id))

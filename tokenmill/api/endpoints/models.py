"""/v1/models: every model the server hosts, by its id or an alias, and whether it is loaded now; each LoRA adapter
as a model of its own whose parent is its base (as vLLM lists them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.api.serving import Hosting, hosting_of, may_use, tenant_of
from tokenmill.errors import PermissionDeniedError
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
    """The models the key may use (every one where the server has no keys)."""
    hosting, tenant = hosting_of(request), tenant_of(request)
    cards = [card for hosted in hosting.pool.models
             for card in (_model_card(hosting, hosted), *(_model_card(hosting, hosted, a) for a in hosted.adapters))]
    return {"object": "list", "data": [card for card in cards if tenant is None or tenant.may_use(card["id"])]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model by its id or an alias (ids may hold slashes, like Hugging Face names)."""
    hosting, tenant = hosting_of(request), tenant_of(request)
    card = _model_card(hosting, hosting.pool.find(model_id), hosting.pool.adapter_of(model_id))
    if tenant is not None and not may_use(hosting, tenant, model_id):
        raise PermissionDeniedError(f"this key may not use the model {model_id!r}", param="model",
                                    code="model_not_allowed")
    return card

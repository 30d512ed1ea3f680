"""/v1/models: the model served, by its id or an alias."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.api.serving import Serving, check_model, serving_of

router = APIRouter()


def _model_card(serving: Serving) -> dict[str, Any]:
    return {"id": serving.model_id, "object": "model", "created": serving.created, "owned_by": "tokenmill",
            "max_model_len": serving.engine.max_model_len, "deterministic": serving.engine.config.deterministic}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(serving_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model by its id or an alias (ids may hold slashes, like Hugging Face names)."""
    serving = serving_of(request)
    check_model(serving, model_id)
    return _model_card(serving)

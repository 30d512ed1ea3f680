"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from tokenmill.api.protocol import RequestModel
from tokenmill.api.serving import hosting_of
from tokenmill.errors import ModelFormatError, RequestError

router = APIRouter()


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = Field(default=None, description="tokenmill's: the model the adapter is for "
                                                                  "(default: the first that serves adapters)")


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(default=None, description="vLLM's; names are what identify adapters here")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    try:
        await hosting_of(request).pool.load_adapter(body.lora_name, body.lora_path, body.base_model_name)
    except ModelFormatError as exc:  # a folder that is no adapter of the model: the client's to fix
        raise RequestError(str(exc), param="lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    await hosting_of(request).pool.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

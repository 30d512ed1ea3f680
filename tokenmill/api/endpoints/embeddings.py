"""/v1/embeddings: each input's prompt prefilled like any other, its final hidden states pooled (--pooling) and
L2-normalized."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.api.protocol import EmbeddingRequest
from tokenmill.api.serving import Serving, collect_unless_disconnected, serving_for
from tokenmill.errors import RequestError
from tokenmill.sampling import SamplingParams

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    """Each input's prompt runs through the engine like any prefill, batched with what else runs; its final hidden
    states, pooled (--pooling) and L2-normalized, are the embedding."""
    async with serving_for(request, body) as serving:
        return await _embed(serving, body, request)


async def _embed(serving: Serving, body: EmbeddingRequest, request: Request) -> Any:
    engine = serving.engine
    inputs = body.inputs()
    if len(inputs) > serving.config.max_embedding_inputs:
        raise RequestError(f"at most {serving.config.max_embedding_inputs} inputs are allowed", param="input")
    size = engine.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise RequestError(f"dimensions: this model's embeddings have {size}", param="dimensions")
    prompts = await asyncio.to_thread(lambda: [engine.tokenizer.encode(x) if isinstance(x, str) else x
                                               for x in inputs])
    streams = serving.client.submit(prompts, SamplingParams(max_tokens=0), prompt_param="input", embed=True)
    results = await collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    prompt_tokens = sum(len(p) for p in prompts)
    return embeddings_body(serving.model_id, [outs[-1].embedding or [] for outs in results], prompt_tokens,
                                body.encoding_format)


def embeddings_body(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> dict[str, Any]:
    """base64: each vector's little-endian float32 bytes, as OpenAI sends them."""
    def encoded(vector: list[float]) -> list[float] | str:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if encoding == "base64" else vector

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

"""The Responses API's routes: create (run as a chat request, stored where asked), get, list input items,
delete (api/responses_api.py translates; api/response_store.py stores)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from tokenmill.api.endpoints.chat import submit_chat
from tokenmill.api.engine_client import merge
from tokenmill.api.response_store import ResponseStore
from tokenmill.api.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    listed_items,
    refuse_include,
    response_events,
    response_object,
)
from tokenmill.api.serving import (
    Hosting,
    Serving,
    collect_unless_disconnected,
    hosting_of,
    serving_for,
    sse_response,
    tenant_name,
)
from tokenmill.errors import NotFoundError, RequestError

router = APIRouter()


# A Responses request runs as a chat request: errors name the Responses field the chat field came from (and
# tools.N.function.X as tools.N.X).
_RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens":
                     "max_output_tokens", "response_format": "text.format"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    async with serving_for(request, body) as serving:
        return await _respond(serving, body, request)


async def _respond(serving: Serving, body: ResponsesRequest, request: Request) -> Any:
    store = serving.responses
    if store is None and body.previous_response_id is not None:
        raise RequestError("this server stores no responses (--responses-store off)", param="previous_response_id")
    history = [] if body.previous_response_id is None or store is None else await asyncio.to_thread(
        store.conversation, body.previous_response_id, serving.tenant)
    items = body.input_items()
    try:
        streams, prompt_tokens, tool_parser = await submit_chat(serving, body.chat_request(history + items))
    except RequestError as exc:  # named as the Responses API names the field, in the param and the message
        old = exc.param or ""
        new = _RESPONSES_PARAMS.get(old, old.replace(".function.", ".", 1) if old.startswith("tools.") else old)
        if old and new != old:
            exc.param = new
            exc.message = new + exc.message[len(old):] if exc.message.startswith(old) else exc.message
        raise
    builder = ResponseBuilder(body, serving.model_id, prompt_tokens)

    async def save(response: dict[str, Any]) -> None:
        """Keep a finished response where asked. One not kept (failed or cancelled, or one the store could not write:
        a full disk) is answered with store false: never an id that GET will not find."""
        if store is None or not body.store:
            return
        kept = response["status"] in ("completed", "incomplete")
        response["store"] = kept and await asyncio.to_thread(store.put, response, listed_items(items, response["id"]),
                                                              serving.tenant)

    if body.stream:
        async def events() -> AsyncIterator[dict[str, Any]]:
            async for event in response_events(builder, merge(streams), tool_parser):
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    await save(event["response"])
                yield event
        return sse_response(events(), streams, done=False)
    results = await collect_unless_disconnected(request, streams)
    if results is None:
        return Response(status_code=499)
    response = response_object(builder, results[0], tool_parser)
    await save(response)
    return response


def _stored(hosting: Hosting, response_id: str) -> ResponseStore:
    if hosting.responses is None:
        raise NotFoundError(f"Response with id '{response_id}' not found (this server stores no responses).",
                            param="response_id")
    return hosting.responses


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    found = await asyncio.to_thread(_stored(hosting_of(request), response_id).get, response_id,
                                    tenant_name(request))
    if found is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return found


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
                           include: Annotated[list[str] | None, Query()] = None,
                           include_: Annotated[list[str] | None, Query(alias="include[]")] = None) -> dict[str, Any]:
    """The items the response's model read (the conversation it continues, then its own input), a page of them as
    OpenAI pages lists: `limit` items after the one named `after`, newest first unless `order` is asc. (The openai
    SDK sends a list as include[]=....)"""
    refuse_include(include or include_)
    turns = await asyncio.to_thread(_stored(hosting_of(request), response_id).input_items, response_id,
                                    tenant_name(request))
    if turns is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    # rows stored before input items were kept listed get their ids here, the same ones each time
    items = [item for turn_id, turn in turns for item in listed_items(turn, turn_id)]
    if order == "desc":
        items.reverse()
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), None)
        if start is None:
            raise RequestError(f"after: no input item of response '{response_id}' has the id '{after}'",
                               param="after")
        items = items[start:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not await asyncio.to_thread(_stored(hosting_of(request), response_id).delete, response_id,
                                   tenant_name(request)):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}

"""OpenAI's Responses API: its request, its translation into a chat request (so it runs the chat path: template,
tools, structured output, the same engine submit), and the Response object and stream events made from the
engine's outputs."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from tokenmill.api.errors import validation_fault
from tokenmill.api.protocol import ChatCompletionRequest, KeepAlive, RequestModel, keep_alive_field, no_effect, refused
from tokenmill.api.tools.parsers import ToolCall, ToolCallDelta, ToolParser, parse_tool_calls
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import RequestError


class ResponseFunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a forced call always follows the schema


class ResponseToolChoiceFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = refused(why="answer length is not steerable beyond max_output_tokens")


class ResponseStreamOptions(RequestModel):
    include_obfuscation: bool | None = no_effect(why="stream events are not padded: nothing to obfuscate")


class ResponsesRequest(RequestModel):
    model: str
    keep_alive: KeepAlive = keep_alive_field()
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: ResponseStreamOptions | None = no_effect(why="its one option, include_obfuscation, has none")
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None  # kept on the response object
    truncation: Literal["disabled"] | None = None  # an input longer than the context is a 400
    include: list[str] | None = None  # nothing extra to include: only an empty list
    user: str | None = no_effect(why="an end-user id for OpenAI's abuse monitoring; nothing is logged per user")
    safety_identifier: str | None = no_effect(why="as user")
    service_tier: str | None = no_effect(why="one tier: every request is served alike")
    prompt_cache_key: str | None = no_effect(why="prefix caching is automatic, keyed by the prompt's tokens")
    prompt_cache_retention: str | None = no_effect(why="the prefix cache keeps prompts until memory is needed")
    prompt_cache_options: dict[str, Any] | None = no_effect(why="as prompt_cache_key")
    reasoning: dict[str, Any] | None = refused(why="the served model's reasoning is not configurable")
    top_logprobs: int | None = refused(why="logprobs are served by /v1/chat/completions")
    background: bool | None = refused(why="responses run while the request waits; there is no background mode")
    background_options: dict[str, Any] | None = refused(why="as background")
    conversation: str | dict[str, Any] | None = refused(why="no Conversations API: use previous_response_id")
    context_management: list[dict[str, Any]] | None = refused(why="the context is not compacted")
    max_tool_calls: int | None = refused(why="built-in tools are not implemented")
    prompt: dict[str, Any] | None = refused(why="no stored prompt templates")
    image: dict[str, Any] | None = refused(why="text only")
    moderation: dict[str, Any] | None = refused(why="this server has no moderation")
    access_programs: dict[str, Any] | None = refused(why="not applicable to a self-hosted server")
    cyber: str | None = refused(why="not applicable to a self-hosted server")

    @field_validator("text", mode="wrap")
    @classmethod
    def _text_params(cls, text: Any, handler: ValidatorFunctionWrapHandler) -> TextConfig | None:
        """A fault inside text (a refused text.verbosity) named by its path from the body, not its own name."""
        try:
            return handler(text)
        except RequestError as exc:
            if exc.param is None or exc.param.startswith("text."):
                raise
            raise RequestError(f"text.{exc.message}", param=f"text.{exc.param}", code=exc.code) from exc

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, include: list[str] | None) -> list[str] | None:
        return refuse_include(include)

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def chat_request(self, items: list[dict[str, Any]]) -> ChatCompletionRequest:
        """This request, over the whole conversation's items, as the chat request that runs it."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            _messages(items)
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens,
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                             "function": {"name": choice.name}}
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None:
                raise RequestError("text.format: a json_schema format needs a name", param="text.format.name")
            if fmt.schema_ is None:  # OpenAI's Responses API requires it (chat's response_format does not)
                raise RequestError("text.format: a json_schema format needs a schema", param="text.format.schema")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:  # the chat field at fault (the caller names it as this API does), or input
            at, message = validation_fault(exc.errors())
            param = "input" if not at or at.startswith("messages") else at
            raise RequestError(f"{param}: {message}", param=param) from exc


# --- input items -> chat messages --------------------------------------------------------------------------------

_TEXT_PARTS = {"input_text", "output_text", "text"}


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{at}: content must be a string or a list of text parts", param=at)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{at}[{i}]: content parts of type {kind!r} are not supported; send text",
                               param=f"{at}[{i}]")
        parts.append(part["text"])
    return "".join(parts)


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a function_call joins the assistant turn before it (or starts one),
    a function_call_output is a tool message."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()  # the call_ids of the function_calls so far, which an output answers
    ids: set[str] = set()  # the items' ids so far: listed twice, an id would name two places
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at}: an input item must be an object", param=at)
        if item_id := item.get("id"):  # a client that sends back the previous answer with its id, as OpenAI refuses
            if item_id in ids:
                raise RequestError(f"Duplicate item found with id {item_id}.", param="input")
            ids.add(item_id)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{at}.role: must be user, assistant, system or developer", param=f"{at}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call_id = _required(item, "call_id", at)
            calls.add(call_id)
            call = {"id": call_id, "type": "function",
                    "function": {"name": _required(item, "name", at), "arguments": _required(item, "arguments", at)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _required(item, "call_id", at)
            if call_id not in calls:  # as OpenAI: an output must answer a call of the conversation
                raise RequestError(f"{at}.call_id: no function call found for function call output with call_id "
                                   f"{call_id!r}", param=f"{at}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output"), f"{at}.output")})
        else:
            raise RequestError(f"{at}: input items of type {kind!r} are not supported (message, function_call and "
                               f"function_call_output are)", param=f"{at}.type")
    return messages


def refuse_include(include: list[str] | None) -> list[str] | None:
    """`include` (of a Response, or of listed input items) names extra data to add: none can be."""
    if include:
        raise RequestError(f"include: {include[0]!r} is not supported (nothing extra can be included)",
                           param="include")
    return include


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def listed_items(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """The items a response read (valid ones: _messages read them) as OpenAI lists them back and the store keeps
    them: each with an id (one the client gave, else one from the response's id and the item's place, so the same
    item gets the same id whenever it is listed) and a status, a message's text in parts of OpenAI's types
    (input_text; output_text for the assistant's)."""
    listed = []
    for i, given in enumerate(items):
        item = {**given, "type": given.get("type", "message")}
        if item["type"] == "message":
            content = item.get("content")
            texts = [content] if isinstance(content, str) else [part["text"] for part in content or []]
            item["content"] = [_text_part(text) if item["role"] == "assistant" else {"type": "input_text", "text": text}
                               for text in texts]
        if not item.get("id"):
            digest = hashlib.sha256(f"{response_id}/{i}".encode()).hexdigest()[:32]
            item["id"] = f"{_ITEM_ID_PREFIX[item['type']]}_{digest}"
        item["status"] = item.get("status") or "completed"
        listed.append(item)
    return listed


def _required(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{at}.{key}: a string is required", param=f"{at}.{key}")
    return value


# --- engine outputs -> the Response object and its events -----------------------------------------------------


def _message_item(parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": parts}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name, "arguments": call.arguments, "status": status}


class ResponseBuilder:
    """The Response object of one request, as it stands; `finish` completes it from the sequence's end."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int) -> None:
        self.response: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"})},
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "tools": [{**t.model_dump(exclude_none=True), "strict": t.strict is not False} for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": "disabled",
            "metadata": body.metadata or {},
        }
        if body.user is not None:
            self.response["user"] = body.user
        self.prompt_tokens = prompt_tokens

    def finish(self, out: SequenceOutput) -> dict[str, Any]:
        r = self.response
        if out.finish_reason == "error":
            r["status"] = "failed"
            r["error"] = {"code": "server_error", "message": out.error or "internal error while running the model"}
        elif out.finish_reason == "length":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        elif out.finish_reason == "abort":
            r["status"] = "cancelled"
        else:
            r["status"] = "completed"
        r["usage"] = {"input_tokens": self.prompt_tokens,
                      # every prompt token computed here is offered to the prefix cache
                      "input_tokens_details": {"cached_tokens": out.cached_tokens,
                                               "cache_write_tokens": self.prompt_tokens - out.cached_tokens},
                      "output_tokens": out.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.prompt_tokens + out.completion_tokens}
        return r


def _last_item_status(out: SequenceOutput, parser: ToolParser | None = None) -> str:
    """The status of the output item the answer ended in: incomplete where it did not end on its own (cut by
    max_output_tokens, or by an abort or an error) or ended inside a call (a stop string cut it)."""
    whole = parser is None or not parser.calls or parser.calls[-1].complete
    return "completed" if out.finish_reason == "stop" and whole else "incomplete"


def response_object(builder: ResponseBuilder, outs: list[SequenceOutput],
                    tool_parser: type[ToolParser] | None) -> dict[str, Any]:
    """The whole Response of a request that was not streamed."""
    text = "".join(o.text for o in outs)
    content, calls = parse_tool_calls(tool_parser, text, outs[-1].finish_reason) if tool_parser else (text, [])
    calls = calls if builder.response["parallel_tool_calls"] else calls[:1]
    content = content or ""
    output = [_message_item([_text_part(content)], "completed")] if content or not calls else []
    output += [_call_item(call, "completed") for call in calls]
    output[-1]["status"] = _last_item_status(outs[-1])  # the item the answer ended in, as a stream closes it
    builder.response["output"] = output
    return builder.finish(outs[-1])


class _Events:
    """The event sequence of one streamed Response. One output item is open at a time: the next one is added only
    after the one before is done, as OpenAI orders them."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.sequence_number = 0
        self.item: dict[str, Any] | None = None  # the open item (a message or a function call), while it grows
        self.message_text = ""  # the open message's text (close starts the next one's)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, x in enumerate(self.response["output"]) if x is item)

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")  # a new item: the one before it is done
        self.item = item
        self.response["output"].append(item)
        return events + [self.event("response.output_item.added", output_index=self._index(item), item=dict(item))]

    def text(self, text: str) -> list[dict[str, Any]]:
        message, events = self.item, []
        if message is None or message["type"] != "message":
            message = _message_item([], "in_progress")
            events = self._add(message)
            events.append(self.event("response.content_part.added", item_id=message["id"],
                                     output_index=self._index(message), content_index=0, part=_text_part("")))
        self.message_text += text
        return events + [self.event("response.output_text.delta", item_id=message["id"],
                                    output_index=self._index(message), content_index=0, delta=text, logprobs=[])]

    def call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        """The start of a new call (a delta with its name), or more of the open call's arguments."""
        events = self._add(_call_item(ToolCall(delta.name, ""), "in_progress")) if delta.name is not None else []
        item = self.item
        if delta.arguments:
            assert item is not None  # a call's first delta names it, and opens its item
            item["arguments"] += delta.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self._index(item), delta=delta.arguments))
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The done events of the open item, if any, which ends with this status."""
        item, self.item = self.item, None
        if item is None:
            return []
        index = self._index(item)
        item["status"] = status
        if item["type"] == "message":
            text, self.message_text = self.message_text, ""
            item["content"] = [_text_part(text)]
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=_text_part(text))]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=index, item=dict(item))]


async def response_events(builder: ResponseBuilder, outputs: AsyncIterator[tuple[int, SequenceOutput]],
                          tool_parser: type[ToolParser] | None) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's Responses stream: created, in_progress, for each output item its added / delta / done events, then
    completed (or incomplete, failed). Every event carries its sequence_number."""
    r = builder.response
    events = _Events(r)
    yield events.event("response.created", response=dict(r))
    yield events.event("response.in_progress", response=dict(r))
    parser = tool_parser() if tool_parser else None
    last: SequenceOutput | None = None
    async for _, out in outputs:
        last = out
        if out.finish_reason == "error":
            break
        pieces: list[tuple[str, list[ToolCallDelta]]] = [(out.text, [])]
        if parser is not None:
            parsed = [parser.feed(out.text)] + ([parser.finish()] if out.finish_reason is not None else [])
            pieces = [(p.content, [d for d in p.calls if r["parallel_tool_calls"] or d.index == 0]) for p in parsed]
        for content, deltas in pieces:
            # A piece's text and calls come apart; no text is inside a call, so its text goes after the deltas that
            # go on with the open call and before the calls the piece starts.
            going_on = next((i for i, d in enumerate(deltas) if d.name is not None), len(deltas))
            in_order = [e for d in deltas[:going_on] for e in events.call(d)] + \
                (events.text(content) if content else []) + [e for d in deltas[going_on:] for e in events.call(d)]
            for e in in_order:
                yield e
    if last is None:
        return
    if not r["output"] and last.finish_reason != "error":  # an empty answer is still a message
        for e in events.text(""):
            yield e
    for e in events.close(_last_item_status(last, parser)):
        yield e
    builder.finish(last)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(r["status"], "response.failed")
    yield events.event(kind, response=r)

"""The Responses API's translation, without a model: input items into the chat messages the model is prompted with
(a function_call is the assistant's turn, never the user's), and the engine's outputs into the Response and its
events; streamed, a Response ends as the same Response not streamed does (its status, why it is incomplete, its
items and their calls), however its outputs come in pieces."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers import CHATML

from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.responses_api import ResponseBuilder, ResponsesRequest, response_events, response_object
from tokenmill.api.tools.parsers import PARSERS
from tokenmill.api.tools.request import template_inputs
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import RequestError
from tokenmill.loader.chat_template import ChatTemplate

WEATHER_CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
TIME_CALL = {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": '{"timezone": "CET"}'}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def output(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call["call_id"], "output": text}


def chat_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call["call_id"], "type": "function", "function": {"name": call["name"],
                                                                    "arguments": call["arguments"]}}


def messages(items: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The chat messages a Responses request of these input items runs as, as given (what a chat client would send
    for the same conversation)."""
    chat = ResponsesRequest(model="m", input="x", **fields).chat_request(items)
    return [m.model_dump(exclude_unset=True) for m in chat.messages]


@pytest.mark.parametrize(("items", "expected"), [
    pytest.param([user("Weather in Paris?"), WEATHER_CALL, output(WEATHER_CALL, "sunny")], [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call(WEATHER_CALL)]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], id="after-the-user"),
    # two calls in a row are one assistant turn; after the assistant's text, they join its turn
    pytest.param([user("Weather and time?"), {"role": "assistant", "content": "Checking."}, WEATHER_CALL, TIME_CALL,
                  output(WEATHER_CALL, "sunny"), output(TIME_CALL, "noon")], [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [chat_call(WEATHER_CALL), chat_call(TIME_CALL)]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"}], id="after-the-assistant"),
    # at the start, after a tool's output, after a developer message: a turn of its own
    pytest.param([WEATHER_CALL, output(WEATHER_CALL, "sunny"), TIME_CALL, {"role": "developer", "content": "Brief."},
                  {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"}], [
        {"role": "assistant", "content": None, "tool_calls": [chat_call(WEATHER_CALL)]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call(TIME_CALL)]},
        {"role": "developer", "content": "Brief."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_3", "type": "function",
                                              "function": {"name": "get_time", "arguments": "{}"}}]}], id="own-turns"),
])
def test_a_function_call_item_is_the_assistant_s_turn_never_the_user_s(items: list[dict[str, Any]],
                                                                        expected: list[dict[str, Any]]) -> None:
    """A call attached to the user message before it would have the model read the user as having called it."""
    assert messages(items) == expected


def test_a_responses_tool_loop_is_prompted_as_the_same_chat_conversation() -> None:
    """What the model reads: the same prompt as a chat client's messages give, the call as the assistant's own text
    (a template that cannot show calls gets them in the model family's format) right after the user's question."""
    template, hermes = ChatTemplate(CHATML, None, None), PARSERS["hermes"]
    chat = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call(WEATHER_CALL)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    items = [user("Weather in Paris?"), WEATHER_CALL, output(WEATHER_CALL, "sunny")]

    def prompt(body: ChatCompletionRequest) -> str:
        return template.render(template_inputs(body, template, hermes)[0], add_generation_prompt=True, timeout=2.0,
                               max_chars=100_000)

    prompted = prompt(ResponsesRequest(model="m", input=items).chat_request(items))
    assert prompted == prompt(chat)
    assert prompted.startswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>")


# --- the engine's outputs -> the Response, streamed or not ----------------------------------------------------------

CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')
CUT = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'  # the token limit cut the call
CUT_SECOND = CALLS[:-30]  # a whole call, then one the token limit cut


def sent(event: dict[str, Any]) -> dict[str, Any]:
    """An event as the client gets it: written out as it is yielded (later events change the objects it holds)."""
    return json.loads(json.dumps(event))


def run(answer: str, finish: str, size: int, **fields: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The events of a Responses stream whose answer comes `size` characters an output and ends so, and the same
    Response not streamed."""
    pieces = [answer[i:i + size] for i in range(0, len(answer), size)] or [""]
    outs = [SequenceOutput(0, piece, [], [], finish if i == len(pieces) - 1 else None, 5, i + 1)
            for i, piece in enumerate(pieces)]
    request = ResponsesRequest(model="m", input="x", tools=[{"type": "function", "name": "get_weather"},
                                                           {"type": "function", "name": "get_time"}], **fields)
    hermes = PARSERS["hermes"]

    async def merged() -> AsyncIterator[tuple[int, SequenceOutput]]:
        for out in outs:
            yield 0, out

    async def events() -> list[dict[str, Any]]:
        return [sent(e) async for e in response_events(ResponseBuilder(request, "m", 5), merged(), hermes)]
    return asyncio.run(events()), response_object(ResponseBuilder(request, "m", 5), outs, hermes)


def shape(response: dict[str, Any]) -> tuple[Any, ...]:
    """A Response as a client reads it, but for the ids its items are given."""
    items = [(i["type"], i["status"], i.get("name"), i.get("arguments"),
              [part["text"] for part in i.get("content", [])]) for i in response["output"]]
    return response["status"], response["incomplete_details"], response["parallel_tool_calls"], items, \
        response["usage"]


@pytest.mark.parametrize("size", [1, 7, 10_000])  # characters per output: a token's worth, a few, all at once
@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize(("answer", "finish"), [
    pytest.param("Paris is sunny.", "stop", id="text"), pytest.param("Paris is", "length", id="text-cut"),
    pytest.param(CALLS, "stop", id="calls"), pytest.param("Let me see. " + CALLS, "stop", id="text-calls"),
    pytest.param(CUT, "length", id="call-cut"), pytest.param(CUT_SECOND, "length", id="second-call-cut"),
    pytest.param(CALLS, "length", id="calls-then-limit"), pytest.param("", "stop", id="empty"),
    pytest.param("", "length", id="empty-cut"),
    # held back as the start of a tag until the end says it is text
    pytest.param("Use <tool", "length", id="tag-start-cut"), pytest.param("Use <tool", "stop", id="tag-start"),
    pytest.param("Paris is", "abort", id="text-aborted"), pytest.param(CUT, "abort", id="call-aborted"),
    pytest.param(CALLS, "abort", id="calls-aborted"),
])
def test_a_streamed_response_ends_as_the_same_response_not_streamed(answer: str, finish: str, size: int,
                                                                    parallel: bool | None) -> None:
    events, whole = run(answer, finish, size, parallel_tool_calls=parallel)
    final = events[-1]["response"]
    assert events[-1]["type"] == {"cancelled": "response.failed"}.get(whole["status"], f"response.{whole['status']}")
    assert shape(final) == shape(whole)
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    for done in (e for e in events if e["type"] == "response.function_call_arguments.done"):
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == done["item_id"]]
        assert "".join(deltas) == done["arguments"]


@pytest.mark.parametrize("size", [1, 7, 10_000])
@pytest.mark.parametrize("answer", [pytest.param(CUT, id="call-cut"), pytest.param(CUT_SECOND, id="second-call-cut")])
def test_a_streamed_call_cut_by_max_output_tokens_ends_the_response_incomplete(answer: str, size: int) -> None:
    """Not `completed`: the call the token limit cut is the last item, incomplete, and so is the Response, as when
    not streamed; its arguments are what was written."""
    events, _ = run(answer, "length", size)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["type"] == "function_call" and done[-1]["status"] == "incomplete"
    assert [i["status"] for i in done[:-1]] == ["completed"] * (len(done) - 1)
    assert done[-1]["arguments"] == answer.rsplit('"arguments": ', 1)[1]
    assert final["output"][-1] == done[-1]


@pytest.mark.parametrize("size", [1, 7, 10_000])
@pytest.mark.parametrize("answer", [pytest.param(CUT, id="call-cut"), pytest.param(CUT_SECOND, id="second-call-cut")])
def test_a_streamed_call_a_stop_string_cut_is_incomplete_in_a_completed_response(answer: str, size: int) -> None:
    """The answer ended on its own, inside a call its stream had begun: no client could run that call (not streamed,
    the answer is all text), so its item is incomplete."""
    events, whole = run(answer, "stop", size)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done][-1] == ("function_call", "incomplete")
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == done
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("message", "completed")]


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_parallel_tool_calls_false_streams_the_first_call_only(size: int) -> None:
    """Under tool_choice auto a model may write several calls whatever the request says: the stream, as the
    Response not streamed, gives the first alone, its arguments its own."""
    events, whole = run("Let me see. " + CALLS, "stop", size, parallel_tool_calls=False)
    calls = [e["item"] for e in events if e["type"] == "response.output_item.added"
             and e["item"]["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == '{"city": "Paris"}'
    assert [(e["name"], e["arguments"]) for e in events if e["type"] == "response.function_call_arguments.done"] \
        == [("get_weather", '{"city": "Paris"}')]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["parallel_tool_calls"] is False
    assert [(i["type"], i.get("name")) for i in final["output"]] == [("message", None), ("function_call",
                                                                                         "get_weather")]
    assert shape(final) == shape(whole)


# --- the request -> the chat request that runs it -------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}}


def chat_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The fields of the chat request that runs it, as given (a chat client's request, field for field)."""
    return request.chat_request(request.input_items()).model_dump(exclude_unset=True, by_alias=True)


def test_every_field_of_a_request_reaches_the_chat_request_that_runs_it() -> None:
    request = ResponsesRequest(
        model="m", input="Weather in Paris?", instructions="Be brief.", max_output_tokens=7, temperature=0.5,
        top_p=0.9, stream=True, tools=[WEATHER, {"type": "function", "name": "get_time"}],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "person", "description": "A person.", "schema": PERSON,
                         "strict": True}})
    assert chat_fields(request) == {
        "model": "m", "stream": True, "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 7,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}},
                  {"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "description": "A person.",
                                                                   "schema": PERSON, "strict": True}}}


@pytest.mark.parametrize(("fields", "chat"), [
    pytest.param({}, {}, id="defaults"),
    pytest.param({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True},
                 {"tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                  "tool_choice": "required", "parallel_tool_calls": True}, id="tool_choice-required"),
    pytest.param({"text": {"format": {"type": "json_object"}}}, {"response_format": {"type": "json_object"}},
                 id="json_object"),
    pytest.param({"text": {"format": {"type": "text"}}}, {"response_format": {"type": "text"}}, id="text"),
    pytest.param({"text": {}}, {}, id="no-format"),
])
def test_what_a_request_leaves_out_the_chat_request_leaves_to_its_defaults(fields: dict, chat: dict) -> None:
    assert chat_fields(ResponsesRequest(model="m", input="hi", **fields)) == {
        "model": "m", "stream": False, "temperature": None, "top_p": None, "max_completion_tokens": None,
        "messages": [{"role": "user", "content": "hi"}], **chat}


@pytest.mark.parametrize(("fields", "message", "param"), [
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format: a json_schema format needs a name",
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format: a json_schema format needs a schema",
     "text.format.schema"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools.0.function.parameters: Value error, a "
     "function's parameters must be a JSON schema of type object", "tools.0.function.parameters"),
    ({"include": ["reasoning.encrypted_content", "x"]},
     "include: 'reasoning.encrypted_content' is not supported (nothing extra can be included)", "include"),
])
def test_a_request_the_chat_request_cannot_run_is_refused_naming_the_field(fields: dict, message: str,
                                                                           param: str) -> None:
    """A chat field at fault keeps its chat name here: the route names it as the Responses API does."""
    with pytest.raises(RequestError) as refused:
        request = ResponsesRequest(model="m", **{"input": "hi", **fields})
        request.chat_request(request.input_items())
    assert (refused.value.message, refused.value.param) == (message, param)


def test_a_string_input_is_one_user_message_and_a_list_is_its_items() -> None:
    assert ResponsesRequest(model="m", input="hi").input_items() == [{"type": "message", "role": "user",
                                                                      "content": "hi"}]
    items = [user("a"), WEATHER_CALL]
    assert ResponsesRequest(model="m", input=items).input_items() == items
    assert ResponsesRequest(model="m", input="hi", include=[]).include == []


def test_input_messages_of_every_role_and_text_parts_are_chat_messages() -> None:
    items = [{"type": "message", "role": "system", "content": "S"}, {"role": "developer", "content": "D"},
             {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}],
              "id": "msg_1"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "c"}], "id": "msg_2"}]
    assert messages(items) == [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                               {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]


@pytest.mark.parametrize(("items", "message", "param"), [
    ([5], "input[0]: an input item must be an object", "input[0]"),
    ([user("a"), {"role": "tool", "content": "x"}], "input[1].role: must be user, assistant, system or developer",
     "input[1].role"),
    ([{"role": "user", "content": 5}], "input[0].content: content must be a string or a list of text parts",
     "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]}],
     "input[0].content[1]: content parts of type 'input_image' are not supported; send text", "input[0].content[1]"),
    ([{"role": "user", "content": ["a"]}], "input[0].content[0]: content parts of type None are not supported; "
     "send text", "input[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}], "input[0].content[0]: content parts of type "
     "'input_text' are not supported; send text", "input[0].content[0]"),
    ([user("a"), {**WEATHER_CALL, "call_id": None}], "input[1].call_id: a string is required", "input[1].call_id"),
    ([{**WEATHER_CALL, "name": 5}], "input[0].name: a string is required", "input[0].name"),
    ([{k: v for k, v in WEATHER_CALL.items() if k != "arguments"}], "input[0].arguments: a string is required",
     "input[0].arguments"),
    ([user("a"), output(WEATHER_CALL, "sunny")], "input[1].call_id: no function call found for function call output "
     "with call_id 'call_1'", "input[1].call_id"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id: a string is required", "input[0].call_id"),
    ([WEATHER_CALL, {**output(WEATHER_CALL, "x"), "output": 5}],
     "input[1].output: content must be a string or a list of text parts", "input[1].output"),
    ([{"type": "reasoning", "summary": []}], "input[0]: input items of type 'reasoning' are not supported (message, "
     "function_call and function_call_output are)", "input[0].type"),
    ([{**user("a"), "id": "msg_1"}, {**user("b"), "id": "msg_2"}, {**user("c"), "id": "msg_1"}],
     "Duplicate item found with id msg_1.", "input"),
])
def test_an_input_item_that_cannot_be_read_is_refused_naming_it(items: list, message: str, param: str) -> None:
    with pytest.raises(RequestError) as refused:
        messages(items)
    assert (refused.value.message, refused.value.param) == (message, param)


# --- the Response object ------------------------------------------------------------------------------------------

def fixed(response: dict[str, Any]) -> dict[str, Any]:
    """The Response but for its id and time, after checking their form."""
    assert response["id"].startswith("resp_") and len(response["id"]) == 37
    assert abs(response["created_at"] - time.time()) < 60
    return {k: v for k, v in response.items() if k not in ("id", "created_at")}


def test_a_response_object_says_what_its_request_asked_as_openai_s_does() -> None:
    request = ResponsesRequest(
        model="m", input="hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
        tools=[WEATHER, {"type": "function", "name": "get_time", "strict": False}],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False, store=False,
        previous_response_id="resp_0", metadata={"k": "v"}, user="u1",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert fixed(ResponseBuilder(request, "served", 3).response) == {
        "object": "response", "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": "Be brief.", "max_output_tokens": 7, "model": "served", "output": [],
        "parallel_tool_calls": False, "previous_response_id": "resp_0",
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [WEATHER, {"type": "function", "name": "get_time", "strict": False}], "top_p": 0.9,
        "truncation": "disabled", "metadata": {"k": "v"}, "user": "u1"}
    assert fixed(ResponseBuilder(ResponsesRequest(model="m", input="hi", tools=[{"type": "function", "name": "f"}],
                                                  tool_choice="required"), "served", 3).response) == {
        "object": "response", "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": None, "max_output_tokens": None, "model": "served", "output": [],
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "required",
        "tools": [{"type": "function", "name": "f", "strict": True}], "top_p": 1.0, "truncation": "disabled",
        "metadata": {}}
    assert ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", 3).response["tool_choice"] == "auto"
    zero = ResponseBuilder(ResponsesRequest(model="m", input="hi", temperature=0, text={}), "m", 3).response
    assert zero["temperature"] == 0 and zero["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize(("finish", "error", "status", "details", "failure"), [
    ("stop", None, "completed", None, None),
    ("length", None, "incomplete", {"reason": "max_output_tokens"}, None),
    ("abort", None, "cancelled", None, None),
    ("error", "CUDA out of memory", "failed", None, {"code": "server_error", "message": "CUDA out of memory"}),
    ("error", None, "failed", None, {"code": "server_error", "message": "internal error while running the model"}),
])
def test_a_response_ends_as_its_sequence_did_and_counts_its_tokens(finish: str, error: str | None, status: str,
                                                                   details: dict | None, failure: dict | None) -> None:
    out = SequenceOutput(0, "", [], [], finish, 10, 4, cached_tokens=6, error=error)
    r = ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", 10).finish(out)
    assert (r["status"], r["incomplete_details"], r["error"]) == (status, details, failure)
    assert r["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 4},
                          "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}


# --- the events, exactly --------------------------------------------------------------------------------------------

def stream(pieces: list[str], finish: str, tools: bool = False, error: str | None = None) -> list[dict[str, Any]]:
    outs = [SequenceOutput(0, piece, [], [], finish if i == len(pieces) - 1 else None, 5, i + 1,
                           error=error if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    request = ResponsesRequest(model="m", input="x", tools=[{"type": "function", "name": "get_weather"}] if tools
                               else None)

    async def merged() -> AsyncIterator[tuple[int, SequenceOutput]]:
        for out in outs:
            yield 0, out

    async def events() -> list[dict[str, Any]]:
        return [sent(e) async for e in response_events(ResponseBuilder(request, "m", 5), merged(),
                                                       PARSERS["hermes"] if tools else None)]
    return asyncio.run(events())


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def test_a_streamed_text_answer_is_openai_s_event_sequence_exactly() -> None:
    events = stream(["Hi", " there"], "stop")
    r, item_id = events[-1]["response"], events[2]["item"]["id"]
    assert item_id.startswith("msg_") and len(item_id) == 36
    item = {"type": "message", "id": item_id, "role": "assistant"}
    created = {**r, "status": "in_progress", "output": []}
    del created["usage"]
    assert events == [
        {"type": "response.created", "sequence_number": 0, "response": created},
        {"type": "response.in_progress", "sequence_number": 1, "response": created},
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", "sequence_number": 3, "item_id": item_id, "output_index": 0,
         "content_index": 0, "part": text_part("")},
        {"type": "response.output_text.delta", "sequence_number": 4, "item_id": item_id, "output_index": 0,
         "content_index": 0, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", "sequence_number": 5, "item_id": item_id, "output_index": 0,
         "content_index": 0, "delta": " there", "logprobs": []},
        {"type": "response.output_text.done", "sequence_number": 6, "item_id": item_id, "output_index": 0,
         "content_index": 0, "text": "Hi there", "logprobs": []},
        {"type": "response.content_part.done", "sequence_number": 7, "item_id": item_id, "output_index": 0,
         "content_index": 0, "part": text_part("Hi there")},
        {"type": "response.output_item.done", "sequence_number": 8, "output_index": 0,
         "item": {**item, "status": "completed", "content": [text_part("Hi there")]}},
        {"type": "response.completed", "sequence_number": 9, "response": r}]
    assert r["status"] == "completed" and r["output"] == [events[-2]["item"]] and r["usage"]["output_tokens"] == 2


def test_a_streamed_call_between_texts_is_openai_s_event_sequence_exactly() -> None:
    events = stream(["Sure.", '<tool_call>{"name": "get_weather", "arguments": ', '{"city": "Paris"}}</tool_call>',
                     " Done."], "stop", tools=True)
    call = events[11]["item"]
    assert call["id"].startswith("fc_") and len(call["id"]) == 35
    assert call["call_id"].startswith("call_") and len(call["call_id"]) == 29
    assert [(e["type"], e["sequence_number"], e.get("output_index")) for e in events] == [
        ("response.created", 0, None), ("response.in_progress", 1, None), ("response.output_item.added", 2, 0),
        ("response.content_part.added", 3, 0), ("response.output_text.delta", 4, 0),
        ("response.output_text.done", 5, 0), ("response.content_part.done", 6, 0),
        ("response.output_item.done", 7, 0), ("response.output_item.added", 8, 1),
        ("response.function_call_arguments.delta", 9, 1), ("response.function_call_arguments.done", 10, 1),
        ("response.output_item.done", 11, 1), ("response.output_item.added", 12, 2),
        ("response.content_part.added", 13, 2), ("response.output_text.delta", 14, 2),
        ("response.output_text.done", 15, 2), ("response.content_part.done", 16, 2),
        ("response.output_item.done", 17, 2), ("response.completed", 18, None)]
    assert events[8]["item"] == {**call, "arguments": "", "status": "in_progress"}
    assert events[9] == {"type": "response.function_call_arguments.delta", "sequence_number": 9,
                         "item_id": call["id"], "output_index": 1, "delta": '{"city": "Paris"}'}
    assert events[10] == {"type": "response.function_call_arguments.done", "sequence_number": 10,
                          "item_id": call["id"], "output_index": 1, "name": "get_weather",
                          "arguments": '{"city": "Paris"}'}
    assert call == {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": "get_weather",
                    "arguments": '{"city": "Paris"}', "status": "completed"}
    assert events[7]["item"]["content"] == [text_part("Sure.")]
    assert events[15]["text"] == " Done." and events[17]["item"]["content"] == [text_part(" Done.")]
    assert events[-1]["response"]["output"] == [events[7]["item"], call, events[17]["item"]]


def test_an_empty_answer_streams_an_empty_message_and_a_failed_one_says_why() -> None:
    empty = stream([""], "stop")
    assert [e["type"] for e in empty][2:] == ["response.output_item.added", "response.content_part.added",
                                              "response.output_text.delta", "response.output_text.done",
                                              "response.content_part.done", "response.output_item.done",
                                              "response.completed"]
    assert empty[-1]["response"]["output"][0]["content"] == [text_part("")]
    failed = stream(["Par", "is", ""], "error", error="the model raised")
    assert [e["type"] for e in failed][-2:] == ["response.output_item.done", "response.failed"]
    r = failed[-1]["response"]
    assert r["status"] == "failed" and r["error"] == {"code": "server_error", "message": "the model raised"}
    assert r["output"][0]["status"] == "incomplete" and r["output"][0]["content"] == [text_part("Paris")]
    # what was held back as the start of a tag is not sent after a failure
    held = stream(["Use <tool", ""], "error", tools=True, error="the model raised")
    assert held[-1]["response"]["output"][0]["content"] == [text_part("Use")]
    nothing = stream([""], "error", error="the model raised")
    assert [e["type"] for e in nothing] == ["response.created", "response.in_progress", "response.failed"]
    assert nothing[-1]["response"]["output"] == [] and nothing[-1]["sequence_number"] == 2


def test_a_stream_of_no_outputs_ends_after_it_began() -> None:
    """Only a cancelled request gives no output at all: nothing to close, nothing to finish."""
    assert [e["type"] for e in stream([], "stop")] == ["response.created", "response.in_progress"]

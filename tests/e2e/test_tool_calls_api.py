"""Tool calling through the unmodified `openai` SDK against a live server on the default model (SmolLM2, whose
template does not render tools: tokenmill shows them in SmolLM2's own format, `<tool_call>[...]</tool_call>`)."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from helpers import ServerThread, assert_no_live_blocks

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "strng"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: list, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: openai.OpenAI, **kwargs) -> tuple[dict[int, dict], str, list]:
    """The stream's calls by index ({id, name, arguments}), its content and its chunks."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    calls: dict[int, dict] = {}
    content = ""
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:  # the first piece of a call: id, type, name and no argument text yet
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return calls, content, chunks


@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_calls_are_valid_streamed_and_not(client: openai.OpenAI, choice, allowed: set[str]) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120)
    reply = client.chat.completions.create(model=MODEL, **kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls, allowed)
    calls, content, chunks = streamed(client, **kwargs)
    assert sorted(calls) == list(range(len(calls)))  # indices 0, 1, ...
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert content == (message.content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_required_calls_are_indexed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris and in Rome, please."}])
    calls = reply.choices[0].message.tool_calls
    check_calls(calls, {"get_weather", "get_time"})
    assert len({c.id for c in calls}) == len(calls)
    single = client.chat.completions.create(
        model=MODEL, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris and in Rome, please."}])
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_two_turn_tool_loop(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=60)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content


def test_auto_gives_a_well_formed_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name and isinstance(call.function.arguments, str)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": "not-a-list"}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [BAD_SCHEMA], "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, BAD_SCHEMA], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.1.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, server: ServerThread, fields: dict, param: str) -> None:
    """A forced call's bad schema is named by its field, in the schema's terms, not in those of the grammar
    tokenmill writes around it."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)
    assert caught.value.body["param"] == param  # type: ignore[index]
    if param.endswith("parameters"):
        message = caught.value.body["message"]  # type: ignore[index]
        assert "function 'f': Invalid type: strng" in message and "%json" not in message and "\n" not in message
    assert_no_live_blocks(server.engine)


def hostile_tool(name: str, pattern: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}}}


@pytest.mark.parametrize("tools, refused", [
    ([hostile_tool("f", "(a{1000}){1000}")], None),  # compiles at once; its lexer takes a second to build
    # a failed compile checks each forced schema on its own: 127 slow ones before the bad one
    ([hostile_tool(f"f{i}", "(a{100}){100}") for i in range(127)] + [BAD_SCHEMA], "tools.127.function.parameters"),
], ids=["one", "many"])
def test_hostile_forced_schemas_are_answered_in_bounded_time_and_the_server_keeps_serving(
        client: openai.OpenAI, server: ServerThread, tools: list[dict], refused: str | None) -> None:
    started = time.perf_counter()
    try:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, tools=tools, tool_choice="required")
        param = None
    except openai.BadRequestError as exc:
        param = exc.body["param"]  # type: ignore[index]
    assert param == refused and time.perf_counter() - started < 15
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3).choices[0].message.content
    assert_no_live_blocks(server.engine)


@pytest.mark.parametrize("choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_schema_no_forced_call_must_fit_is_not_compiled(client: openai.OpenAI, choice: str | dict) -> None:
    """Under auto, or when another tool is named, a schema the backend cannot compile (it may be valid JSON Schema
    the backend does not implement) is only shown to the model, as vLLM shows it."""
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tools=[WEATHER, BAD_SCHEMA],
                                           tool_choice=choice)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")

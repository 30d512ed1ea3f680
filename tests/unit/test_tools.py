"""Tool calling's request side: a two-turn tool loop rendered by a template that knows tools, and by one that does
not (the tools and past calls then appear in the model family's own format); the grammar of a forced call; calls
as the Responses stream's output items."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from helpers import CHATML

from tokenmill.api.answer import Reply, StreamUsage
from tokenmill.api.endpoints.chat import chat_chunks, chat_completion
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.responses_api import ResponseBuilder, ResponsesRequest, response_events, response_object
from tokenmill.api.tools.parsers import PARSERS, parse_tool_calls
from tokenmill.api.tools.request import forced_call_spec, template_inputs
from tokenmill.config import ServerConfig
from tokenmill.engine.request import SequenceOutput
from tokenmill.errors import RequestError
from tokenmill.loader.chat_template import ChatTemplate

# The shape of Qwen2.5's template (Hermes tool format): tools in the system turn, calls in <tool_call> tags with
# the arguments written by tojson, tool results in <tool_response> inside a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]

NO_TOKENIZER = Reply("id", "m", None)  # type: ignore[arg-type]  # answers without logprobs spell no token


def render(template_source: str, parser: str, **fields) -> str:
    body = ChatCompletionRequest(model="m", messages=LOOP, **fields)
    body.sampling_params(ServerConfig())  # a valid request
    template = ChatTemplate(template_source, None, None)
    messages, tools = template_inputs(body, template, PARSERS[parser])
    return template.render(messages, tools=tools, timeout=2.0, max_chars=100_000)


def test_a_template_that_knows_tools_renders_the_loop_its_own_way() -> None:
    text = render(HERMES_TEMPLATE, "hermes", tools=[TOOL])
    assert text.split("<tools>")[1].lstrip().startswith('{"type": "function", "function": {"name": "get_weather"')
    # arguments reach the template as an object, so tojson writes them once (not as an escaped string)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in render(HERMES_TEMPLATE, "hermes", tools=[TOOL], tool_choice="none")


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_a_template_without_tools_gets_them_in_the_family_format(parser: str) -> None:
    text = render(CHATML, parser, tools=[TOOL])
    assert text.startswith("<|im_start|>system\n") and "get_weather" in text.split("<|im_end|>")[0]
    # the past call is shown as the model would have written it, and reads back as the same call
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = parse_tool_calls(PARSERS[parser], assistant)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "<|im_start|>tool\n{\"celsius\": 21}<|im_end|>" in text
    without = render(CHATML, parser, tools=[TOOL], tool_choice="none")
    assert without.startswith("<|im_start|>user") and "get_weather" in without  # the past call is still shown


def test_forced_call_spec_follows_tool_choice() -> None:
    def spec(**fields):
        return forced_call_spec(ChatCompletionRequest(model="m", messages=LOOP, tools=[TOOL], **fields),
                                PARSERS["hermes"])

    assert spec() is None and spec(tool_choice="auto") is None and spec(tool_choice="none") is None
    required = spec(tool_choice="required")
    named = spec(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert required is not None and named is not None and required.kind == named.kind == "lark"
    assert required != spec(tool_choice="required", parallel_tool_calls=False) == named


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_inconsistent_tool_requests_are_refused(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as caught:
        ChatCompletionRequest(model="m", messages=LOOP, **fields).sampling_params(ServerConfig())
    assert caught.value.param == param


def test_an_unknown_tool_call_parser_stops_the_server_from_starting() -> None:
    from tokenmill.api.app import create_app
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match="^--tool-call-parser mistral: choose hermes, smollm2 or llama3_json$"):
        create_app(None, "m", config=ServerConfig(tool_call_parser="mistral"))  # type: ignore[arg-type]


TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')


def _outputs() -> list[SequenceOutput]:
    half = len(TWO_CALLS) // 2  # streamed in two pieces
    return [SequenceOutput(0, TWO_CALLS[:half], [], [], None, 5, 10),
            SequenceOutput(0, TWO_CALLS[half:], [], [], "stop", 5, 20)]


async def _merged() -> AsyncIterator[tuple[int, SequenceOutput]]:
    for out in _outputs():
        yield 0, out


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_answers_with_the_first_call_only(parallel: bool) -> None:
    """Also under tool_choice auto, where no grammar limits the model to one call."""
    hermes = PARSERS["hermes"]
    body = chat_completion(NO_TOKENIZER, 5, [_outputs()], hermes, parallel)
    names = [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])

    async def streamed() -> list[dict]:
        return [c async for c in chat_chunks(NO_TOKENIZER, 5, 1, _merged(), StreamUsage(), hermes, parallel)]
    deltas = [d for c in asyncio.run(streamed()) for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert [d["function"]["name"] for d in deltas if "id" in d] == names

    request = ResponsesRequest(model="m", input="x", parallel_tool_calls=parallel)
    response = response_object(ResponseBuilder(request, "m", 5), _outputs(), hermes)
    assert [item["name"] for item in response["output"] if item["type"] == "function_call"] == names

    async def events() -> list[dict]:
        return [e async for e in response_events(ResponseBuilder(request, "m", 5), _merged(), hermes)]
    added = [e["item"]["name"] for e in asyncio.run(events()) if e["type"] == "response.output_item.added"
             and e["item"]["type"] == "function_call"]
    assert added == names


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_an_answer_cut_inside_a_call_does_not_ask_to_run_it(finish: str) -> None:
    """A stop string (or an end token) that cuts a call leaves arguments no client could run: the answer is all
    content, finish_reason stop, streamed or not (it once said tool_calls, with '{"city": "Par' as arguments). Cut
    by the token limit, the call stays as written with finish_reason length, as OpenAI's."""
    hermes, cut = PARSERS["hermes"], 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    outs = [SequenceOutput(0, cut, [], [], finish, 5, 9)]
    choice = chat_completion(NO_TOKENIZER, 5, [outs], hermes)["choices"][0]
    assert choice["finish_reason"] == finish
    if finish == "stop":
        assert choice["message"]["content"] == cut and "tool_calls" not in choice["message"]
    else:
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'

    async def merged() -> AsyncIterator[tuple[int, SequenceOutput]]:
        yield 0, outs[0]

    async def streamed() -> list[dict]:
        return [c async for c in chat_chunks(NO_TOKENIZER, 5, 1, merged(), StreamUsage(), hermes)]
    assert [ch["finish_reason"] for c in asyncio.run(streamed()) for ch in c["choices"]][-1] == finish
    response = response_object(ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", 5), outs, hermes)
    assert [item["type"] for item in response["output"]] == (
        ["message"] if finish == "stop" else ["message", "function_call"])


def _stream_response(pieces: list[str], finish: str, parser: str | None = "hermes") -> tuple[list[dict], dict]:
    """A Responses stream of an answer that comes in these pieces and ends so, and the Response not streamed."""
    outs = [SequenceOutput(0, piece, [], [], finish if i == len(pieces) - 1 else None, 5, i + 1)
            for i, piece in enumerate(pieces)]
    request = ResponsesRequest(model="m", input="x", tools=[{"type": "function", "name": "get_weather"},
                                                           {"type": "function", "name": "get_time"}])
    tool_parser = PARSERS[parser] if parser else None

    async def merged() -> AsyncIterator[tuple[int, SequenceOutput]]:
        for out in outs:
            yield 0, out

    async def events() -> list[dict]:
        return [e async for e in response_events(ResponseBuilder(request, "m", 5), merged(), tool_parser)]
    return asyncio.run(events()), response_object(ResponseBuilder(request, "m", 5), outs, tool_parser)


@pytest.mark.parametrize("size", [1, 7, 10_000])  # tokens' worth of text per output, or all at once
def test_each_streamed_output_item_is_done_before_the_next_is_added(size: int) -> None:
    """OpenAI's order: an item's deltas, its arguments.done (a call's), its output_item.done, then the next item's
    output_item.added; with text, calls and text again in one output too."""
    answer = "Let me check. " + TWO_CALLS + " Done."
    events, whole = _stream_response([answer[i:i + size] for i in range(0, len(answer), size)], "stop")
    open_item, closed = None, []
    for e in events:
        if e["type"] == "response.output_item.added":
            assert open_item is None, "an item was added before the one before it was done"
            open_item = e["item"]["id"]
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == open_item and e["item"]["status"] == "completed"
            closed.append(e["item"])
            open_item = None
        elif "item_id" in e:
            assert e["item_id"] == open_item, e
    # all at once, the text after the calls joins the text before them: an output's order of text and calls is lost
    after = ["message"] if size < len(answer) else []
    assert open_item is None and [i["type"] for i in closed] == ["message", "function_call", "function_call", *after]
    kinds = [e["type"] for e in events]
    for done in (i for i, kind in enumerate(kinds) if kind == "response.function_call_arguments.done"):
        assert kinds[done + 1] == "response.output_item.done"
    final = events[-1]["response"]["output"]
    assert final == closed and [(c["name"], c["arguments"]) for c in final if c["type"] == "function_call"] == [
        (c["name"], c["arguments"]) for c in whole["output"] if c["type"] == "function_call"]


def test_a_streamed_item_cut_by_max_output_tokens_is_incomplete_as_when_not_streamed() -> None:
    events, whole = _stream_response(["Once upon", " a time"], "length", parser=None)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == [whole["output"][0]["status"]] == ["incomplete"]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    # a call the limit cut is the incomplete item, the text before it completed
    events, _ = _stream_response(["Sure. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'], "length")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(item["type"], item["status"]) for item in done] == [("message", "completed"),
                                                                 ("function_call", "incomplete")]
    # a whole call, then the limit: the call is the item the answer ended in, streamed or not
    events, whole = _stream_response(["Sure. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                                "</tool_call>"], "length")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [(i["type"], i["status"]) for i in whole["output"]] == [
        ("message", "completed"), ("function_call", "incomplete")]

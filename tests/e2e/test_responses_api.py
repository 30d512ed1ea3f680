"""OpenAI's Responses API through the unmodified `openai` SDK and the OpenAI Agents SDK, against a live server on
the default model: the same path as chat, streamed events, stored conversations across a restart, function tools,
text.format, and errors that name their field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers import ServerThread, assert_no_live_blocks, openai_client

from tokenmill.config import ServerConfig
from tokenmill.loader import LoadedModel

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_response_is_the_chat_completion_of_the_same_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a fruit.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Name a fruit."}],
                                          max_completion_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("completed" if finished == "stop" else "incomplete")
    if finished == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"


def test_streamed_events_come_in_order_and_add_up_to_the_response(client: openai.OpenAI, server: ServerThread
                                                                  ) -> None:
    events = list(client.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=24,
                                          temperature=0, stream=True))
    plain = client.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=24,
                                    temperature=0)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if plain.status == "completed" else "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    assert_no_live_blocks(server.engine)


def test_a_conversation_continues_from_its_stored_response_across_a_restart(smollm_served: LoadedModel,
                                                                           tmp_path: Path) -> None:
    config = ServerConfig(responses_store=str(tmp_path / "responses.sqlite3"))
    with ServerThread(smollm_served, MODEL, config, max_num_seqs=4) as first:
        client = openai_client(first)
        one = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
        unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with ServerThread(smollm_served, MODEL, config, max_num_seqs=4) as second:
        client = openai_client(second)
        assert client.responses.retrieve(one.id).output_text == one.output_text
        two = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=one.id,
                                      max_output_tokens=8, temperature=0)
        spelled_out = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, store=False, input=[
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": one.output_text},
            {"role": "user", "content": "What is my name?"}])
        assert two.previous_response_id == one.id
        assert two.usage.input_tokens == spelled_out.usage.input_tokens > one.usage.input_tokens
        assert two.output_text == spelled_out.output_text
        three = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=two.id,
                                        max_output_tokens=2)
        assert three.usage.input_tokens > two.usage.input_tokens + two.usage.output_tokens
        for missing in (unstored.id, "resp_nope"):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(missing)
            with pytest.raises(openai.NotFoundError) as raised:  # OpenAI's answer, 404
                client.responses.create(model=MODEL, input="x", previous_response_id=missing)
            assert raised.value.body["param"] == "previous_response_id"
            assert raised.value.code == "previous_response_not_found"
        deleted = httpx.delete(f"{second.base_url}/responses/{one.id}").json()
        assert deleted == {"id": one.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(one.id)


def test_a_response_the_store_cannot_keep_is_answered_as_not_stored(smollm_served: LoadedModel,
                                                                    tmp_path: Path) -> None:
    """A write the store fails (here its file turned read-only; a full disk fails the same way): the answer still
    comes, with store false, not streamed or in a stream's last event, so the client knows that GET and
    previous_response_id will not find it; the server goes on, and stores again once it can."""
    config = ServerConfig(responses_store=str(tmp_path / "responses.sqlite3"))
    with ServerThread(smollm_served, MODEL, config, max_num_seqs=4) as server:
        client = openai_client(server)
        store = server.server.config.app.state.hosting.responses
        with store._lock:
            store._db.execute("PRAGMA query_only = ON")
        ask = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 4, "temperature": 0}
        plain = client.responses.create(**ask)
        events = list(client.responses.create(stream=True, **ask))
        assert plain.store is False and plain.output_text and plain.status in ("completed", "incomplete")
        assert events[0].type == "response.created" and events[0].response.store is True  # not yet known
        streamed = events[-1].response
        assert events[-1].type == f"response.{plain.status}" and streamed.store is False
        assert streamed.output_text == plain.output_text
        for unstored in (plain.id, streamed.id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(unstored)
            with pytest.raises(openai.NotFoundError):
                client.responses.create(previous_response_id=unstored, **ask)
        with store._lock:
            store._db.execute("PRAGMA query_only = OFF")
        kept = client.responses.create(**ask)
        kept_streamed = list(client.responses.create(stream=True, **ask))[-1].response
        assert kept.store is True and kept_streamed.store is True
        assert client.responses.retrieve(kept.id).output_text == kept.output_text == plain.output_text
        assert client.responses.retrieve(kept_streamed.id).store is True


def test_a_streamed_response_that_fails_says_it_is_not_stored(client: openai.OpenAI, server: ServerThread,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The model raising mid-answer: the stream ends with response.failed, whose store is false (a failed response
    is not kept, so GET will not find it); not streamed, the same failure is a 500 error object."""
    def broken(plan):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(server.engine.runner, "run", broken)
    events = list(client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=4, stream=True))
    monkeypatch.undo()
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed" and last.response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(last.response.id)
    assert client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=4).store is True


def test_input_items_list_what_the_model_read_newest_first_in_pages(client: openai.OpenAI,
                                                                    server: ServerThread) -> None:
    """GET /v1/responses/{id}/input_items through the SDK: the conversation a response continues and its own input,
    each item with an id that stays the same, a page at a time after the id of the last one seen."""
    one = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
    asked = [{"role": "user", "content": [{"type": "input_text", "text": "What is "}, {"type": "input_text",
                                                                                       "text": "my name?"}]}]
    two = client.responses.create(model=MODEL, input=asked, previous_response_id=one.id, max_output_tokens=4)
    newest_first = client.responses.input_items.list(two.id)
    assert [(item.type, item.role) for item in newest_first.data] == [("message", "user"), ("message", "assistant"),
                                                                       ("message", "user")]
    latest, answer, first = newest_first.data
    assert [part.text for part in latest.content] == ["What is ", "my name?"]
    assert answer.id == one.output[0].id and answer.content[0].text == one.output_text
    assert first.content[0].type == "input_text" and first.content[0].text == "My name is Ada."
    assert not newest_first.has_more and len({item.id for item in newest_first.data}) == 3
    assert [item.id for item in client.responses.input_items.list(one.id).data] == [first.id]  # as listed before
    oldest_first = client.responses.input_items.list(two.id, order="asc", limit=2)
    assert [item.id for item in oldest_first.data] == [first.id, answer.id] and oldest_first.has_more
    rest = client.responses.input_items.list(two.id, order="asc", limit=1, after=answer.id)
    assert [item.id for item in rest.data] == [latest.id] and not rest.has_more
    assert [item.id for item in client.responses.input_items.list(two.id, limit=1)] == \
        [latest.id, answer.id, first.id]  # the SDK pages on by itself
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as refused:  # the SDK sends include[]=...
        client.responses.input_items.list(two.id, include=["message.input_image.image_url"])
    assert refused.value.body["param"] == "include"
    with pytest.raises(openai.BadRequestError) as duplicate:  # the previous answer sent back with its id
        client.responses.create(model=MODEL, previous_response_id=two.id, max_output_tokens=4,
                                input=[two.output[0].model_dump(), {"role": "user", "content": "Again?"}])
    assert "Duplicate item found" in duplicate.value.message and duplicate.value.body["param"] == "input"
    for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_nope"}, "after"), ({"include": ["x"]}, "include")):
        response = httpx.get(f"{server.base_url}/responses/{two.id}/input_items", params=query)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_required_function_tool_is_called_and_its_output_answered(client: openai.OpenAI) -> None:
    ask = "What is the weather in Paris?"
    forced = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60}
    response = client.responses.create(model=MODEL, input=ask, **forced)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    streamed = list(client.responses.create(model=MODEL, input=ask, stream=True, **forced))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and all(e.name == "get_weather" for e in done)
    for d in done:
        pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
                  and e.item_id == d.item_id]
        assert "".join(pieces) == d.arguments
        jsonschema.validate(json.loads(d.arguments), WEATHER["parameters"])
    follow_up = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert follow_up.status in ("completed", "incomplete")
    assert follow_up.usage.input_tokens > response.usage.input_tokens
    # prompted as the same chat conversation: the call is the assistant's turn, not part of the user's
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=16, temperature=0, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens
    assert follow_up.output_text == (chat.choices[0].message.content or "")


def test_a_call_cut_by_max_output_tokens_ends_incomplete_streamed_or_not(client: openai.OpenAI) -> None:
    """The forced call runs past the token limit: the Response and its call are incomplete, max_output_tokens says
    why, and the stream ends as the Response not streamed does, never `response.completed`."""
    cut = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
           "max_output_tokens": 20, "temperature": 0}
    plain = client.responses.create(model=MODEL, **cut)
    events = list(client.responses.create(model=MODEL, stream=True, **cut))
    assert events[-1].type == "response.incomplete" and not any(e.type == "response.completed" for e in events)
    streamed = events[-1].response
    for response in (plain, streamed):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[-1].type == "function_call" and response.output[-1].status == "incomplete"
        assert response.output[-1].name == "get_weather" and response.usage.output_tokens == 20
    assert [(i.type, i.status, getattr(i, "arguments", None)) for i in streamed.output] == \
        [(i.type, i.status, getattr(i, "arguments", None)) for i in plain.output]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [(i.type, i.status) for i in streamed.output]


def test_a_json_schema_text_format_is_followed(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                        "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": "weather?"}, {"type": "function_call_output", "call_id": "zzz",
                                                          "output": "sunny"}]}, "input[1].call_id"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"tools": [WEATHER, {**WEATHER, "name": "f", "parameters": {"type": "object", "properties": {"a": {
        "type": "strng"}}}}], "tool_choice": "required"}, "tools.1.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}}, "text.format"),
    ({"input": []}, "input"),
    ({"surely_not_a_field": 1}, "surely_not_a_field"),
])
def test_what_is_not_served_is_a_400_naming_its_field(server: ServerThread, fields: dict, param: str) -> None:
    """In the param and in the message: a Responses request runs as a chat request, whose field names it has not."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    response = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert not any(name in error["message"] for name in ("messages", "max_completion_tokens", "response_format",
                                                         "function."))
    assert_no_live_blocks(server.engine)


def test_the_agents_sdk_runs_a_one_tool_agent(server: ServerThread) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    model = agents.OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(base_url=server.base_url, api_key="unused",
                                                                  max_retries=0))
    agent = agents.Agent(name="weather", instructions="Use the tool.", model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(cities) >= 1 and result.final_output == f"Sunny in {cities[0]}"

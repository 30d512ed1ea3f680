"""Structured output through the unmodified `openai` SDK against a live server on the default model."""

from __future__ import annotations

import enum
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
from helpers import ServerThread, assert_no_live_blocks, openai_client

from tokenmill.config import ServerConfig
from tokenmill.loader import LoadedModel

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Size(enum.Enum):
    small = "small"
    large = "large"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Customer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    size: Size
    address: Address
    tags: list[str] = pydantic.Field(max_length=3)
    nickname: str | None = pydantic.Field(max_length=20)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(model=MODEL, messages=ask("Invent a customer who lives in Paris."),
                                          response_format=Customer, temperature=0, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Customer)
    assert Customer.model_validate_json(choice.message.content) == choice.message.parsed


def _bounded(schema: dict) -> dict:
    return {"type": "object", "properties": {"value": schema}, "required": ["value"], "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "object": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0,
               "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    "array_of_ints": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2,
                      "maxItems": 4},
    "enum": {"enum": ["red", "green", "blue"]},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
    "number_range": _bounded({"type": "number", "minimum": 1.5, "maximum": 2.5}),
    "exclusive_range": _bounded({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7}),
    "pattern": _bounded({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "date": _bounded({"type": "string", "format": "date"}),
    "email": _bounded({"type": "string", "format": "email", "maxLength": 30}),
    "uuid": _bounded({"type": "string", "format": "uuid"}),
    "optional_field": {"type": "object", "properties": {"title": SHORT, "subtitle": SHORT}, "required": ["title"],
                       "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {
        "type": "integer", "minimum": 1, "maximum": 1000}, "name": SHORT}, "required": ["id", "name"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "maxItems": 3, "minItems": 1, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
        "additionalProperties": False}},
    "boolean": _bounded({"type": "boolean"}),
    "const": _bounded({"const": "fixed"}),
    "nullable": _bounded({"type": ["string", "null"], "maxLength": 10}),
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
             "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"],
             "additionalProperties": False}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
             "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"], "additionalProperties": False},
    "one_of": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
         "maximum": 9}}, "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
         "maximum": 9}}, "required": ["kind", "side"], "additionalProperties": False}]},
    "string_lengths": _bounded({"type": "string", "minLength": 3, "maxLength": 6}),
    "array_of_enums": _bounded({"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                "maxItems": 3}),
}


def test_twenty_json_schemas_each_validate(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) == 20

    def run(item: tuple[str, dict]) -> tuple[str, str, str | None]:
        name, schema = item
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(f"Reply with a JSON value for '{name}'."), temperature=0, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        return name, reply.choices[0].message.content or "", reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, SCHEMAS.items()))
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())


def test_json_object_mode(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask('Repeat this JSON object: {"name": "Alice", "age": 30}'),
        response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_and_choice_match(client: openai.OpenAI, endpoint: str) -> None:
    def text(extra: dict, prompt: str) -> str:
        if endpoint == "chat":
            reply = client.chat.completions.create(model=MODEL, messages=ask(prompt), temperature=0, max_tokens=30,
                                                   extra_body=extra)
            return reply.choices[0].message.content
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30,
                                         extra_body=extra).choices[0].text

    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    assert re.fullmatch(phone, text({"guided_regex": phone}, "Bob's phone number is"))
    assert re.fullmatch(phone, text({"structured_outputs": {"regex": phone}}, "Alice's phone number is"))
    assert text({"guided_choice": ["Paris", "London", "Rome"]}, "The capital of France is") in {"Paris", "London",
                                                                                                "Rome"}
    assert text({"structured_outputs": {"choice": ["yes", "no"]}}, "Is water wet?") in {"yes", "no"}


def test_grammar(client: openai.OpenAI) -> None:
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    reply = client.chat.completions.create(model=MODEL, messages=ask("What is 2 + 2?"), temperature=0,
                                           max_tokens=20, extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"The answer is [0-9]+\.", reply.choices[0].message.content)


def test_streaming_is_unchanged_by_a_grammar(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=ask("Invent a customer."), temperature=0, max_tokens=200,
                  response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMAS["object"]}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"


def test_max_tokens_cuts_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ask("Invent a customer."), temperature=0,
                                           max_tokens=5, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
])
def test_bad_constraints_are_400_naming_the_field(client: openai.OpenAI, server: ServerThread, extra: dict,
                                                 param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=extra)
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3).choices[0].message.content
    assert_no_live_blocks(server.engine)


def test_a_compile_over_the_time_budget_is_a_400(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", ServerConfig(grammar_compile_timeout=1e-9)) as srv:
        client = openai_client(srv)
        with pytest.raises(openai.BadRequestError, match="did not compile within"):
            client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body={"guided_regex": "[a-z]+"})
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].finish_reason
        assert_no_live_blocks(srv.engine)


@pytest.mark.parametrize("extra", [
    {"guided_regex": "(a{1000}){1000}"},  # compiles at once; building its lexer takes a second, off the engine loop
    {"guided_choice": [f"option {i}" for i in range(5000)]},
    {"guided_json": {"enum": [f"v{i}" for i in range(20000)]}},
])
def test_a_hostile_constraint_is_answered_in_bounded_time_and_the_server_keeps_serving(
        client: openai.OpenAI, server: ServerThread, extra: dict) -> None:
    started = time.perf_counter()
    try:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3, extra_body=extra)
    except openai.BadRequestError:
        pass  # refused is as good as answered
    assert time.perf_counter() - started < 15
    assert client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3).choices[0].message.content
    assert_no_live_blocks(server.engine)

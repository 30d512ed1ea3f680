"""The rule for request fields, in one place: each is implemented, accepted with no effect (and documented), or
refused with a 400 naming it unless left at its default; a field no model declares is refused. Walks every request
model and every parameter the pinned `openai` SDK can send."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from openai_spec import request_properties
from pydantic import BaseModel, ValidationError

from tokenmill.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RequestModel,
    field_effect,
)
from tokenmill.api.responses_api import ResponsesRequest
from tokenmill.errors import RequestError

API_PAGE = (Path(__file__).parents[2] / "docs" / "api.md").read_text()


def request_models(cls: type[BaseModel] = RequestModel) -> list[type[RequestModel]]:
    """Every request model but the bases of others (their fields are walked in the subclasses)."""
    found: list[type[RequestModel]] = []
    for sub in cls.__subclasses__():
        found += request_models(sub) or [sub]
    return sorted(set(found), key=lambda c: c.__name__)


def top_level() -> dict[type[RequestModel], tuple[type, dict[str, Any]]]:
    """Each request body's model, the SDK's parameters for it, and a minimal valid body."""
    return {
        ChatCompletionRequest: (chat_create_params.CompletionCreateParamsBase,
                                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        CompletionRequest: (completion_create_params.CompletionCreateParamsBase, {"model": "m", "prompt": "hi"}),
        ResponsesRequest: (response_create_params.ResponseCreateParamsBase, {"model": "m", "input": "hi"}),
        EmbeddingRequest: (embedding_create_params.EmbeddingCreateParams, {"model": "m", "input": "hi"}),
    }


# Nested request models, and the bodies of routes the SDK has no method for (vLLM's LoRA routes), with a minimal
# valid value of each (refused fields are checked inside them too).
NESTED = {
    "LoadLoRAAdapterRequest": {"lora_name": "a", "lora_path": "/a"}, "UnloadLoRAAdapterRequest": {"lora_name": "a"},
    "StreamOptions": {}, "ResponseStreamOptions": {}, "TextConfig": {}, "TextFormat": {"type": "text"},
    "FunctionDefinition": {"name": "f"}, "Tool": {"type": "function", "function": {"name": "f"}},
    "ToolChoiceFunction": {"name": "f"}, "NamedToolChoice": {"type": "function", "function": {"name": "f"}},
    "ResponseFunctionTool": {"type": "function", "name": "f"}, "ResponseToolChoiceFunction": {"type": "function",
                                                                                               "name": "f"},
    "JsonSchemaFormat": {"name": "s"}, "ResponseFormat": {"type": "text"}, "StructuredOutputs": {},
}
CANDIDATES = (True, "x", 3, {"k": "v"}, ["x"], [{"k": "v"}], {})


def minimal(model: type[RequestModel]) -> dict[str, Any]:
    bodies = {m: body for m, (_, body) in top_level().items()}
    if model in bodies:
        return bodies[model]
    assert model.__name__ in NESTED, f"{model.__name__}: add a minimal valid body to NESTED"
    return NESTED[model.__name__]


def some_value(model: type[RequestModel], name: str) -> tuple[Any, Exception | None]:
    """A value of the field's type other than its default, and what validating it raised."""
    default = model.model_fields[name].default
    outcome: tuple[Any, Exception | None] | None = None
    for value in CANDIDATES:
        if value == default:
            continue
        try:
            model.model_validate({**minimal(model), name: value})
            return value, None
        except RequestError as exc:
            return value, exc
        except ValidationError as exc:
            outcome = outcome or (value, exc)
    raise AssertionError(f"{model.__name__}.{name}: no candidate value has its type ({outcome})")


MODELS = request_models()
FIELDS = [(m, name) for m in MODELS for name in m.model_fields]


def test_every_request_model_is_walked() -> None:
    names = {m.__name__ for m in MODELS}
    assert {"ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "EmbeddingRequest"} <= names
    assert names - {m.__name__ for m in top_level()} <= set(NESTED)


@pytest.mark.parametrize("model", list(top_level()), ids=lambda m: m.__name__)
def test_every_parameter_the_sdk_can_send_is_a_field(model: type[RequestModel]) -> None:
    params, _ = top_level()[model]
    sent = set(params.__required_keys__) | set(params.__optional_keys__)
    assert not sent - set(model.model_fields), "the SDK sends these, and the server would refuse them as unknown"


SPEC_REQUESTS = {ChatCompletionRequest: "CreateChatCompletionRequest", CompletionRequest: "CreateCompletionRequest",
                 ResponsesRequest: "CreateResponse", EmbeddingRequest: "CreateEmbeddingRequest"}


@pytest.mark.parametrize("model", list(SPEC_REQUESTS), ids=lambda m: m.__name__)
def test_every_field_of_openais_published_request_is_a_field(model: type[RequestModel]) -> None:
    assert not request_properties(SPEC_REQUESTS[model]) - set(model.model_fields)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_an_unknown_field_is_refused_by_name(model: type[RequestModel]) -> None:
    with pytest.raises(ValidationError) as raised:
        model.model_validate({**minimal(model), "surely_not_a_field": 1})
    assert raised.value.errors()[0]["type"] == "extra_forbidden"
    assert raised.value.errors()[0]["loc"] == ("surely_not_a_field",)


@pytest.mark.parametrize(("model", "name"), FIELDS, ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_each_field_is_implemented_accepted_without_effect_or_refused(model: type[RequestModel], name: str) -> None:
    effect, why = field_effect(model, name)
    assert effect in ("implemented", "no_effect", "refused")
    if effect == "implemented":
        return
    assert why, f"{model.__name__}.{name}: say why"
    listed = re.search(rf"^\| `{name}` \|.*\|$", API_PAGE, re.MULTILINE)
    assert listed, f"{name} ({effect}) is not in docs/api.md's request-fields table"
    value, raised = some_value(model, name)
    if effect == "no_effect":
        assert raised is None, f"{name}={value!r} is to be accepted: {raised}"
    else:
        assert isinstance(raised, RequestError) and raised.param == name, f"{name}={value!r} was not refused"
        model.model_validate({**minimal(model), name: model.model_fields[name].default})  # the default is fine

"""OpenAI request models (pydantic) and their translation into SamplingParams and a structured-output spec.

Fields OpenAI defines keep OpenAI's names and defaults; vLLM's extensions (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output, structured_outputs and the older guided_*) are
accepted too.

Nothing is dropped without a word: every field of a request model is implemented, accepted with no effect
(`no_effect`: it changes nothing here, e.g. `user`), or refused unless left at its default (`refused`: a 400 naming
it); a field no model declares is refused too. docs/api.md's table lists the second and third kinds.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from tokenmill.config import ServerConfig
from tokenmill.errors import RequestError
from tokenmill.sampling import MAX_TOP_LOGPROBS, SamplingParams
from tokenmill.structured import StructuredSpec

INT32_MAX = 2**31 - 1
# A prompt or input given as token ids: JSON integers only (lax ints took true as id 1 and 1.0 as 1)
TokenIds = list[StrictInt]

_EFFECT = "x-tokenmill-effect"  # in a field's JSON schema (so /docs shows it): "none" or "refused"


# Ollama's extension: how long the model stays loaded once idle after this request (a duration, seconds, -1)
KeepAlive = StrictStr | StrictInt | StrictFloat | None


def keep_alive_field() -> Any:
    return Field(default=None, description="Ollama's: how long the model stays loaded once idle after this request "
                                           "(5m, 30s, 0, -1 for forever)")


def no_effect(default: Any = None, *, why: str, **kwargs: Any) -> Any:
    """A field accepted and ignored: what it asks for changes nothing on this server."""
    return Field(default, json_schema_extra={_EFFECT: "none", "x-tokenmill-why": why}, **kwargs)


def refused(default: Any = None, *, why: str, **kwargs: Any) -> Any:
    """A field not implemented: a request that sets it to anything but its default gets a 400 naming it."""
    return Field(default, json_schema_extra={_EFFECT: "refused", "x-tokenmill-why": why}, **kwargs)


def field_effect(model: type[BaseModel], name: str) -> tuple[str, str | None]:
    """("implemented" | "no_effect" | "refused", why) of one field of a request model."""
    extra = model.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or _EFFECT not in extra:
        return "implemented", None
    return ("no_effect" if extra[_EFFECT] == "none" else "refused"), str(extra["x-tokenmill-why"])


def _invalid_unicode_at(value: Any, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON value that is not valid Unicode (a lone surrogate escape such as
    \\ud800 parses, but no tokenizer or template can take it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _invalid_unicode_at(key) is not None:
            return path or "body"
        found = _invalid_unicode_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class RequestModel(BaseModel):
    """The base of every request body: unknown fields, refused fields set to a value and strings that are no
    Unicode are 400s."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Every string of a body, whichever field holds it, before any field is read (a model nested in a body
        checks its part again, and finds nothing: the body's check ran first)."""
        at = _invalid_unicode_at(data)
        if at is not None:
            raise RequestError(f"{at}: the text is not valid Unicode (a lone surrogate escape?)", param=at)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default that is not None means that default: OpenAI's API and SDK
        declare n, stream, logprobs, echo... nullable, and clients send None for "unset"."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()
                or fields[key].get_default() is None}

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> RequestModel:
        fields = type(self).model_fields
        for name in self.model_fields_set:
            effect, why = field_effect(type(self), name)
            if effect == "refused" and getattr(self, name) != fields[name].default:
                raise RequestError(f"{name} is not supported by this server: {why}", param=name)
        return self


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far
    include_obfuscation: bool | None = no_effect(why="stream events are not padded: nothing to obfuscate")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(f"content parts of type {part.type!r} are not supported; send text",
                                   param="messages")
            parts.append(part.text)
        return "".join(parts)


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # a forced call always follows the schema

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are a JSON object, which clients read as keyword arguments: OpenAI refuses any other schema."""
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object")
        return parameters


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ToolChoiceFunction


def json_or_text(text: str) -> Any:
    """JSON text's value, or the text itself where it is not JSON (a tool call's arguments as a model wrote them)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class JsonSchemaFormat(RequestModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: exactly one of its fields (whitespace_pattern, structural_tag...: refused)."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _json_spec(schema: dict[str, Any] | str, param: str) -> StructuredSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError(f"{param}: the schema is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object", param=param)
    return StructuredSpec("json", json.dumps(schema))


def _choice_spec(choices: list[str], param: str) -> StructuredSpec:
    if not choices or not all(choices):
        raise RequestError(f"{param}: give at least one choice, none of them empty", param=param)
    return StructuredSpec("choice", json.dumps(choices))


def _spec(kind: str, value: Any, param: str) -> tuple[StructuredSpec, str]:
    """One constraint by its kind (json, regex, choice, grammar, json_object), whichever field brought it."""
    if kind == "json":
        return _json_spec(value, param), param
    if kind == "choice":
        return _choice_spec(value, param), param
    if kind == "json_object":
        return StructuredSpec("json", '{"type": "object"}'), param
    return StructuredSpec(kind, value), param  # type: ignore[arg-type]  # regex or grammar, as sent


# Request fields that map one-to-one onto SamplingParams; left out (None), SamplingParams' default holds.
_PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos", "min_tokens", "include_stop_str_in_output")


class SamplingFields(RequestModel):
    """Ranges are checked here, once, so the OpenAPI schema states them; the defaults are SamplingParams'. The
    server's configurable limits are checked in _sampling_params, what needs the vocabulary at admission."""

    model: str
    keep_alive: KeepAlive = keep_alive_field()
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    user: str | None = no_effect(why="an end-user id for OpenAI's abuse monitoring; nothing is logged per user")
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> tuple[StructuredSpec, str] | None:
        """What the output must match, and the field that asked (for errors); None: free text."""
        found: list[tuple[StructuredSpec, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(_spec("json_object", None, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise RequestError("response_format: type json_schema needs a json_schema", param="response_format")
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
            found.append((_json_spec(schema, "response_format.json_schema.schema"), "response_format"))
        so = self.structured_outputs
        if so is not None:
            given = [kind for kind in ("json", "regex", "choice", "grammar", "json_object")
                     if getattr(so, "json_" if kind == "json" else kind) not in (None, False)]
            if len(given) != 1:
                raise RequestError("structured_outputs: give exactly one of json, regex, choice, grammar, "
                                   "json_object", param="structured_outputs")
            kind = given[0]
            found.append(_spec(kind, getattr(so, "json_" if kind == "json" else kind), f"structured_outputs.{kind}"))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(_spec(kind, value, f"guided_{kind}"))
        if len(found) > 1:
            fields = ", ".join(param.split(".")[0] for _, param in found)
            raise RequestError(f"give one structured-output constraint, not several ({fields})", param=found[1][1])
        return found[0] if found else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, limits: ServerConfig,
                         num_prompts: int = 1) -> SamplingParams:
        if self.n * num_prompts > limits.max_seqs_per_request:
            what = f"n ({self.n}) times the prompts ({num_prompts})" if num_prompts > 1 else f"n ({self.n})"
            raise RequestError(f"{what} is over this server's limit of {limits.max_seqs_per_request} sequences "
                               f"per request", param="n")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > limits.max_stop:
            raise RequestError(f"at most {limits.max_stop} stop sequences are allowed", param="stop")
        if not all(stop):
            raise RequestError("stop strings must not be empty", param="stop")
        if len(self.logit_bias or {}) > limits.max_logit_bias:
            raise RequestError(f"at most {limits.max_logit_bias} logit_bias entries are allowed", param="logit_bias")
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError as exc:
            raise RequestError("logit_bias keys must be token ids", param="logit_bias") from exc
        if any(not -100.0 <= v <= 100.0 for v in bias.values()):
            raise RequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
        if max_tokens is not None and (self.min_tokens or 0) > max_tokens:
            raise RequestError("min_tokens must not exceed max_tokens", param="min_tokens")
        given = {name: getattr(self, name) for name in _PASSED_THROUGH if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logit_bias=bias, stop=stop,
                              stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs, **given)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None  # vLLM's extension; off unless the server allows it
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None  # text is what this server makes
    store: bool | None = no_effect(why="chat completions are not stored (the Responses API stores)")
    metadata: dict[str, str] | None = no_effect(why="kept with stored completions, and none are stored")
    service_tier: str | None = no_effect(why="one tier: every request is served alike")
    prompt_cache_key: str | None = no_effect(why="prefix caching is automatic, keyed by the prompt's tokens")
    prompt_cache_retention: str | None = no_effect(why="the prefix cache keeps prompts until memory is needed")
    prompt_cache_options: dict[str, Any] | None = no_effect(why="as prompt_cache_key")
    safety_identifier: str | None = no_effect(why="as user")
    reasoning_effort: str | None = refused(why="the served model's reasoning is not configurable")
    verbosity: str | None = refused(why="answer length is not steerable beyond max_completion_tokens")
    audio: dict[str, Any] | None = refused(why="text only")
    prediction: dict[str, Any] | None = refused(why="predicted outputs are not implemented")
    web_search_options: dict[str, Any] | None = refused(why="this server has no web search")
    moderation: dict[str, Any] | None = refused(why="this server has no moderation")
    functions: list[dict[str, Any]] | None = refused(why="the deprecated functions field: send tools")
    function_call: str | dict[str, Any] | None = refused(why="the deprecated function_call field: send tool_choice")

    def sampling_params(self, limits: ServerConfig) -> SamplingParams:
        if not self.messages:
            raise RequestError("messages must hold at least one message", param="messages")
        self._check_tools()
        if len(self.messages) > limits.max_messages:
            raise RequestError(f"at most {limits.max_messages} messages are allowed", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = getattr(self, self.max_tokens_param)
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, limits)

    @property
    def max_tokens_param(self) -> str:
        """The field that bounds the answer's length: max_completion_tokens where given (it replaced max_tokens)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tools: two tools have the same name", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise RequestError("tool_choice is only allowed when tools are specified", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                               param="tool_choice")
        if self.forced_tools() is not None and self.structured_spec() is not None:
            raise RequestError("a required or named tool_choice cannot be combined with a structured-output "
                               "constraint", param="tool_choice")

    @property
    def uses_tools(self) -> bool:
        """The model is shown the tools and its output is read for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools as function definitions: {name, description, parameters}."""
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or []]

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools one of which the output must call (tool_choice required or named), or None."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        specs = self.tool_specs()
        if isinstance(choice, NamedToolChoice):
            return [s for s in specs if s["name"] == choice.function.name]
        return specs

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: text content, and tool calls' arguments as objects (templates
        write them with tojson) where they are JSON."""
        out = []
        for m in self.messages:
            message = {**m.model_dump(exclude_none=True), "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [{**call.model_dump(), "function": {
                    "name": call.function.name, "arguments": json_or_text(call.function.arguments)}}
                    for call in m.tool_calls]
            out.append(message)
        return out


class EmbeddingRequest(RequestModel):
    model: str
    keep_alive: KeepAlive = keep_alive_field()
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # only the model's own: no truncation of its vectors
    user: str | None = no_effect(why="an end-user id for OpenAI's abuse monitoring; nothing is logged per user")

    def inputs(self) -> list[str | list[int]]:
        """The input's four shapes as a list of inputs, each text or token ids; none empty."""
        given = self.input
        inputs: list[str | list[int]]
        if isinstance(given, str) or (given and all(isinstance(x, int) for x in given)):
            inputs = [given]  # type: ignore[list-item]
        else:
            inputs = list(given)  # type: ignore[arg-type]
        if not inputs:
            raise RequestError("input must not be empty", param="input")
        for i, one in enumerate(inputs):
            if len(one) == 0:
                raise RequestError(f"input[{i}] is empty", param="input")
        return inputs


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = refused(why="fill-in-the-middle prompts are not implemented")
    best_of: int | None = Field(default=None, ge=1)

    def sampling_params(self, limits: ServerConfig) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is supported only equal to n", param="best_of")
        if self.echo and self.stream:
            raise RequestError("echo is not supported with stream", param="echo")
        return self._sampling_params(self.max_tokens, self.logprobs, limits, len(self.prompts()))

    def prompts(self) -> list[str | list[int]]:
        """The prompt field's four shapes as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

"""Tool calling's request side: what the chat template is given, and the grammar of a forced call.

The model's own template shows it the tools and its past calls where it can (`tools` and `tool_calls` in the
template); where it cannot, the tools go into a system message and past calls into the assistant's text, both in
the model family's own format (the tool parser's), so the model sees what it would write itself.
"""

from __future__ import annotations

from typing import Any

from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.tools.parsers import ToolParser
from tokenmill.errors import RequestError
from tokenmill.loader.chat_template import ChatTemplate
from tokenmill.structured import StructuredSpec
from tokenmill.structured.backend import json_schema_error


def template_inputs(body: ChatCompletionRequest, template: ChatTemplate, parser: type[ToolParser]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the tools (None: none shown) to render the request's prompt with."""
    messages = body.template_messages()
    if not template.renders_tool_calls:
        for message in messages:
            calls = message.pop("tool_calls", None)
            if calls:
                message["content"] += parser.render_calls([call["function"] for call in calls])
    if not body.uses_tools:
        return messages, None
    tools = body.tool_specs()
    if template.renders_tools:
        return messages, [{"type": "function", "function": tool} for tool in tools]
    prompt = parser.tools_prompt(tools)
    if messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def forced_call_spec(body: ChatCompletionRequest, parser: type[ToolParser]) -> StructuredSpec | None:
    """For tool_choice required or named: a grammar that makes the model write its own call format around one of
    the allowed tools and arguments that fit its schema (several calls when required and parallel)."""
    tools = body.forced_tools()
    if tools is None:
        return None
    parallel = body.tool_choice == "required" and body.parallel_tool_calls
    return StructuredSpec("lark", parser.call_grammar(tools, parallel))


def check_forced_schemas(body: ChatCompletionRequest, parser: type[ToolParser]) -> None:
    """Where a forced call's grammar did not compile: the tool whose schema is at fault, named by its field and in
    the schema's terms, not those of the grammar around it (each schema compiles on its own)."""
    index = {t.function.name: i for i, t in enumerate(body.tools or [])}
    for tool in body.forced_tools() or []:
        if error := json_schema_error(parser.call_schema(tool)):
            param = f"tools.{index[tool['name']]}.function.parameters"
            raise RequestError(f"{param}: invalid schema for function {tool['name']!r}: {error}", param=param)

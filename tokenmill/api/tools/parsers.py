"""Tool calls in a model's output text, one parser per model family, and the prompt side of each family's format:
how its past calls look, how tools are described to it, the grammar of a forced call.

A parser follows one output. `feed` takes the next piece of text and returns what can be said already: content
(text outside calls) and call deltas, a call's name once its string is complete, then its arguments as the model
writes them. Text is held back only while it may still turn out to be a call or its wrapper; when it does not, it
is released as content exactly as written. The whole-text parse is `feed(text)` then `finish()` on a fresh parser,
so streamed and whole results agree by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill.api.protocol import json_or_text
from tokenmill.structured import JSON_WHITESPACE

_WS = " \t\r\n"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# The states every family shares; a family's wrapper adds its own (see ToolParser._wrapper).
_TEXT, _THINK, _CONTENT, _CALL = "text", "think", "content", "call"


@dataclass
class ToolCallDelta:
    index: int
    name: str | None  # on the first delta of a call only
    arguments: str  # a fragment of the arguments' JSON text ("" on the first delta)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it ("{}" when it wrote none)
    complete: bool = False  # its object closed: the arguments are whole (a stop string or the end may cut one)


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


# --- a JSON scanner for text that is still arriving ----------------------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string(token: str) -> str | None:
    """A JSON string token's value; None if it is not one."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _Value:
    """The extent of one JSON value, read as its text arrives: only nesting depth and string state are followed, so
    that brackets and quotes inside strings do not count. Validity is left to whoever reads the value."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.in_scalar = False

    def read(self, text: str, i: int, final: bool) -> int | None:
        """Read on from text[i] (the value's first character on the first call); the value's end once it is
        complete, else None. A number or literal is complete when a character that cannot continue it comes, or
        at the end of the output (final)."""
        for j in range(i, len(text)):
            ch = text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return j + 1
            elif self.in_scalar:
                if not (ch.isalnum() or ch in "+-."):
                    return j
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
            elif self.depth == 0:
                self.in_scalar = True
        return len(text) if final and self.in_scalar else None


class _CallObject:
    """A call object {"name": ..., "arguments": ...} read as its text arrives: its name once the name's string is
    complete, and where its arguments' value starts and ends. Other keys are read past (models add "type")."""

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.pos = start + 1  # read up to here
        self.expect = "key"  # what comes next: "key", "colon", "value" or "next" (a comma or the closing brace)
        self.value: _Value | None = None  # the key or value being read
        self.value_start = 0
        self.key: str | None = None  # the key whose value comes next
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None  # past the closing brace
        self.broken: int | None = None  # where the text stopped being an object

    def read(self, text: str, final: bool) -> None:
        while self.end is None and self.broken is None:
            if self.value is not None:
                stop = self.value.read(text, self.pos, final)
                if stop is None:
                    self.pos = len(text)
                    return
                self.pos, self.value = stop, None
                self._took(text[self.value_start:stop])
                continue
            i = self.pos = _skip_ws(text, self.pos)
            if i == len(text):
                return
            ch = text[i]
            if (self.expect == "key" and ch == '"') or (self.expect == "value" and (ch in '"{[-' or ch.isalnum())):
                self.value, self.value_start = _Value(), i
                if self.expect == "value" and self.key in self.args_keys and self.args_start is None:
                    self.args_start = i
            elif self.expect == "colon" and ch == ":":
                self.expect, self.pos = "value", i + 1
            elif self.expect == "next" and ch == ",":
                self.expect, self.pos = "key", i + 1
            elif self.expect in ("key", "next") and ch == "}":
                self.end = i + 1
            else:
                self.broken = i

    def _took(self, token: str) -> None:
        """A key or a value is complete."""
        if self.expect == "key":
            self.key, self.expect = _string(token), "colon"
            if self.key is None:
                self.broken = self.value_start
            return
        if self.key == "name" and self.name is None:
            self.name = _string(token)
            if self.name is None:  # a name must be a string: this is no call
                self.broken = self.value_start
                return
        if self.value_start == self.args_start:
            self.args_end = self.pos
        self.expect = "next"


def _partial_suffix(text: str, start: int, tags: tuple[str, ...]) -> int:
    """The length of the longest end of text[start:] that a tag could still begin with."""
    tail = text[max(start, len(text) - max(map(len, tags)) + 1):]
    return max((n for n in range(1, len(tail) + 1) if any(tag.startswith(tail[-n:]) for tag in tags)), default=0)


# --- the parsers ---------------------------------------------------------------------------------------------------

class ToolParser:
    """The shared machinery. A family describes its format in class variables:

    `_wrapper` is the format as states. In each state, after whitespace, one of the state's texts must come next
    and leads to the state it names; "{" reads a call object, then goes to the state named. Anything else means
    that the text held since the wrapper began was no call: it is released as content, and reading goes on in
    `_not_a_call`. In the text state (`_TEXT`) content may come before the state's texts, which open a wrapper.

    `_layout` is how the prompt side writes calls: (before the calls, between two calls, after the calls).
    """

    name: ClassVar[str]
    delimiters: ClassVar[tuple[str, ...]]
    _first: ClassVar[str]
    _wrapper: ClassVar[dict[str, dict[str, str]]]
    _not_a_call: ClassVar[str]
    _args_keys: ClassVar[tuple[str, ...]] = ("arguments",)  # the first is the one the prompt side writes
    _layout: ClassVar[tuple[str, str, str]]

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0  # text before this is dealt with
        self._state = self._first
        self._held: int | None = 0  # where text that may yet turn out to be no call starts (None: none held)
        self._strip = False  # after a call: its whitespace is content only between text before it and text after
        self._gap = 0  # where that whitespace ends, as far as it has arrived
        self._wrote = False  # content other than whitespace went out
        self._call: _CallObject | None = None
        self._after_call = ""  # the state to go to once the call object ends
        self._named = False  # the current call object has its name, so it is a call
        self._sent = 0  # how much of its arguments' text went out
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls

    @property
    def called(self) -> bool:
        """The output called tools, every call whole: only then are they for the client to run (finish_reason
        tool_calls)."""
        return bool(self._calls) and all(call.complete for call in self._calls)

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final):
            pass
        self._wrote = self._wrote or bool(out.content.strip())
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """One move of the state machine: True when it moved (step again), False when it needs more text."""
        if self._state == _CALL:
            return self._read_call(out, final)
        if self._state in (_TEXT, _THINK):
            return self._read_text(out, final)
        if self._state == _CONTENT:
            out.content += self._buf[self._pos:]
            self._pos = len(self._buf)
            return False
        return self._read_wrapper(out, final)

    def _read_text(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._strip:  # text, or another call, may yet follow the whitespace
            self._gap = _skip_ws(buf, self._gap)
            if self._gap == len(buf):
                return False
            self._strip = False
            if not (self._wrote or out.content.strip()):  # it would lead the content
                self._pos = self._gap
        pos, thinking = self._pos, self._state == _THINK
        tags = (_THINK_CLOSE,) if thinking else (*self._wrapper[_TEXT], _THINK_OPEN)
        found = min(((i, tag) for tag in tags if (i := buf.find(tag, pos)) >= 0), default=None)
        if found is None:  # hold back what may begin a tag and, outside thinking, whitespace that may precede one
            end = len(buf) if final else len(buf) - _partial_suffix(buf, pos, tags)
            if not (final or thinking):
                end = pos + len(buf[pos:end].rstrip(_WS))
            out.content += buf[pos:end]
            self._pos = end
            return False
        at, tag = found
        if tag in (_THINK_OPEN, _THINK_CLOSE):  # calls inside a think block are not calls: it is all content
            out.content += buf[pos:at + len(tag)]
            self._state = _TEXT if thinking else _THINK
        else:
            self._held = pos + len(buf[pos:at].rstrip(_WS))
            out.content += buf[pos:self._held]
            self._state = self._wrapper[_TEXT][tag]
        self._pos = at + len(tag)
        return True

    def _read_wrapper(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        at = self._pos = _skip_ws(buf, self._pos)
        for text, then in self._wrapper[self._state].items():
            if buf.startswith(text, at):
                if text == "{":
                    self._call, self._after_call = _CallObject(at, self._args_keys), then
                    self._named, self._sent = False, 0
                    self._state = _CALL
                    if self._held is None:
                        self._held = at
                else:
                    self._state, self._pos, self._strip = then, at + len(text), then == _TEXT
                    self._gap = self._pos
                return True
        if not final and any(text.startswith(buf[at:]) for text in self._wrapper[self._state]):
            return False
        self._no_call(out, at)
        return True

    def _no_call(self, out: ParsedDelta, at: int) -> None:
        """The wrapper stops at `at`: the text held (none once a call was named) was not a call after all."""
        if self._held is not None:
            out.content += self._buf[self._held:at]
        self._held, self._state, self._pos = None, self._not_a_call, at

    def _read_call(self, out: ParsedDelta, final: bool) -> bool:
        call = self._call
        assert call is not None
        call.read(self._buf, final)
        if call.name is not None and not self._named:  # it is a call: the wrapper text held was no content
            self._named, self._held = True, None
            self._calls.append(ToolCall(call.name, ""))
            out.calls.append(ToolCallDelta(len(self._calls) - 1, call.name, ""))
        if self._named and call.args_start is not None:
            end = call.args_end if call.args_end is not None else call.pos
            self._send(out, self._buf[call.args_start + self._sent:end])
        stop = call.end if call.end is not None else call.broken
        if stop is None and not final:
            return False
        if self._named and not self._sent:
            self._send(out, "{}")
        if self._named and call.end is not None:
            self._calls[-1].complete = True
            self._state, self._pos = self._after_call, call.end
        else:  # not a call, or a call whose object broke off: what follows is read as text
            self._no_call(out, len(self._buf) if stop is None else stop)
        self._call = None
        return True

    def _send(self, out: ParsedDelta, piece: str) -> None:
        if piece:
            self._sent += len(piece)
            self._calls[-1].arguments += piece
            out.calls.append(ToolCallDelta(len(self._calls) - 1, None, piece))

    # --- the prompt side ---------------------------------------------------------------------------------------

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        """The text in which this family writes these calls ({"name", "arguments": dict or JSON text})."""
        before, between, after = cls._layout
        return before + between.join(json.dumps(cls._call_object(c), ensure_ascii=False) for c in calls) + after

    @classmethod
    def _call_object(cls, call: dict[str, Any]) -> dict[str, Any]:
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):  # the API's form: JSON text (kept as a string if it is not JSON)
            arguments = json_or_text(arguments)
        return {"name": call["name"], cls._args_keys[0]: arguments}

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) for one call of one of these tools, or several when parallel, written as
        render_calls writes them: each call's name first, then arguments that fit that tool's schema."""
        before, between, after = ([json.dumps(part)] if part else [] for part in cls._layout)  # JSON's escapes
        more = [f"({between[0]} call)*"] if parallel else []
        calls = " | ".join(f"%json {json.dumps(cls.call_schema(tool))}" for tool in tools)
        return f"start: {' '.join([*before, 'call', *more, *after])}\ncall: {calls}"

    @classmethod
    def call_schema(cls, tool: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call of this tool: its name, and arguments that fit its parameters."""
        # No parameters: an empty parameter list, as OpenAI reads it
        params = dict(tool.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})
        # References such as "#/$defs/Item" resolve from the root of the embedded schema: move definitions there.
        # (Each tool is a schema of its own, so that two tools' definitions cannot clash.)
        definitions = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
        key = cls._args_keys[0]
        return {"type": "object", "properties": {"name": {"const": tool["name"]}, key: params},
                "required": ["name", key], "additionalProperties": False, **definitions,
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)


class HermesParser(ToolParser):
    """Qwen2.5, Qwen3, Hermes: each call in tags of its own,
    <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call> (the newlines optional)."""

    name = "hermes"
    delimiters = ("<tool_call>", "</tool_call>")
    _first = _not_a_call = _TEXT
    _wrapper = {_TEXT: {"<tool_call>": "open"}, "open": {"{": "close"}, "close": {"</tool_call>": _TEXT}}
    _layout = ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:  # Qwen2.5's own words
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class SmolLM2Parser(ToolParser):
    """SmolLM2: all calls as one JSON list in one tag, <tool_call>[{...}, {...}]</tool_call> (or one bare object)."""

    name = "smollm2"
    delimiters = ("<tool_call>", "</tool_call>")
    _first = _not_a_call = _TEXT
    _wrapper = {_TEXT: {"<tool_call>": "open"}, "open": {"[": "list", "{": "close"},
                "list": {"{": "item", "]": "close"}, "item": {",": "list", "]": "close"},
                "close": {"</tool_call>": _TEXT}}
    _layout = ("<tool_call>[", ", ", "]</tool_call>")

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:  # close to the words SmolLM2 was tuned on
        return ("You are an expert in composing functions. You are given a question and a set of possible "
                "functions. Based on the question, you will need to make one or more function/tool calls to achieve "
                "the purpose. If none of the functions can be used, answer in plain text.\n\n"
                f"You have access to the following tools:\n<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
                "To call functions, write them as a JSON list inside <tool_call></tool_call> tags:\n"
                '<tool_call>[{"name": "func_name1", "arguments": {"argument1": "value1"}}, ... (more tool calls as '
                "required)]</tool_call>")


class Llama3JsonParser(ToolParser):
    """Llama 3.1 to 3.3: an answer that is a call, {"name": ..., "parameters": ...}, after an optional <|python_tag|>;
    several separated by ";". Only the start of the answer can be a call."""

    name = "llama3_json"
    delimiters = ("<|python_tag|>",)
    _first, _not_a_call = "start", _CONTENT
    _wrapper = {"start": {"<|python_tag|>": "start", "{": "more"}, "more": {";": "start"}}
    _args_keys = ("parameters", "arguments")
    _layout = ("", "; ", "")

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:  # Llama 3.1's own words
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                'value}. Do not use variables. To make several calls, separate them with "; ".\n\n'
                f"{_tool_lines(tools)}")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, SmolLM2Parser, Llama3JsonParser)}


def choose_parser(template_source: str | None, override: str | None = None) -> type[ToolParser]:
    """The --tool-call-parser override (one of PARSERS: ServerConfig.check() refuses others), else the format the
    chat template shows (Hermes when it shows none)."""
    if override is not None:
        return PARSERS[override]
    source = template_source or ""
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonParser
    if "SmolLM" in source:
        return SmolLM2Parser
    return HermesParser


def parse_tool_calls(parser_cls: type[ToolParser], text: str, finish_reason: str | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """A whole output: its content (None when empty or blank) and its calls. An answer that ended on its own
    (finish_reason stop) inside a call, which a stop string or an end token cut, is all content, as vLLM gives an
    output whose call does not parse: no client could run that call. One the token limit cut keeps its last call as
    written, finish_reason length saying so (as OpenAI's)."""
    parser = parser_cls()
    content = parser.feed(text).content + parser.finish().content
    if finish_reason == "stop" and parser.calls and not parser.called:
        return (text if text.strip() else None), []
    return (content if content.strip() else None), parser.calls

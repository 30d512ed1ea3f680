"""Tool calls in a model's output text, per model family: read while streaming or whole, and the prompt side of each
format (how past calls look, how tools are described, the grammar of a forced call).

One parser instance follows one output. `feed` takes the next piece of text and returns what can already be said:
content (text outside calls) and call deltas — a call's name as soon as it is complete, then its arguments as the
model writes them. The whole-text parse is `feed(text)` then `finish()` on a fresh parser, so streamed and whole
results agree by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill.structured import JSON_WHITESPACE

_WS = " \t\r\n"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCallDelta:
    index: int
    name: str | None  # on the first delta of a call only
    arguments: str  # a fragment of the arguments' JSON text ("" on the first delta)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it ("{}" when it wrote none)


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


# --- a JSON scanner that tolerates text that is still arriving ---------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value that starts at text[i], or None while it is incomplete. Brackets and
    quotes inside strings do not count."""
    if text[i] == '"' or text[i] in "{[":
        depth, in_string, j = 0, False, i
        while j < len(text):
            ch = text[j]
            if in_string:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: it ends where a delimiter comes
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def _string(token: str) -> str | None:
    """A JSON string token's value; None if it is not one."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class _CallScan:
    """What is known so far of a call object {"name": ..., "arguments": ...}."""

    name: str | None = None  # once the name's string is complete
    args: tuple[int, int | None] | None = None  # the arguments value's span; end None while it is incomplete
    end: int | None = None  # the end of the object, once complete
    broken: int | None = None  # where the text stopped being a call object


def _scan_call(text: str, start: int, args_keys: tuple[str, ...]) -> _CallScan:
    scan = _CallScan()
    j = start + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            scan.broken = j
            return scan
        key_end = _value_end(text, j)
        if key_end is None:
            return scan
        key = _string(text[j:key_end])
        if key is None:
            scan.broken = j
            return scan
        j = _skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.broken = j
            return scan
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        value_end = _value_end(text, j)
        if key in args_keys and scan.args is None:
            scan.args = (j, value_end)
        if value_end is None:
            return scan
        if key == "name" and scan.name is None:
            scan.name = _string(text[j:value_end])
        j = value_end


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of text that a tag could still begin with."""
    return max((n for tag in tags for n in range(min(len(tag) - 1, len(text)), 0, -1)
                if text.endswith(tag[:n])), default=0)


# --- the parser ----------------------------------------------------------------------------------------------------

class ToolParser:
    """The shared machinery; a family says how its calls are wrapped (the class variables)."""

    name: ClassVar[str]
    delimiters: ClassVar[tuple[str, ...]]
    open_tag: ClassVar[str | None] = None  # None: calls only at the very start of the output (llama3_json)
    close_tag: ClassVar[str | None] = None
    in_list: ClassVar[bool] = False  # all calls in one JSON list inside one tag
    separator: ClassVar[str] = ","  # between calls of a list (or, without tags, between calls)
    args_key: ClassVar[str] = "arguments"

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0  # text before this is dealt with
        self._mode = "text" if self.open_tag else "start"
        self._strip = False  # whitespace after a call is not content
        self._calls: list[ToolCall] = []
        self._call_start = 0
        self._call_named = False
        self._args_sent = 0

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        rest = self._buf[self._pos:]
        if self._mode in ("text", "think", "start", "content"):
            out.content += rest.rstrip(_WS) if self._calls or self._strip else rest
        self._pos = len(self._buf)
        return out

    # One step of the state machine; True when it moved (call again), False when it waits for more text.
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        if self._mode == "content":  # llama3_json: the output did not start with a call
            out.content += buf[pos:]
            self._pos = len(buf)
            return False
        if self._mode in ("text", "think"):
            return self._text(out, final)
        at = _skip_ws(buf, pos)
        if at >= len(buf):
            return False
        if self._mode == "start":
            return self._start(at)
        if self._mode == "open":  # just after the open tag
            if self.in_list and buf[at] == "[":
                self._pos, self._mode = at + 1, "list"
            elif buf[at] == "{":
                self._begin_call(at)
            else:
                self._mode, self._pos = "text", pos  # not a call after all: plain text
                out.content += self.open_tag or ""
            return True
        if self._mode == "list":  # inside a list, before a call
            if buf[at] == "{":
                self._begin_call(at)
            elif buf[at] == "]":
                self._pos, self._mode = at + 1, "close"
            else:
                self._pos, self._mode = at, "text"
            return True
        if self._mode == "call":
            return self._call(out)
        if self._mode == "after":  # after a call: a separator, the list's end, the close tag, or text
            if self.in_list and buf[at] in ",]":
                self._pos, self._mode = at + 1, ("list" if buf[at] == "," else "close")
                return True
            if not self.open_tag and buf[at] == self.separator:
                self._pos, self._mode = at + 1, "start"
                return True
            self._pos, self._mode = at, "close" if self.close_tag else "content"
            return True
        if self._mode == "close":
            tag = self.close_tag or ""
            if buf.startswith(tag, at):
                self._pos, self._mode, self._strip = at + len(tag), "text", True
                return True
            if tag.startswith(buf[at:]) and not final:
                return False
            self._pos, self._mode, self._strip = at, "text", True  # no close tag: the rest is text
            return True
        raise AssertionError(self._mode)

    def _start(self, at: int) -> bool:
        """llama3_json: a call may open the output (or follow a separator), after an optional <|python_tag|>."""
        buf, tag = self._buf, self.delimiters[0] if self.delimiters else ""
        if tag and buf.startswith(tag, at):
            self._pos = at + len(tag)
            return True
        if buf[at] == "{":
            self._begin_call(at)
            return True
        if tag and tag.startswith(buf[at:]):
            return False
        self._mode = "content" if not self._calls else "text"
        return True

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        if self._strip:
            pos = self._pos = _skip_ws(buf, pos)
            if pos >= len(buf):
                return False
            self._strip = False
        if self._mode == "think":
            end = buf.find(_THINK_CLOSE, pos)
            if end >= 0:
                out.content += buf[pos:end + len(_THINK_CLOSE)]
                self._pos, self._mode = end + len(_THINK_CLOSE), "text"
                return True
            safe = len(buf) - _partial_suffix(buf, (_THINK_CLOSE,))
            out.content += buf[pos:safe]
            self._pos = safe
            return False
        tags = tuple(t for t in (self.open_tag, _THINK_OPEN) if t)
        found = [(i, t) for t in tags if (i := buf.find(t, pos)) >= 0]
        if found:
            at, tag = min(found)
            if tag == _THINK_OPEN:
                out.content += buf[pos:at + len(tag)]
                self._pos, self._mode = at + len(tag), "think"
            else:
                out.content += buf[pos:at].rstrip(_WS)
                self._pos, self._mode = at + len(tag), "open"
            return True
        # Hold back what may begin a tag, and trailing whitespace (it may only separate content from a call).
        safe = len(buf) - _partial_suffix(buf, tags)
        safe = pos + len(buf[pos:safe].rstrip(_WS))
        out.content += buf[pos:safe]
        self._pos = safe
        return False

    def _begin_call(self, at: int) -> None:
        self._mode, self._call_start, self._call_named, self._args_sent = "call", at, False, 0

    def _call(self, out: ParsedDelta) -> bool:
        buf = self._buf
        scan = _scan_call(buf, self._call_start, (self.args_key, "arguments"))
        if not self._call_named and scan.name is not None:
            self._call_named = True
            self._calls.append(ToolCall(scan.name, ""))
            out.calls.append(ToolCallDelta(len(self._calls) - 1, scan.name, ""))
        if self._call_named and scan.args is not None:
            start, end = scan.args
            piece = buf[start + self._args_sent:len(buf) if end is None else end]
            self._send_args(out, piece)
        if scan.broken is not None:
            self._pos, self._mode = scan.broken, "text"
            return True
        if scan.end is None:
            self._pos = len(buf)
            return False
        if self._call_named and scan.args is None:
            self._send_args(out, "{}")
        self._pos, self._mode = scan.end, "after"
        return True

    def _send_args(self, out: ParsedDelta, piece: str) -> None:
        if piece:
            self._args_sent += len(piece)
            self._calls[-1].arguments += piece
            out.calls.append(ToolCallDelta(len(self._calls) - 1, None, piece))

    # --- the prompt side ------------------------------------------------------------------------------------

    @classmethod
    def _call_object(cls, call: dict[str, Any]) -> dict[str, Any]:
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        return {"name": call["name"], cls.args_key: arguments}

    @staticmethod
    def render_calls(calls: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    @classmethod
    def _call_schema(cls, tools: list[dict[str, Any]]) -> str:
        """One call of any of tools, as a JSON schema: name first, then that tool's parameters."""
        options = [{"type": "object", "properties": {
            "name": {"const": t["name"]},
            cls.args_key: t.get("parameters") or {"type": "object", "properties": {}}},
            "required": ["name", cls.args_key], "additionalProperties": False} for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        raise NotImplementedError

    @classmethod
    def _tool_list(cls, tools: list[dict[str, Any]]) -> str:
        return "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)


class HermesParser(ToolParser):
    name = "hermes"
    delimiters = ("<tool_call>", "</tool_call>")
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    @staticmethod
    def render_calls(calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(HermesParser._call_object(c), ensure_ascii=False)}\n</tool_call>"
                         for c in calls)

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions to help answer. The functions, one JSON signature per line, are inside "
                f"<tools></tools>:\n<tools>\n{HermesParser._tool_list(tools)}\n</tools>\n\nTo call one, write a JSON "
                "object with the function's name and its arguments inside <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: "<tool_call>\\n" %json {cls._call_schema(tools)} "\\n</tool_call>"'


class SmolLM2Parser(ToolParser):
    name = "smollm2"
    delimiters = ("<tool_call>", "</tool_call>")
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    in_list = True

    @staticmethod
    def render_calls(calls: list[dict[str, Any]]) -> str:
        body = json.dumps([SmolLM2Parser._call_object(c) for c in calls], ensure_ascii=False)
        return f"<tool_call>{body}</tool_call>"

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions to answer the question. To call functions, write them as a JSON list "
                "inside <tool_call></tool_call> tags, like\n"
                '<tool_call>[{"name": "func_name", "arguments": {"arg": "value"}}]</tool_call>\n'
                "If no function fits, answer in plain text.\n\nThe functions, one JSON signature per line:\n<tools>\n"
                f"{SmolLM2Parser._tool_list(tools)}\n</tools>")

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' (", " call)*' if parallel else ""
        return f'start: "<tool_call>[" call{repeat} "]</tool_call>"\ncall: %json {cls._call_schema(tools)}'


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    delimiters = ("<|python_tag|>",)
    separator = ";"
    args_key = "parameters"

    @staticmethod
    def render_calls(calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps(Llama3JsonParser._call_object(c), ensure_ascii=False) for c in calls)

    @staticmethod
    def tools_prompt(tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. To call one, answer with only a JSON object of the form "
                '{"name": <function name>, "parameters": <arguments as a JSON object>}; separate several with "; ". '
                f"The functions:\n{Llama3JsonParser._tool_list(tools)}")

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {cls._call_schema(tools)}"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, SmolLM2Parser, Llama3JsonParser)}


def choose_parser(template_source: str | None, override: str | None = None) -> type[ToolParser]:
    """The --tool-call-parser override, else the format the chat template shows."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"unknown tool-call parser {override!r}; known: {', '.join(sorted(PARSERS))}")
        return PARSERS[override]
    source = template_source or ""
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonParser
    if "SmolLM" in source:
        return SmolLM2Parser
    return HermesParser


def parse_tool_calls(parser_cls: type[ToolParser], text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output: its content (None when empty or blank) and its calls."""
    parser = parser_cls()
    content = parser.feed(text).content + parser.finish().content
    return (content if content.strip() else None), parser.calls

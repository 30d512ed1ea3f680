"""Tool-call parsers: what each family reads as calls and as content; the same output gives the same content, calls
and argument text however it is chunked; text is held back only while it may be a call; any text parses; the prompt
side (past calls, forced-call grammars) agrees with the parsers."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import llguidance
import pytest

from tokenmill.api.tools.parsers import PARSERS, ParsedDelta, ToolParser, choose_parser, parse_tool_calls

# (family, output, content, [(name, arguments text)]): what a whole output reads as.
CASES: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", '
     '"arguments": {"y": [1, {"z": "日本 ☃"}]}}\n</tool_call>\n\n<tool_call>{"name":"c","arguments":{}}</tool_call>\n',
     None, [("a", '{"x": 1}'), ("b", '{"y": [1, {"z": "日本 ☃"}]}'), ("c", "{}")]),
    ("hermes", r'<tool_call>{"name": "echo", "arguments": {"text": "say </tool_call> now \" <tool_call> \\"}}'
     "</tool_call>", None, [("echo", r'{"text": "say </tool_call> now \" <tool_call> \\"}')]),
    ("hermes", '<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>\n\nSo: '
     '<tool_call>{"name": "yes", "arguments": {"k": "v"}}</tool_call>',
     '<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>\n\nSo:', [("yes", '{"k": "v"}')]),
    ("hermes", '<tool_call>{"name": "first", "arguments": {"a": 1}}</tool_call><tool_call>{"arguments": {"late": '
     '[true, null]}, "name": "named_last"}</tool_call>', None, [("first", '{"a": 1}'),
                                                              ("named_last", '{"late": [true, null]}')]),
    ("hermes", "Just text: 1 < 2, <tool_x> and <think tags>.\n", "Just text: 1 < 2, <tool_x> and <think tags>.\n", []),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>\nDone.', "Done.", [("ping", "{}")]),
    ("hermes", 'Checking.\n<tool_call>{"name": "ping"}</tool_call>\n\nDone.', "Checking.\n\nDone.",
     [("ping", "{}")]),
    ("hermes", "Use <tool_call> tags like <tool_call>this</tool_call>.",
     "Use <tool_call> tags like <tool_call>this</tool_call>.", []),
    ("hermes", 'A <tool_call>{"city": "Paris"}</tool_call> B', 'A <tool_call>{"city": "Paris"}</tool_call> B', []),
    ("hermes", '<tool_call>{"name": 7, "arguments": {}}</tool_call>', '<tool_call>{"name": 7, "arguments": {}}'
     "</tool_call>", []),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"q": "half', None, [("cut", '{"q": "half')]),
    ("hermes", '<tool_call>\n{"id": 1, "name": "a", "arguments": {"n": -1.5e3}, "extra": true}\n</tool_call>',
     None, [("a", '{"n": -1.5e3}')]),
    ("smollm2", 'Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {"tz": "UTC"}}]</tool_call>', "Sure.", [("get_weather", '{"city": "Paris"}'),
                                                           ("get_time", '{"tz": "UTC"}')]),
    ("smollm2", 'Sure. <tool_call>[{"name": "now", "arguments": {}}]</tool_call> Bye.', "Sure. Bye.",
     [("now", "{}")]),
    ("smollm2", '<tool_call>{"name": "single", "arguments": {"q": "]</tool_call>"}}</tool_call>',
     None, [("single", '{"q": "]</tool_call>"}')]),
    ("smollm2", '<tool_call>[\n{"name": "a", "arguments": {"n": [[1], {"m": {}}]}},\n{"name": "b", "arguments": '
     '{"t": null}},\n{"name": "c", "arguments": {"u": "🎉 \\u00e9"}}\n]</tool_call>',
     None, [("a", '{"n": [[1], {"m": {}}]}'), ("b", '{"t": null}'), ("c", '{"u": "🎉 \\u00e9"}')]),
    ("smollm2", "<tool_call>[]</tool_call>", None, []),
    ("smollm2", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "; not a split"}};'
     '{"type": "function", "name": "c", "parameters": {"z": ["日本", {"w": []}]}}',
     None, [("a", '{"x": 1}'), ("b", '{"y": "; not a split"}'), ("c", '{"z": ["日本", {"w": []}]}')]),
    ("llama3_json", 'The answer is {"name": "not_a_call"} because a call opens the answer.',
     'The answer is {"name": "not_a_call"} because a call opens the answer.', []),
    ("llama3_json", '  {"name": "f", "arguments": {"k": [1, 2, 3]}}\n', None, [("f", '{"k": [1, 2, 3]}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather")', '<|python_tag|>brave_search.call('
     'query="weather")', []),
]
IDS = [f"{family}-{i}" for i, (family, *_) in enumerate(CASES)]


def streamed(parser_cls: type[ToolParser], pieces: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """Content, and each call's name and argument fragments, as a stream of these pieces gives them; checks the
    order of a stream's deltas on the way."""
    parser = parser_cls()
    content, calls = "", []
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        assert isinstance(delta, ParsedDelta)
        content += delta.content
        for d in delta.calls:
            if d.name is not None:  # a call's first delta: its index (the next one), its name, no arguments yet
                assert (d.index, d.arguments) == (len(calls), "")
                calls.append((d.name, []))
            else:  # then argument text only, for the call being written
                assert d.index == len(calls) - 1 and d.arguments
                calls[d.index][1].append(d.arguments)
    assert [(c.name, c.arguments) for c in parser.calls] == [(name, "".join(args)) for name, args in calls]
    return content, calls


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("family, text, content, calls", CASES, ids=IDS)
def test_what_each_family_reads(family: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got = parse_tool_calls(PARSERS[family], text)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)


@pytest.mark.parametrize("family, text, content, calls", CASES, ids=IDS)
def test_chunking_does_not_change_content_or_calls(family: str, text: str, content: str | None,
                                                   calls: list[tuple[str, str]]) -> None:
    whole_content, whole_calls = streamed(PARSERS[family], [text])
    assert (whole_content if whole_content.strip() else None) == content
    assert [(name, "".join(args)) for name, args in whole_calls] == calls
    for size in (1, 2, 3, 5, 8):
        got_content, got_calls = streamed(PARSERS[family], chunks(text, size))
        assert got_content == whole_content, size
        assert [(name, "".join(args)) for name, args in got_calls] == calls, size


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x }"], "b": {"c": "é"}}}\n</tool_call>',
    '<tool_call>{"arguments": {"a": [1, "x }"], "b": {"c": "é"}}, "name": "f"}</tool_call>',  # held till the name
    '<tool_call>{"name": "g"}</tool_call>\n<tool_call>{"arguments": {"a": [1, "x }"], "b": {"c": "é"}}, "name": "f"}',
])
def test_arguments_stream_as_they_are_written_once_the_name_is_known(text: str) -> None:
    args = '{"a": [1, "x }"], "b": {"c": "é"}}'
    start, name_end = text.index(args), text.index('"f"') + 3
    parser = PARSERS["hermes"]()
    sent = ""
    for n, ch in enumerate(text, 1):
        sent += "".join(d.arguments for d in parser.feed(ch).calls if parser.calls[d.index].name == "f")
        # everything of the arguments the text holds so far, as soon as the name's string is complete
        assert sent == (text[start:min(n, start + len(args))] if n >= name_end else ""), n
    parser.finish()
    assert sent == args


def test_content_is_held_back_only_while_it_may_begin_a_call() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("Hello <tool_").content == "Hello"  # the space too: it may only lead up to a call
    assert parser.feed("x> there <").content == " <tool_x> there"
    assert parser.feed("b>! <thi").content == " <b>!"
    assert parser.feed("nk>\n").content == " <think>\n"  # inside a think block only "</think>" is held
    assert parser.feed("hm </th").content == "hm "
    assert parser.feed("ink>\n").content == "</think>"
    assert parser.finish().content == "\n"  # trailing whitespace is content when no call follows

    parser = PARSERS["llama3_json"]()
    assert parser.feed(" <|python").content == ""
    assert parser.feed('_tag|>{"na').content == ""  # may yet be a call: held
    assert parser.feed('me": 1} !').content == ' <|python_tag|>{"name": 1} !'  # a name must be a string
    assert parser.feed(' {"name": "f"}').content == ' {"name": "f"}'  # only the answer's start can be a call


def test_whitespace_around_calls_is_content_only_between_text() -> None:
    """Text on both sides of a call keeps the whitespace the model wrote after the call between them (before:
    "Checking.Done"); whitespace that would lead or end the content, or lies between two calls, is none."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parser = PARSERS["hermes"]()
    assert parser.feed("Checking.\n\n").content == "Checking."
    delta = parser.feed(call + "\n\n")
    assert (delta.content, [d.name for d in delta.calls]) == ("", ["f", None])
    assert parser.feed("\n").content == ""
    assert parser.feed(" Done").content == "\n\n\n Done"
    for text, content in [(f"{call}\n Done", "Done"), (f"Checking.\n{call}\n", "Checking."),
                          (f"Checking.\n{call}\n{call} \nDone", "Checking. \nDone"),
                          (f"{call}\n{call}\n", None)]:
        got, calls = parse_tool_calls(PARSERS["hermes"], text)
        assert (got, len(calls)) == (content, text.count("<tool_call>")), text


def test_a_call_is_named_once_and_in_order() -> None:
    text = CASES[1][1]
    parser = PARSERS["hermes"]()
    deltas = [d for piece in chunks(text, 4) for d in parser.feed(piece).calls] + parser.finish().calls
    names = [(d.index, d.name) for d in deltas if d.name is not None]
    assert names == [(0, "a"), (1, "b"), (2, "c")]


# --- any text --------------------------------------------------------------------------------------------------

ALPHABET = list('{}[]",:;\\ \nab1é<>/') + ['"name"', '"arguments"', '"parameters"', "<tool_call>", "</tool_call>",
                                            "<think>", "</think>", "<|python_tag|>", '{"name": "f", "arguments": ']


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_any_text_parses_the_same_however_it_is_chunked(family: str) -> None:
    rng = random.Random(family)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(400)]
    texts += [text[:cut] for _, text, *_ in CASES for cut in range(len(text))]  # outputs cut off anywhere
    for text in texts:
        whole_content, whole_calls = streamed(PARSERS[family], [text])
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if text else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, calls = streamed(PARSERS[family], pieces)
        assert (content, [(n, "".join(a)) for n, a in calls]) == \
            (whole_content, [(n, "".join(a)) for n, a in whole_calls]), (text, pieces)


def test_choose_parser() -> None:
    assert choose_parser("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert choose_parser("{% if message.role == 'ipython' %}").name == "llama3_json"
    assert choose_parser("You are a helpful AI assistant named SmolLM").name == "smollm2"
    assert choose_parser("<tool_call>").name == choose_parser("{{ messages }}").name == choose_parser(None).name \
        == "hermes"
    assert choose_parser("You are SmolLM", "llama3_json").name == "llama3_json"  # other names: ServerConfig.check()


# --- the prompt side ---------------------------------------------------------------------------------------------

ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
        "required": ["sku", "qty"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {
            "type": "integer"}}, "opts": {"type": "object"}}, "required": ["city"], "additionalProperties": False}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                        "required": ["tz"]}},
    {"name": "ping"},
    # as pydantic writes a model with a nested one: a reference into the parameters' own definitions
    {"name": "order", "parameters": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "$ref": "#/$defs/Item"}}}, "required": ["items"], "$defs": {"Item": ITEM}}},
]
WEATHER = {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2], "opts": {"unit": "°C", "n": None}}}
TIME = {"name": "get_time", "arguments": '{"tz": "Europe/Rome"}'}  # the API's form: JSON text
PING = {"name": "ping", "arguments": {}}
ORDER = {"name": "order", "arguments": {"items": [{"sku": "a-1", "qty": 2}]}}


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_rendered_calls_read_back(family: str) -> None:
    cls = PARSERS[family]
    for calls in ([WEATHER], [WEATHER, TIME, PING, ORDER]):
        content, got = parse_tool_calls(cls, cls.render_calls(calls))
        expected = [(c["name"], c["arguments"] if isinstance(c["arguments"], dict) else json.loads(c["arguments"]))
                    for c in calls]
        assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == expected


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_tools_prompt_lists_the_tools_and_shows_the_format(family: str) -> None:
    prompt = PARSERS[family].tools_prompt(TOOLS)
    for tool in TOOLS:
        assert json.dumps({"type": "function", "function": tool}, ensure_ascii=False) in prompt
    key = "parameters" if family == "llama3_json" else "arguments"
    assert '"name": ' in prompt and f'"{key}": ' in prompt
    assert ("<tool_call>" in prompt) == (family != "llama3_json")
    assert ("<tool_call>[" in prompt) == (family == "smollm2")


SMOLLM = os.path.expanduser("~/.cache/tokenmill/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Any, llguidance.LLTokenizer]:
    if not os.path.exists(SMOLLM):
        pytest.skip(f"{SMOLLM} is absent")
    from tokenmill.loader.gguf import GGUFFile
    from tokenmill.loader.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(GGUFFile(SMOLLM).metadata)
    return tk, llguidance.LLTokenizer(tk.to_json(), n_vocab=tk.vocab_size, eos_token=sorted(tk.eos_token_ids))


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_forced_call_grammar_takes_valid_calls_only(family: str, tokenizers: tuple[Any, llguidance.LLTokenizer]
                                                    ) -> None:
    tk, lt = tokenizers
    cls = PARSERS[family]

    def accepts(grammar: str, calls: list[dict[str, Any]] | str) -> bool:
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        text = calls if isinstance(calls, str) else cls.render_calls(calls)
        return matcher.consume_tokens(tk.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    single, parallel = cls.call_grammar(TOOLS, parallel=False), cls.call_grammar(TOOLS, parallel=True)
    for grammar in (single, parallel, cls.call_grammar(TOOLS[1:2], parallel=False)):
        assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt) == (False, [])
    for call in (WEATHER, TIME, PING, ORDER):
        assert accepts(single, [call]) and accepts(parallel, [call]), call["name"]
    assert accepts(parallel, [WEATHER, TIME, ORDER])
    assert not accepts(single, [WEATHER, TIME])  # one call only
    assert not accepts(single, [{"name": "get_wether", "arguments": {"city": "x"}}])  # no such tool
    assert not accepts(single, [{"name": "get_time", "arguments": {"tz": 5}}])  # off the schema
    assert not accepts(single, [{"name": "get_time", "arguments": {}}])  # a required argument missing
    assert not accepts(single, [{"name": "order", "arguments": {"items": [{"sku": "a"}]}}])  # off the definitions
    assert not accepts(single, cls.render_calls([WEATHER]) + " ok")  # nothing after the call
    key = "parameters" if family == "llama3_json" else "arguments"
    ping = cls.render_calls([PING])
    assert accepts(single, ping.replace(": {}", ":  \n\t{}"))  # a little whitespace
    assert not accepts(single, ping.replace(": {}", ":" + " " * 40 + "{}"))  # but not without end
    assert not accepts(single, ping.replace(f', "{key}": {{}}', ""))  # arguments are required, after the name
    assert not accepts(single, ping.replace(f'"name": "ping", "{key}": {{}}', f'"{key}": {{}}, "name": "ping"'))
    assert not accepts(single, ping.replace("{}", '{"extra": 1}'))  # a tool without parameters takes none
    assert not accepts(single, ping.replace("{}}", '{}, "id": 1}'))  # a call is its name and arguments only
    assert not accepts(cls.call_grammar(TOOLS[1:2], parallel=False), [WEATHER])  # a named choice: that tool only

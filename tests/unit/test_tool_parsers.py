"""Tool-call parsers: the same output gives the same content and calls however it is chunked; the delimiters are
read the way each family writes them; the prompt side (past calls, forced-call grammars) round-trips."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import pytest

from tokenmill.api.tool_parsers import PARSERS, ToolParser, choose_parser, parse_tool_calls
from tokenmill.loader.gguf import GGUFFile
from tokenmill.loader.tokenizer import Tokenizer

CALL_A = {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "opts": {"unit": "°C"}}}
CALL_B = {"name": "get_time", "arguments": {"tz": "Europe/Rome"}}

OUTPUTS = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
        '{"y": [1, {"z": "日本"}]}}\n</tool_call>\n<tool_call>{"name":"c","arguments":{}}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": {"text": "say </tool_call> now \\" <tool_call>"}}</tool_call>',
        '<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call></think>Plain answer, no call.',
        '<tool_call>{"arguments": {"late": true}, "name": "named_last"}</tool_call>',
        "Just text with a < sign and <tool_x tags.",
    ],
    "smollm2": [
        'Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
        '"arguments": {"tz": "UTC"}}]</tool_call>',
        '<tool_call>{"name": "single", "arguments": {"q": "]</tool_call>"}}</tool_call>',
        '<tool_call>[{"name": "a", "arguments": {"n": -1.5e3}}, {"name": "b", "arguments": {"t": null}}, '
        '{"name": "c", "arguments": {"u": "🎉"}}]</tool_call>',
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "; not a split"}}',
        'The answer is {"name": "not_a_call"} because it does not open the output.',
        '  {"name": "f", "arguments": {"k": [1, 2, 3]}}',
    ],
}
CASES = [(family, text) for family, texts in OUTPUTS.items() for text in texts]


def streamed(parser_cls: type[ToolParser], text: str, size: int) -> tuple[str, dict[int, dict]]:
    parser = parser_cls()
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for d in delta.calls:
            if d.index not in calls:
                assert d.name is not None and d.arguments == "" and d.index == len(calls)
                calls[d.index] = {"name": d.name, "arguments": ""}
            else:
                assert d.name is None
                calls[d.index]["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("family, text", CASES)
def test_chunking_does_not_change_content_or_calls(family: str, text: str) -> None:
    whole_content, whole_calls = parse_tool_calls(PARSERS[family], text)
    expected = {i: {"name": c.name, "arguments": c.arguments} for i, c in enumerate(whole_calls)}
    for size in (1, 2, 3, 5, 8, len(text)):
        content, calls = streamed(PARSERS[family], text, size)
        assert (content if content.strip() else None) == whole_content, size
        assert calls == expected, size


@pytest.mark.parametrize("family, text, content, calls", [
    ("hermes", OUTPUTS["hermes"][0], "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", OUTPUTS["hermes"][1], None, [("a", {"x": 1}), ("b", {"y": [1, {"z": "日本"}]}), ("c", {})]),
    ("hermes", OUTPUTS["hermes"][2], None, [("echo", {"text": 'say </tool_call> now " <tool_call>'})]),
    ("hermes", OUTPUTS["hermes"][3], OUTPUTS["hermes"][3], []),
    ("hermes", OUTPUTS["hermes"][4], None, [("named_last", {"late": True})]),
    ("hermes", OUTPUTS["hermes"][5], OUTPUTS["hermes"][5], []),
    ("smollm2", OUTPUTS["smollm2"][0], "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ("smollm2", OUTPUTS["smollm2"][1], None, [("single", {"q": "]</tool_call>"})]),
    ("llama3_json", OUTPUTS["llama3_json"][0], None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", OUTPUTS["llama3_json"][1], None, [("a", {"x": 1}), ("b", {"y": "; not a split"})]),
    ("llama3_json", OUTPUTS["llama3_json"][2], OUTPUTS["llama3_json"][2], []),
    ("llama3_json", OUTPUTS["llama3_json"][3], None, [("f", {"k": [1, 2, 3]})]),
])
def test_what_each_family_reads(family: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_tool_calls(PARSERS[family], text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_arguments_stream_before_the_call_ends() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("<tool_call>\n{\"name\": \"f\", ").calls[0].name == "f"
    assert [d.arguments for d in parser.feed('"arguments": {"text": "hel').calls] == ['{"text": "hel']
    assert [d.arguments for d in parser.feed('lo"}}\n</tool_call>').calls] == ['lo"}']


def test_a_partial_tag_is_held_back_and_released() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("Hello <tool_").content == "Hello"
    assert parser.feed("x> there").content == " <tool_x> there"


def test_a_call_without_arguments_gets_an_empty_object() -> None:
    assert [(c.name, c.arguments) for c in parse_tool_calls(PARSERS["hermes"], '<tool_call>{"name": "ping"}'
                                                                              "</tool_call>")[1]] == [("ping", "{}")]


def test_any_text_parses_without_error() -> None:
    rng = random.Random(0)
    alphabet = list('{}[]",:;\\ \nab<>/') + ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    texts += [text[:cut] for _, text in CASES for cut in range(0, len(text), 7)]
    for family, parser_cls in PARSERS.items():
        for text in texts:
            content, calls = parse_tool_calls(parser_cls, text)
            assert content is None or isinstance(content, str)
            assert all(isinstance(c.name, str) and isinstance(c.arguments, str) for c in calls), family


def test_choose_parser() -> None:
    assert choose_parser("...<|python_tag|>...").name == "llama3_json"
    assert choose_parser("You are SmolLM").name == "smollm2"
    assert choose_parser("<tool_call>").name == choose_parser(None).name == "hermes"
    assert choose_parser("You are SmolLM", "hermes").name == "hermes"
    with pytest.raises(ValueError, match="known: hermes, llama3_json, smollm2"):
        choose_parser(None, "nope")


# --- the prompt side --------------------------------------------------------------------------------------------

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}},
        "opts": {"type": "object"}}, "required": ["city"]}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                        "required": ["tz"]}},
]


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_rendered_calls_read_back(family: str) -> None:
    text = PARSERS[family].render_calls([CALL_A, {**CALL_B, "arguments": json.dumps(CALL_B["arguments"])}])
    _, calls = parse_tool_calls(PARSERS[family], text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(CALL_A["name"], CALL_A["arguments"]),
                                                                  (CALL_B["name"], CALL_B["arguments"])]
    assert "get_weather" in PARSERS[family].tools_prompt(TOOLS)


@pytest.fixture(scope="module")
def tokenizers(smollm_path: Path) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tk = Tokenizer.from_gguf(GGUFFile(smollm_path).metadata)
    return tk, llguidance.LLTokenizer(tk.to_json(), n_vocab=tk.vocab_size, eos_token=sorted(tk.eos_token_ids))


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_forced_call_grammar_accepts_valid_calls_only(family: str, tokenizers) -> None:
    tk, lt = tokenizers
    cls = PARSERS[family]

    def accepts(grammar: str, calls: list[dict]) -> bool:
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tk.encode(cls.render_calls(calls), add_special_tokens=False)) and \
            matcher.is_accepting()

    single, parallel = cls.call_grammar(TOOLS, parallel=False), cls.call_grammar(TOOLS, parallel=True)
    assert accepts(single, [CALL_A]) and accepts(single, [CALL_B])
    assert accepts(parallel, [CALL_A, CALL_B])
    assert not accepts(single, [CALL_A, CALL_B])  # one call only
    assert not accepts(single, [{"name": "unknown", "arguments": {"city": "x"}}])
    assert not accepts(single, [{"name": "get_time", "arguments": {"tz": 5}}])  # arguments off the schema
    assert not accepts(cls.call_grammar(TOOLS[1:], parallel=False), [CALL_A])  # a named choice: that tool only

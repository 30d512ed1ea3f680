"""Structured output's core: request forms -> spec, the llguidance backend's masks and state, the sampler applying
masks to constrained rows only, the scheduler advancing grammars. On the tiny byte-level vocabulary, where token
i < 256 is byte i, so masks are easy to read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_TOKENS

from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.config import EngineConfig
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import ScheduledSequence, Scheduler
from tokenmill.errors import RequestError
from tokenmill.loader.gguf import GGUFFile
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling import SamplingParams
from tokenmill.structured import StructuredSpec
from tokenmill.structured.backend import GrammarCompiler

EOS = TINY_TOKENS.index("<|endoftext|>")
ROWS = len(TINY_TOKENS) + 5  # the model has more output rows than the tokenizer has tokens


@pytest.fixture(scope="module")
def compiler(tiny_gguf: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_gguf(GGUFFile(tiny_gguf).metadata)
    return GrammarCompiler(tokenizer.to_json(), ROWS, {EOS})


def allowed(compiler: GrammarCompiler, spec: StructuredSpec, prefix: bytes = b"") -> set[int]:
    grammar = compiler.compile(spec, "test").new()
    for byte in prefix:
        assert grammar.accept(byte)
    return set(torch.nonzero(compiler.fill_masks([grammar])[0]).flatten().tolist())


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


# --- request forms ---------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json",
     "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json", "structured_outputs.json_object"),
    ({"guided_json": '{"type": "integer"}'}, "json", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, "grammar", "guided_grammar"),
])
def test_every_request_form_gives_its_spec(fields: dict, kind: str, param: str) -> None:
    spec, named = chat(**fields).structured_spec()  # type: ignore[misc]
    assert (spec.kind, named) == (kind, param)
    completion = CompletionRequest(model="m", prompt="p", **fields).structured_spec()
    assert completion is not None and completion[0] == spec


def test_no_constraint_is_free_text() -> None:
    assert chat().structured_spec() is None
    assert chat(response_format={"type": "text"}).structured_spec() is None


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_contradictory_or_malformed_constraints_are_refused(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as caught:
        chat(**fields).structured_spec()
    assert caught.value.param == param


# --- the backend ---------------------------------------------------------------------------------------------

def test_choice_mask_allows_exactly_the_next_bytes(compiler: GrammarCompiler) -> None:
    spec = StructuredSpec("choice", '["yes", "no", "yak"]')
    assert allowed(compiler, spec) == {ord("y"), ord("n")}
    assert allowed(compiler, spec, b"y") == {ord("e"), ord("a")}
    assert allowed(compiler, spec, b"yes") == {EOS}  # complete: only the end token (no rows past the tokenizer)


def test_json_schema_mask_follows_the_schema(compiler: GrammarCompiler) -> None:
    spec = StructuredSpec("json", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    assert allowed(compiler, spec, b'{"n":') >= {ord(str(d)) for d in range(1, 10)} | {ord("-")}
    assert not allowed(compiler, spec, b'{"n":') & {ord("a"), ord('"'), ord("}")}
    assert EOS in allowed(compiler, spec, b'{"n":12}')


def test_json_whitespace_is_bounded(compiler: GrammarCompiler) -> None:
    spec = StructuredSpec("json", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    assert ord(" ") in allowed(compiler, spec, b"{" + b" " * 15)
    assert ord(" ") not in allowed(compiler, spec, b"{" + b" " * 16)


def test_accept_rollback_and_end(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredSpec("regex", "ab"), "test").new()
    assert grammar.accept(ord("a")) and not grammar.ended
    grammar.rollback(1)
    assert set(torch.nonzero(compiler.fill_masks([grammar])[0]).flatten().tolist()) == {ord("a")}
    assert grammar.accept(ord("a")) and grammar.accept(ord("b")) and grammar.ended
    assert not compiler.compile(StructuredSpec("regex", "ab"), "test").new().ended  # copies never share state


def test_masks_of_a_batch_are_each_their_own(compiler: GrammarCompiler) -> None:
    a = compiler.compile(StructuredSpec("regex", "a"), "t").new()
    b = compiler.compile(StructuredSpec("regex", "b"), "t").new()
    masks = compiler.fill_masks([a, b, compiler.compile(StructuredSpec("regex", "a"), "t").new()])
    assert masks.shape == (3, ROWS) and masks.dtype == torch.bool
    assert [torch.nonzero(m).flatten().tolist() for m in masks] == [[ord("a")], [ord("b")], [ord("a")]]


def test_compiles_are_cached_by_spec(compiler: GrammarCompiler) -> None:
    spec = StructuredSpec("regex", "[0-9]+")
    assert compiler.compile(spec, "t") is compiler.compile(StructuredSpec("regex", "[0-9]+"), "t")
    assert compiler.compile(spec, "t") is not compiler.compile(StructuredSpec("regex", "[0-9]*"), "t")


@pytest.mark.parametrize("spec", [
    StructuredSpec("regex", "a(b"),
    StructuredSpec("json", '{"type": "strin"}'),
    StructuredSpec("json", '{"type": "array", "uniqueItems": true}'),  # would be dropped: refused instead
    StructuredSpec("json", '{"type": "string", "format": "no-such-format"}'),
    StructuredSpec("grammar", "root ::= undefined_rule"),
    StructuredSpec("grammar", "this is not a grammar"),
])
def test_what_does_not_compile_is_a_request_error_naming_the_field(compiler: GrammarCompiler,
                                                                  spec: StructuredSpec) -> None:
    with pytest.raises(RequestError) as caught:
        compiler.compile(spec, "response_format")
    assert caught.value.param == "response_format" and caught.value.message.startswith("response_format: ")


def test_gbnf_and_lark_grammars_both_compile(compiler: GrammarCompiler) -> None:
    assert allowed(compiler, StructuredSpec("grammar", 'root ::= "x" [0-9]')) == {ord("x")}
    assert allowed(compiler, StructuredSpec("grammar", 'start: "x" /[0-9]/')) == {ord("x")}


# --- the sampler and the scheduler ---------------------------------------------------------------------------

def seq(compiler: GrammarCompiler | None, spec: StructuredSpec | None, seq_id: int = 0, **params) -> Sequence:
    grammar = compiler.compile(spec, "t").new() if compiler and spec else None
    return Sequence(seq_id=seq_id, prompt_ids=[1, 2], params=SamplingParams(**{"max_tokens": 50, **params}),
                    detokenizer=None, sink=lambda _: None, grammar=grammar)  # type: ignore[arg-type]


def test_sampler_masks_constrained_rows_only(compiler: GrammarCompiler) -> None:
    sampler = Sampler({EOS}, torch.device("cpu"), 0, compiler)
    logits = torch.randn(3, ROWS, generator=torch.Generator().manual_seed(0))
    logits[:, ord("z")] = 50.0  # every row's favourite, which the grammar forbids
    seqs = [seq(None, None, 0, temperature=0), seq(compiler, StructuredSpec("choice", '["a", "b"]'), 1, temperature=0),
            seq(None, None, 2, temperature=1.0, seed=1)]
    tokens, _ = sampler(logits.clone(), seqs)
    assert tokens[0] == ord("z") and tokens[2] == ord("z")
    assert tokens[1] == max((ord("a"), ord("b")), key=lambda t: logits[1, t].item())
    for temperature in (0.7, 1.5):  # sampled, not only greedy, stays inside the mask
        s = seq(compiler, StructuredSpec("choice", '["a", "b"]'), 3, temperature=temperature, seed=2)
        assert {sampler(logits[1:2].clone(), [s])[0][0] for _ in range(30)} <= {ord("a"), ord("b")}


def test_min_tokens_gives_way_to_an_ended_grammar(compiler: GrammarCompiler) -> None:
    sampler = Sampler({EOS}, torch.device("cpu"), 0, compiler)
    s = seq(compiler, StructuredSpec("regex", "a"), min_tokens=5, temperature=0)
    assert s.grammar is not None and s.grammar.accept(ord("a"))
    s.output_ids.append(ord("a"))
    assert sampler(torch.zeros(1, ROWS), [s])[0] == [EOS]  # not a row of -inf, not a token outside the grammar


class _NoKV:
    def reserve(self, *args) -> bool:
        return True

    def free(self, *args) -> None: ...
    def match_prefix(self, *args) -> int:
        return 0

    def cache(self, *args) -> None: ...


def test_scheduler_advances_the_grammar_and_an_ended_grammar_stops_even_with_ignore_eos(
        compiler: GrammarCompiler) -> None:
    scheduler = Scheduler(EngineConfig(), _NoKV(), 100, {EOS})
    s = seq(compiler, StructuredSpec("regex", "ab"), ignore_eos=True)
    scheduler.add(s)
    plan = scheduler.schedule()
    scheduler.update(plan, [[ord("a")]])
    assert s.grammar is not None and not s.grammar.ended
    scheduler.update([ScheduledSequence(s, 1)], [[ord("b")]])
    assert s.grammar.ended and s.finish_reason is None
    scheduler.update([ScheduledSequence(s, 1)], [[EOS]])
    assert s.finish_reason == "stop"

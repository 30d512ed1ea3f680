"""Speculative decoding beside structured output, on the real model: a grammar's sequence is never offered
proposals (its masks follow accepted tokens only), so its text matches the grammar and is the text plain decoding
gives, while an unconstrained neighbour in the same batch still speculates."""

from __future__ import annotations

import asyncio
import re

import pytest
from helpers import assert_no_live_blocks, counted, start_engine

from tokenmill.api.engine_client import EngineClient
from tokenmill.engine.engine import Engine
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams
from tokenmill.structured import StructuredSpec

pytestmark = pytest.mark.slow

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
# What the answer must be: the code copied (which prompt lookup proposes, token for token), one function or two.
FUNCTIONS = r"(def [a-z]+\(a, b\):\n    return a [-+*] b\n\n\n)?def [a-z]+\(a, b\):\n    return a [-+*] b\n"


def answers(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[str, str]:
    """The texts of one request with the grammar and one without, run in the same steps."""
    grammar = engine.grammars.compile(StructuredSpec("regex", FUNCTIONS), "regex")

    async def text(constrained: bool) -> str:
        stream = EngineClient(engine).submit([prompt], params, grammar=grammar if constrained else None)[0]
        return "".join([out.text async for out in stream])

    async def both() -> list[str]:
        return list(await asyncio.gather(text(True), text(False)))

    constrained, free = asyncio.run(both())
    return constrained, free


def test_a_grammar_constrained_answer_copying_its_prompt_matches_the_grammar_under_prompt_lookup(
        smollm_exact: LoadedModel) -> None:
    """The prompt holds the code the answer copies, so prompt lookup has proposals for it at every step."""
    prompt = smollm_exact.tokenizer.encode(f"<|im_start|>user\nRepeat this code exactly:\n{CODE}<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=60, temperature=0.0)
    texts = {}
    for speculative in (None, "ngram"):
        engine = start_engine(smollm_exact, speculative=speculative, speculative_max_seqs=8, prefix_caching=False)
        try:
            texts[speculative] = answers(engine, prompt, params)
            assert_no_live_blocks(engine)
            if speculative:  # the unconstrained twin did speculate, and had proposals accepted
                assert counted(engine.metrics.spec_accepted_tokens) > 10
        finally:
            engine.stop()
    constrained, free = texts["ngram"]
    assert re.fullmatch(FUNCTIONS, constrained), constrained
    assert texts[None] == texts["ngram"]  # greedy: speculation changes no token, with the grammar or without
    assert constrained == CODE

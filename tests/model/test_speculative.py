"""Speculative decoding (n-gram prompt lookup; the suffix cache and a draft model where named) on the real model,
fp32: the tokens are those of plain decoding, greedy and seeded sampling alike, alone and in a batch, with stops,
limits, logprobs, aborts and preemption. In deterministic mode (`smollm_exact`) a proposal's verified rows are the
bits plain decoding computes, logprobs and all; the default kernels' proposals (a many-row pass) are checked on the
dense reference, within fp32's rounding."""

from __future__ import annotations

import asyncio

import pytest
from helpers import add_and_abort, assert_no_live_blocks, counted, start_engine, submit

from tokenmill.engine.engine import Engine
from tokenmill.engine.runner import ModelRunner
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

pytestmark = pytest.mark.slow

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
        "    return a * b\n")
TASKS = ["Rewrite this code, renaming {} to plus:", "Repeat this code exactly, then say {}:",
         "Add a docstring to each function below, and call the module {}:", "Copy the code and rename b to {}:"]
NAMES = ["add", "done", "calc", "y"]


def chat(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(f"<|im_start|>user\n{text}\n{CODE}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def model(smollm_exact: LoadedModel) -> LoadedModel:
    return smollm_exact


@pytest.fixture(scope="module")
def prompts(model: LoadedModel) -> list[list[int]]:
    """16 requests whose answers copy from their prompts (where proposals get accepted); every other one, each
    task, runs alone below."""
    return [chat(model, task.format(name)) for task in TASKS for name in NAMES]


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Each sequence's (token ids, text, finish reason, logprob entries' token ids, their logprobs). A proposal's
    logits come from a multi-token pass, not the decode kernel: outside deterministic mode, fp32 values a few ulps
    apart (same())."""
    async def one(ids: list[int], p: SamplingParams) -> tuple:
        tokens, text, logprobs, reason = [], "", [], None
        async for out in submit(engine, ids, p):
            tokens += out.token_ids
            text += out.text
            logprobs += [(lp.token_id, lp.logprob) for lp in out.logprobs]
            reason = out.finish_reason
        return tokens, text, reason, [t for t, _ in logprobs], [v for _, v in logprobs]

    async def every() -> list[tuple]:
        return list(await asyncio.gather(*(one(ids, p) for ids, p in zip(prompts, params, strict=True))))

    return asyncio.run(every())


PLAIN: dict[str, list[tuple]] = {}  # plain decoding's outputs, by what made them: tests that ask the same share them


def both(loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams], one_at_a_time: bool,
         speculative: str = "ngram", draft_model: str | None = None, **config) -> tuple[list[tuple], list[tuple],
                                                                                     Engine]:
    """The outputs without and with speculation (and the speculating engine, stopped, for its counters)."""
    results = []
    key = repr((id(loaded), prompts, params, one_at_a_time, sorted(config.items())))
    for spec in (None, speculative):
        if spec is None and key in PLAIN:
            results.append(PLAIN[key])
            continue
        engine = start_engine(loaded, speculative=spec, draft_model=draft_model if spec else None,
                              speculative_max_seqs=8, prefix_caching=False, **config)
        try:
            if one_at_a_time:
                results.append([run(engine, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)])
            else:
                results.append(run(engine, prompts, params))
            assert_no_live_blocks(engine)
        finally:
            engine.stop()
    PLAIN[key] = results[0]
    return results[0], results[1], engine


def same(plain: list[tuple], spec: list[tuple], loaded: LoadedModel) -> bool:
    """Equal outputs; logprobs equal in deterministic mode, else within 1e-4."""
    tolerance = 0 if loaded.deterministic else 1e-4
    return [r[:4] for r in plain] == [r[:4] for r in spec] and all(
        abs(a - b) <= tolerance for p, s in zip(plain, spec, strict=True) for a, b in zip(p[4], s[4], strict=True))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 24), temperature=0.0, **kwargs)


def test_greedy_tokens_are_those_of_plain_decoding_alone_and_in_a_batch(model, prompts, monkeypatch) -> None:
    """Also: each token runs through the model once (an accepted proposal's KV is kept, not recomputed)."""
    computed = []
    run_step = ModelRunner.run

    def counting(self, plan):
        computed.append(sum(item.num_tokens for item in plan))
        return run_step(self, plan)

    monkeypatch.setattr(ModelRunner, "run", counting)
    plain, spec, engine = both(model, prompts[::2], [greedy(ignore_eos=True)] * 8, one_at_a_time=True)
    assert same(plain, spec, model)
    accepted, proposed = counted(engine.metrics.spec_accepted_tokens), counted(engine.metrics.spec_draft_tokens)
    assert accepted > 50 and proposed > accepted  # it speculated, and missed too
    # No prefix cache in play: each engine runs every prompt token and every output token but the last once, and
    # the speculating one its rejected proposals besides.
    once = sum(len(p) + len(r[0]) - 1 for p, r in zip(prompts[::2], spec, strict=True))
    assert sum(computed) == 2 * once + proposed - accepted
    plain, spec, _ = both(model, prompts[:8], [greedy()] * 8, one_at_a_time=False)
    assert same(plain, spec, model)


def test_the_default_kernels_verify_to_the_tokens_of_plain_decoding(smollm, prompts) -> None:
    """Outside deterministic mode a step's proposals run the many-row path (the library's matmuls, the prefill
    attention over the sequence's cached keys) where plain decoding runs the decode kernels: on the dense fp32
    reference, the same tokens and logprobs within fp32's rounding, alone and in a batch."""
    params = [greedy(max_tokens=16, ignore_eos=True, logprobs=1)] * 4
    plain, spec, engine = both(smollm, prompts[::4], params, one_at_a_time=True)
    assert same(plain, spec, smollm) and counted(engine.metrics.spec_accepted_tokens) > 10
    plain, spec, engine = both(smollm, prompts[:4], params, one_at_a_time=False)
    assert same(plain, spec, smollm) and counted(engine.metrics.spec_accepted_tokens) > 10


@pytest.mark.parametrize("speculative", ["suffix", "draft"])
def test_the_other_proposers_keep_the_tokens_of_plain_decoding(model, smollm_path, prompts, speculative) -> None:
    """8 prompts alone and 8 in a batch, as for prompt lookup above. The suffix cache: the earlier requests'
    answers propose too. The draft: the model's own GGUF, loaded with the model's weight options (as a server loads
    a draft), has nearly every guess accepted (a miss: a near tie its rounding breaks the other way)."""
    draft = str(smollm_path) if speculative == "draft" else None
    plain, spec, engine = both(model, prompts[::2], [greedy(ignore_eos=True)] * 8, one_at_a_time=True,
                               speculative=speculative, draft_model=draft)
    assert same(plain, spec, model)
    accepted, proposed = counted(engine.metrics.spec_accepted_tokens), counted(engine.metrics.spec_draft_tokens)
    assert accepted > 50
    if draft:
        assert proposed > 100 and accepted / proposed > 0.85  # measured 142 of 153, 0.93 (a bf16 draft, dense target)
    plain, spec, _ = both(model, prompts[:8], [greedy()] * 8, one_at_a_time=False, speculative=speculative,
                          draft_model=draft)
    assert same(plain, spec, model)


def test_seeded_sampling_draws_the_same_tokens(model, prompts) -> None:
    """Each position is sampled as plain decoding samples it, one draw from the request's stream per token, with
    penalties counting the tokens accepted earlier in the step: the same seed gives the same tokens."""
    params = [SamplingParams(max_tokens=32, temperature=0.5, top_p=0.95, seed=i, logprobs=2,
                             frequency_penalty=0.2 * (i % 2), repetition_penalty=1.05 if i % 2 else 1.0)
              for i in range(4)]
    plain, spec, engine = both(model, prompts[:4], params, one_at_a_time=True)
    assert same(plain, spec, model)
    assert counted(engine.metrics.spec_accepted_tokens) > 10


def test_stops_and_limits_inside_an_accepted_run(model, prompts) -> None:
    """A stop string, a stop token and max_tokens that fall inside a run of accepted proposals end the sequence
    there, as they would have without speculation (text, finish reason and logprobs alike); penalties count the
    tokens accepted earlier in the step."""
    stop_token = model.tokenizer.encode(" return", add_special_tokens=False)[0]
    params = [greedy(stop=["sub"], max_tokens=40), greedy(stop_token_ids=[stop_token], logprobs=1),
              greedy(max_tokens=13), greedy(max_tokens=3, logprobs=0), greedy(stop=["b\n"], max_tokens=40),
              greedy(presence_penalty=1.5, frequency_penalty=0.5), greedy(repetition_penalty=1.5)]
    plain, spec, engine = both(model, [prompts[5]] * len(params), params, one_at_a_time=True)
    assert same(plain, spec, model) and counted(engine.metrics.spec_accepted_tokens) > 10
    assert [r[2] for r in spec][:5] == ["stop", "stop", "length", "length", "stop"]
    # A prompt the answer copies, so the stop strings fall inside a run accepted whole: the tokens after the stop
    # once came out, with the stop string cut from the middle of the text. min_tokens holds stop strings back.
    fox = model.tokenizer.encode("Repeat after me three times: the quick brown fox jumps over the lazy dog. The "
                                 "quick brown fox jumps over the lazy dog. The quick brown fox")
    params = [greedy(stop=[" over"], logprobs=0), greedy(stop=["lazy"]), greedy(stop=["dog"], logprobs=0),
              greedy(stop=["lazy"], min_tokens=12, max_tokens=12)]
    plain, spec, engine = both(model, [fox] * len(params), params, one_at_a_time=True)
    assert same(plain, spec, model) and counted(engine.metrics.spec_accepted_tokens) > 4
    assert [r[1] for r in spec][:3] == [" jumps", " jumps over the ", " jumps over the lazy "]
    assert "lazy dog" in spec[3][1] and len(spec[3][0]) == 12 and spec[3][2] == "length"


def test_aborts_and_preemption_leave_no_block_behind(model, prompts) -> None:
    """200 speculative streams aborted at random points, then a pool so small that sequences with proposals are
    preempted and recomputed: every block comes back, and the preempted answers are the plain ones."""
    engine = start_engine(model, speculative="ngram", speculative_max_seqs=8)
    try:
        add_and_abort(engine, prompts, greedy(max_tokens=40))
        assert_no_live_blocks(engine)
    finally:
        engine.stop()
    params = [greedy(max_tokens=40)] * 4
    plain, spec, engine = both(model, prompts[:4], params, one_at_a_time=False,
                               kv_cache_memory=str(14 * 16 * 46080))  # 14 blocks: 4 answers of ~8 take turns
    assert same(plain, spec, model)
    assert counted(engine.metrics.preemptions) > 0 and counted(engine.metrics.spec_accepted_tokens) > 0



def test_the_suffix_cache_proposes_a_repeated_request_its_earlier_answer(model) -> None:
    """A request repeated (an agent's retry, an extraction run again) whose answer its prompt does not hold: prompt
    lookup finds little, the suffix cache the whole earlier answer; the tokens stay those of plain decoding."""
    prompt = model.tokenizer.encode("<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    accepted = {}
    answers = []
    for spec in (None, "ngram", "suffix"):
        engine = start_engine(model, speculative=spec, prefix_caching=False)
        try:
            first = run(engine, [prompt], [greedy(max_tokens=40, ignore_eos=True)])[0]
            before = counted(engine.metrics.spec_accepted_tokens)
            answers += [first, run(engine, [prompt], [greedy(max_tokens=40, ignore_eos=True)])[0]]
            accepted[spec] = counted(engine.metrics.spec_accepted_tokens) - before  # in the second run
        finally:
            engine.stop()
    assert all(same([answers[0]], [a], model) for a in answers[1:])
    # of the second answer's 40 tokens (at most 31: up to 4 accepted a step; measured 29 and 3)
    assert accepted["suffix"] >= 25 and accepted["ngram"] < 15

"""The engine's loop on the tiny random model, fast enough to run per mutant (scripts/mutate.py engine): what it
reports of itself, admission and counts, aborts and shutdown, failures that end one sequence and not the loop, the
output side (stop strings, end tokens, logprobs, prompt logprobs, embeddings) and speculation's bookkeeping, with
proposals from an oracle that knows plain decoding's tokens (the random model repeats nothing prompt lookup could
find)."""

from __future__ import annotations

import gc
import logging
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from helpers import assert_no_live_blocks, counted, generate, start_engine

from tokenmill import __version__, kernels
from tokenmill.config import WeightPlan
from tokenmill.engine import builder as builder_module
from tokenmill.engine import engine as engine_module
from tokenmill.engine import output as output_module
from tokenmill.engine.engine import Engine
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request import Sequence, SequenceOutput
from tokenmill.engine.spec import NgramProposer, SuffixCacheProposer
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

EOS, IM_END = 256, 258
PROMPT = [1, 2, 3, 4, 5]
PROMPTS = [PROMPT, [7, 8, 9], list(range(40, 90))]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **kwargs})


class Collector:
    """A sink: every output of one sequence, and an event set by its last."""

    def __init__(self) -> None:
        self.outputs: list[SequenceOutput] = []
        self.done = threading.Event()

    def __call__(self, out: SequenceOutput) -> None:
        self.outputs.append(out)
        if out.finish_reason is not None:
            self.done.set()

    def wait(self, engine: Engine | None = None) -> list[SequenceOutput]:
        """Its outputs once it finished; fails at once if the engine's loop died meanwhile."""
        deadline = time.monotonic() + 10
        while not self.done.wait(0.02):
            assert engine is None or engine.alive or self.done.is_set(), "the engine's loop died"
            assert time.monotonic() < deadline, "the sequence never finished"
        return self.outputs

    @property
    def tokens(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def text(self) -> str:
        return "".join(out.text for out in self.outputs)

    @property
    def last(self) -> SequenceOutput:
        return self.outputs[-1]


def logged(caplog: pytest.LogCaptureFixture, head: str, error: str) -> bool:
    """Whether a record says head, then the traceback of error."""
    return any(m.startswith(f"{head}\nTraceback (most recent call last):") and m.rstrip().endswith(error)
               for m in caplog.messages)


def run(engine: Engine, prompt: list[int], params: SamplingParams, **kwargs) -> Collector:
    """One sequence through engine.add, waited for."""
    sink = Collector()
    engine.add(prompt, params, sink, **kwargs)
    sink.wait(engine)
    return sink


@pytest.fixture
def engine(tiny4k: LoadedModel):
    engine = start_engine(tiny4k)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def plain(tiny4k: LoadedModel) -> list[list[int]]:
    """Plain greedy decoding's 40 tokens after each of PROMPTS (ignoring end tokens)."""
    engine = start_engine(tiny4k)
    try:
        return generate(engine, PROMPTS, [greedy(max_tokens=40)] * len(PROMPTS), timeout=10)
    finally:
        engine.stop()


class Oracle:
    """A proposer that knows what plain greedy decoding gives after each prompt: its proposals are right (or wrong
    from position `wrong_at` of each on), and it records what it was asked."""

    def __init__(self, plain: dict[tuple[int, ...], list[int]], wrong_at: int | None = None) -> None:
        self.plain = plain
        self.wrong_at = wrong_at
        self.asked: list[tuple[int, int]] = []  # (seq id, k)
        self.at_once: list[int] = []  # how many sequences each step asked for
        self.finished: list[int] = []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        if seqs:
            self.at_once.append(len(seqs))
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            self.asked.append((seq.seq_id, k))
            answer = self.plain.get(tuple(seq.prompt_ids), [])
            draft = answer[len(seq.output_ids):len(seq.output_ids) + k]
            if self.wrong_at is not None:
                draft = draft[:self.wrong_at] + [(t + 1) % 256 for t in draft[self.wrong_at:]]
            drafts.append(draft)
        return drafts

    def finish(self, seq: Sequence) -> None:
        self.finished.append(seq.seq_id)


# --- what the engine reports of itself ------------------------------------------------------------------------------


def test_an_engine_reports_its_model_context_and_fingerprint(engine: Engine, tiny4k: LoadedModel) -> None:
    assert engine.alive and engine.max_model_len == 4096 and engine.hidden_size == 64
    assert engine.model_path == tiny4k.path and engine.tokenizer is tiny4k.tokenizer
    assert engine.chat_template == tiny4k.chat_template
    assert engine.system_fingerprint == f"tokenmill-{__version__}-float32"
    assert engine.proposer is None and engine.runner.graphs is None
    assert engine.num_unfinished == 0 and engine.closed is False
    [thread] = [t for t in threading.enumerate() if t.name == "tokenmill-engine" and t.ident == engine._thread.ident]
    assert thread.daemon  # it never holds the process up


def test_a_deterministic_engine_says_so_in_its_fingerprint_and_needs_a_model_loaded_so(tiny4k_gguf: Path,
                                                                                       tiny4k: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="^deterministic=True but the model was loaded with deterministic=False$"):
        start_engine(tiny4k, deterministic=True)
    loaded = load_model(str(tiny4k_gguf), WeightPlan(dtype="float32", device="cpu", deterministic=True))
    with pytest.raises(ConfigError, match="^deterministic=False but the model was loaded with deterministic=True$"):
        start_engine(loaded, deterministic=False)
    engine = start_engine(loaded, deterministic=True)
    try:
        assert engine.system_fingerprint == f"tokenmill-{__version__}-float32-deterministic"
    finally:
        engine.stop()


def test_a_bad_setting_fails_start_in_the_callers_thread(tiny4k: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="--max-num-seqs 0"):
        start_engine(tiny4k, max_num_seqs=0)


def test_kv_memory_short_of_the_context_serves_what_it_holds_unless_a_context_was_asked_for(
        tiny4k: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    """64 blocks of 16 tokens hold 1024 tokens of the model's 4096: a context of 1024 is served, with a warning;
    256 blocks hold it all; with --max-model-len asked for, too little memory is refused."""
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.builder"):
        for blocks, served in ((64, 1024), (256, 4096)):
            engine = start_engine(tiny4k, kv_cache_memory=str(blocks * 16 * per_token))
            try:
                assert engine.kv_cache.capacity_tokens == blocks * 16 and engine.max_model_len == served
            finally:
                engine.stop()
    assert caplog.messages == ["KV memory holds 1024 tokens, less than the model's context of 4096: serving a "
                               "context of 1024"]
    with pytest.raises(ConfigError, match="^--max-model-len 4096 needs KV memory for 4096 tokens; --kv-cache-memory "
                                          "holds 1024: raise it or lower --max-model-len$"):
        start_engine(tiny4k, kv_cache_memory=str(64 * 16 * per_token), max_model_len=4096)


def test_an_engine_given_a_path_loads_it_as_its_settings_say(tiny4k_gguf: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """start() loads config.model on the engine thread, with every loading setting passed on."""
    calls = []
    real = builder_module.load_model

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(builder_module, "load_model", recording)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    engine = Engine(engine_module.EngineConfig(model=str(tiny4k_gguf), dtype="float32", device="cpu",
                                               max_model_len=256, threads=3, prepack_weights=False,
                                               quantized_weights=False, dense_weights_budget="1MiB",
                                               dequantize_from_rows=64, fused_decode_layers=False,
                                               amx_from_rows=128, bf16_kernels=False))
    try:
        engine.start()
        assert engine.max_model_len == 256 and threads == [3]
    finally:
        engine.stop()
    [(args, kwargs)] = calls
    assert args == (str(tiny4k_gguf), WeightPlan(dtype="float32", device="cpu", quantized=False, dense_budget=2**20,
                                                 dequantize_from_rows=64, prepack=False, fused_decode=False,
                                                 deterministic=False, tiles_from_rows=128, bf16_kernels=False), 256)
    assert kwargs == {"past_trained_context": False}


def test_a_model_that_fails_to_load_fails_start(tmp_path: Path) -> None:
    """What the loader raises, start() raises; before that the engine has no fingerprint to give."""
    engine = Engine(engine_module.EngineConfig(model=str(tmp_path / "missing.gguf"), device="cpu"))
    with pytest.raises(AssertionError, match="^the engine has not loaded its model$"):
        engine.system_fingerprint  # noqa: B018 - a property that asserts
    with pytest.raises(ModelFormatError, match="missing.gguf' is not a file, a folder, an alias"):
        engine.start()
    assert not engine.alive


@pytest.mark.parametrize(("speculative", "kind"), [(None, type(None)), ("ngram", NgramProposer),
                                                   ("suffix", SuffixCacheProposer)])
def test_the_proposer_is_the_one_named_with_the_lookup_lengths_set(tiny4k: LoadedModel, speculative: str | None,
                                                                    kind: type) -> None:
    engine = start_engine(tiny4k, speculative=speculative, prompt_lookup_min=3, prompt_lookup_max=7)
    try:
        assert type(engine.proposer) is kind
        lookup = getattr(engine.proposer, "own", engine.proposer)
        if speculative:
            assert (lookup.min_n, lookup.max_n) == (3, 7)
            assert engine.snapshot()["speculative"] is not None
        else:
            assert engine.snapshot()["speculative"] is None
    finally:
        engine.stop()


# --- requests in, outputs out ---------------------------------------------------------------------------------------


def test_a_sequence_streams_its_tokens_and_counts_its_usage(engine: Engine, plain: list[list[int]]) -> None:
    sink = run(engine, PROMPT, greedy())
    assert sink.tokens == plain[0][:12] and sink.last.finish_reason == "length"
    assert {out.seq_id for out in sink.outputs} == {0} and engine._seqs == {}  # nothing kept of it
    assert all(out.finish_reason is None for out in sink.outputs[:-1]) and len(sink.outputs) == 12
    assert [out.completion_tokens for out in sink.outputs] == list(range(1, 13))
    assert {out.prompt_tokens for out in sink.outputs} == {5} and {out.cached_tokens for out in sink.outputs} == {0}
    assert sink.text == engine.tokenizer.decode(plain[0][:12])
    assert all(out.logprobs == [] and out.prompt_logprobs is None and out.embedding is None for out in sink.outputs)
    assert engine.num_unfinished == 0
    assert counted(engine.metrics.prompt_tokens) == 5 and counted(engine.metrics.generation_tokens) == 12
    generated, prompt = engine.metrics.rates.series(time.time() + 1)  # per second, this one included
    assert sum(prompt) == 5 and sum(generated) == 12
    histogram = engine.metrics.snapshot(speculative=False)["latency"]
    assert histogram["ttft_s"]["count"] == 1 and histogram["itl_s"]["count"] == 11
    assert 0 < histogram["ttft_s"]["p99"] < 5 and 0 < histogram["itl_s"]["p99"] < 5  # seconds since arrival, since last
    assert_no_live_blocks(engine)


def test_a_long_prompt_beside_a_decode_runs_in_chunks_that_shrink_as_its_context_grows(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """long_prefill_chunk (32) tokens a step at first, fewer as the context deepens: a token at context c costs
    1 + c / 480, the tiny model's attention crossover."""
    long = [3 + i % 200 for i in range(600)]
    chunks = []
    run_step = engine.runner.run

    def recording(plan):
        chunks.extend(item.num_tokens for item in plan if item.seq.prompt_ids == long)
        return run_step(plan)

    monkeypatch.setattr(engine.runner, "run", recording)
    decoding = Collector()
    engine.add(PROMPT, greedy(max_tokens=200), decoding)
    while not decoding.outputs:
        threading.Event().wait(0.01)
    run(engine, long, greedy(max_tokens=1))
    engine.abort(0)
    assert sum(chunks) == 600 and chunks[0] == 32
    assert chunks[len(chunks) // 2] == int(32 / (1 + sum(chunks[:len(chunks) // 2]) / 480))


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(engine: Engine) -> None:
    prompt = list(range(40, 90))
    run(engine, prompt, greedy(max_tokens=2))
    again = run(engine, prompt, greedy(max_tokens=2))
    assert again.last.cached_tokens == 48 and counted(engine.metrics.prefix_hits) == 48


def test_a_request_the_engine_cannot_take_fails_alone(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A Sequence that cannot be made (max_tokens unresolved: the API resolves it) is an error output, not a dead
    loop; a sink that raises on that output too is logged."""
    sink = Collector()
    seq_id = engine.add(PROMPT, SamplingParams(max_tokens=None), sink)
    [out] = sink.wait(engine)
    assert (out.seq_id, out.finish_reason, out.error, out.prompt_tokens, out.completion_tokens, out.text,
            out.token_ids, out.logprobs) == (seq_id, "error", "internal error while adding the request", 5, 0, "",
                                             [], [])
    assert engine.num_unfinished == 0
    assert logged(caplog, f"sequence {seq_id} could not be added:", "ValueError: max_tokens is resolved against the "
                  "context before a sequence is made")

    def raising(out: SequenceOutput) -> None:
        raise RuntimeError("the reader is gone")

    seq_id = engine.add(PROMPT, SamplingParams(max_tokens=None), raising)
    assert run(engine, PROMPT, greedy(max_tokens=2)).last.finish_reason == "length"  # the loop goes on
    assert logged(caplog, f"sequence {seq_id} could not be given its error:", "RuntimeError: the reader is gone")
    assert engine.num_unfinished == 0


def test_waiting_counts_the_sequences_beyond_the_running_ones(tiny4k: LoadedModel) -> None:
    engine = start_engine(tiny4k, max_num_seqs=2)
    try:
        assert engine.waiting_with(0) == 0 and engine.waiting_with(2) == 0 and engine.waiting_with(3) == 1
        gate = threading.Event()
        sinks = [Collector() for _ in range(3)]

        def held(sink: Collector):
            def put(out: SequenceOutput) -> None:
                gate.wait(10)
                sink(out)
            return put

        for sink in sinks:
            engine.add(PROMPT, greedy(max_tokens=3), held(sink))
        assert engine.num_unfinished == 3 and engine.waiting_with(0) == 1
        gate.set()
        for sink in sinks:
            sink.wait(engine)
        assert engine.num_unfinished == 0 and engine.waiting_with(1) == 0
    finally:
        engine.stop()


def test_waiting_counts_those_memory_holds_back_and_the_gauges_show_them(tiny4k: LoadedModel) -> None:
    """KV memory for one sequence of four slots: after a step that left two waiting, two more would wait behind
    them (not the slots' count); the gauges read the last step's numbers."""
    per_token = 2 * 2 * 2 * 16 * 4
    engine = start_engine(tiny4k, max_num_seqs=4, kv_cache_memory=str(5 * 16 * per_token))
    try:
        seen, snapshots = [], []
        gate = threading.Event()
        first = Collector()

        def looking(out: SequenceOutput) -> None:
            if len(first.outputs) == 2:
                m = engine.metrics.value
                seen.append((engine.waiting_with(0), engine.waiting_with(1), m("tokenmill:num_requests_running"),
                             m("tokenmill:num_requests_waiting"), m("tokenmill:kv_cache_usage_perc")))
                snapshots.append(engine.snapshot())
                gate.set()
            first(out)

        engine.add(list(range(40, 90)), greedy(max_tokens=20), looking)
        others = [Collector(), Collector()]
        for start, sink in zip((100, 150), others, strict=True):  # prompts of their own: no prefix to share
            engine.add(list(range(start, start + 50)), greedy(max_tokens=20), sink)
        assert gate.wait(10)
        for sink in [first, *others]:
            sink.wait(engine)
        assert seen == [(2, 3, 1, 2, 0.8)]
        sequences = snapshots[0]["sequences"]
        assert [(s["id"], s["state"], s["generated_tokens"], s["cached_tokens"], s["blocks"]) for s in sequences] == [
            (0, "running", 3, 0, 4), (1, "waiting", 0, 0, 0), (2, "waiting", 0, 0, 0)]
        ages = [s["age_s"] for s in sequences]  # seconds, to the millisecond
        assert all(isinstance(age, float) and 0 <= age < 2.5 and age == round(age, 3) for age in ages)
    finally:
        engine.stop()


def test_an_idle_engine_waits_for_news_rather_than_polling(engine: Engine) -> None:
    """Nothing to do: the loop blocks on its inbox (a put wakes it), it does not spin."""
    calls = {"get": 0, "get_nowait": 0}
    inbox = engine._inbox

    class Counting:
        def get(self, timeout: float):
            calls["get"] += 1
            return inbox.get(timeout=timeout)

        def get_nowait(self):
            calls["get_nowait"] += 1
            return inbox.get_nowait()

        def put(self, item) -> None:
            inbox.put(item)

    engine._inbox = Counting()
    threading.Event().wait(0.3)
    assert calls["get_nowait"] == 0 and calls["get"] <= 2
    assert run(engine, PROMPT, greedy(max_tokens=2)).last.finish_reason == "length"


def test_the_snapshot_lists_each_sequence_and_the_engines_counters(engine: Engine) -> None:
    seen = []
    gate = threading.Event()

    def sink(out: SequenceOutput) -> None:
        if not seen:
            seen.append((engine.snapshot(), engine.kv_cache.occupancy()))
            gate.set()

    run(engine, list(range(40, 90)), greedy(max_tokens=2))
    engine.add(list(range(40, 90)), greedy(max_tokens=3), sink)  # its prefix read from the first's blocks
    assert gate.wait(10)
    [(snapshot, occupancy)] = seen
    [seq] = snapshot["sequences"]
    assert snapshot["running"] == 1 and snapshot["waiting"] == 0 and seq["state"] == "running"
    assert (seq["id"], seq["prompt_tokens"], seq["generated_tokens"], seq["computed_tokens"], seq["cached_tokens"],
            seq["blocks"]) == (1, 50, 1, 50, 48, 4)
    assert snapshot["kv"] == occupancy
    assert snapshot["totals"]["generation_tokens"] == 2 and snapshot["speculative"] is None


def test_an_abort_ends_a_sequence_and_aborting_all_ends_every_one(engine: Engine) -> None:
    gate = threading.Event()
    first = Collector()

    def slow(out: SequenceOutput) -> None:
        gate.wait(10)
        first(out)

    seq_id = engine.add(PROMPT, greedy(max_tokens=4000), slow)
    engine.abort(seq_id)
    engine.abort(12345)  # no such sequence: nothing happens
    gate.set()
    assert first.wait(engine)[-1].finish_reason == "abort"
    sinks = [Collector() for _ in range(3)]
    for sink in sinks:
        engine.add(PROMPT, greedy(max_tokens=4000), sink)
    engine.abort_all()
    assert [sink.wait(engine)[-1].finish_reason for sink in sinks] == ["abort"] * 3
    assert engine.num_unfinished == 0
    assert_no_live_blocks(engine)
    engine.abort(seq_id)  # already finished: nothing happens
    assert run(engine, PROMPT, greedy(max_tokens=2)).last.finish_reason == "length"


def test_a_sequence_that_arrives_as_the_engine_stops_is_aborted(tiny4k: LoadedModel) -> None:
    """The idle loop wakes for the sequence, sees it is stopping, and aborts the sequence rather than leave its
    reader waiting."""
    engine = start_engine(tiny4k)
    sink = Collector()
    engine._stopping = True  # what stop() does first
    engine.add(PROMPT, greedy(), sink)
    assert sink.wait()[-1].finish_reason == "abort" and sink.tokens == []
    engine.stop()
    assert not engine.alive


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_a_started_engine_sets_the_heap_aside_from_the_collector_until_it_stops(tiny4k: LoadedModel,
                                                                                 freeze_gc: bool) -> None:
    """What is alive once the model is loaded is frozen (full collections skip it); stopping thaws it, so the
    engine's own cycles (its thread holds its loop, which holds it) are collected once it is dropped."""
    engine = start_engine(tiny4k, freeze_gc=freeze_gc)
    try:
        assert (gc.get_freeze_count() > 0) == freeze_gc
        assert run(engine, PROMPT, greedy(max_tokens=3)).last.finish_reason == "length"
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None


def test_the_runner_gets_the_decode_graphs_start_up_built(tiny4k: LoadedModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builder_module, "decode_graphs", lambda *args: "the graphs")
    engine = start_engine(tiny4k)
    engine.stop()
    assert engine.runner.graphs == "the graphs"


def test_closing_says_so_and_stopping_aborts_what_is_left_even_what_just_arrived(tiny4k: LoadedModel) -> None:
    """A sequence running and one added while the loop was busy (still in its inbox when the loop stops) both
    end with "abort"."""
    engine = start_engine(tiny4k)
    engine.close()
    assert engine.closed
    gate, busy = threading.Event(), threading.Event()
    sinks = [Collector(), Collector()]

    def slow(out: SequenceOutput) -> None:
        busy.set()
        gate.wait(10)
        sinks[0](out)

    engine.add(PROMPT, greedy(max_tokens=4000), slow)
    assert busy.wait(10)
    engine.add(PROMPT, greedy(max_tokens=4000), sinks[1])
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    while not engine._stopping:
        threading.Event().wait(0.01)
    gate.set()
    stopper.join(30)
    assert not engine.alive
    assert [sink.wait()[-1].finish_reason for sink in sinks] == ["abort", "abort"]
    assert sinks[1].outputs[-1].token_ids == []


# --- failures end one sequence ---------------------------------------------------------------------------------------


def test_a_step_that_fails_fails_the_sequence_that_raises_and_not_its_neighbours(
        engine: Engine, plain: list[list[int]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run_step = engine.runner.run

    def failing(plan):
        if any(item.seq.prompt_ids == [7, 8, 9] for item in plan):
            raise RuntimeError("a kernel failed")
        return run_step(plan)

    monkeypatch.setattr(engine.runner, "run", failing)
    sinks = [Collector() for _ in PROMPTS]
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        engine.add(prompt, greedy(), sink)
    for sink in sinks:
        sink.wait(engine)
    assert sinks[1].last.finish_reason == "error" and sinks[1].last.error == "internal error while running the model"
    assert sinks[0].tokens == plain[0][:12] and sinks[2].tokens == plain[2][:12]
    assert [sinks[0].last.finish_reason, sinks[2].last.finish_reason] == ["length", "length"]
    assert logged(caplog, "engine step failed:", "RuntimeError: a kernel failed") and engine.num_unfinished == 0
    assert_no_live_blocks(engine)


def test_text_that_fails_to_decode_fails_its_sequence(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """At its first token (still running), or at its last (the step's update had finished it with "length"): either
    way the sequence ends with an error, its neighbour untouched."""
    fails_at = {(7, 8, 9): 1, (10, 11, 12): 3}
    make, add_token = output_module.IncrementalDetokenizer.__init__, output_module.IncrementalDetokenizer.add_token

    def marked(self, tokenizer, prompt_ids, *args, **kwargs) -> None:
        make(self, tokenizer, prompt_ids, *args, **kwargs)
        self.fails_at, self.count = fails_at.get(tuple(prompt_ids)), 0

    def failing(self, token_id: int) -> None:
        self.count += 1
        if self.count == self.fails_at:
            raise ValueError("not a token")
        add_token(self, token_id)

    monkeypatch.setattr(output_module.IncrementalDetokenizer, "__init__", marked)
    monkeypatch.setattr(output_module.IncrementalDetokenizer, "add_token", failing)
    good, first, last = Collector(), Collector(), Collector()
    for prompt, sink in ((PROMPT, good), ([7, 8, 9], first), ([10, 11, 12], last)):
        engine.add(prompt, greedy(max_tokens=3), sink)
    for sink, count in ((first, 1), (last, 3)):
        outputs = sink.wait(engine)
        assert [out.finish_reason for out in outputs] == [None] * (count - 1) + ["error"]
        assert outputs[-1].error == "internal error while decoding the output"
        assert outputs[-1].completion_tokens == count
    assert good.wait(engine)[-1].finish_reason == "length" and len(good.tokens) == 3 and good.last.error is None
    assert logged(caplog, "output of sequence 1 failed:", "ValueError: not a token")
    assert logged(caplog, "output of sequence 2 failed:", "ValueError: not a token") and engine.num_unfinished == 0
    assert_no_live_blocks(engine)


def test_an_output_that_fails_to_build_ends_its_sequence_with_an_error(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Midway (the sequence still running) or at its last output (the update finished it): an error output in its
    place, the sequence's blocks back in the pool."""
    output = OutputProcessor._output
    fails_at = {(7, 8, 9): 2, (10, 11, 12): 4}

    def failing(self, seq, error):
        if fails_at.get(tuple(seq.prompt_ids)) == len(seq.output_ids):
            raise RuntimeError("no output")
        return output(self, seq, error)

    monkeypatch.setattr(OutputProcessor, "_output", failing)
    good, midway, last = Collector(), Collector(), Collector()
    ids = [engine.add(prompt, greedy(max_tokens=4), sink)
           for prompt, sink in ((PROMPT, good), ([7, 8, 9], midway), ([10, 11, 12], last))]
    for seq_id, sink, count in ((ids[1], midway, 2), (ids[2], last, 4)):
        outputs = sink.wait(engine)
        assert len(outputs) == count and outputs[-1] == SequenceOutput(
            seq_id, "", [], [], "error", 3, count, error="internal error while preparing the output")
        assert logged(caplog, f"output of sequence {seq_id} failed:", "RuntimeError: no output")
    assert good.wait(engine)[-1].finish_reason == "length"
    assert engine.num_unfinished == 0
    assert_no_live_blocks(engine)


@pytest.mark.parametrize("where", ["step", "text", "output", "text at the end"])
def test_a_failed_sequence_leaves_nothing_of_its_answer_behind(tiny4k: LoadedModel, plain: list[list[int]],
                                                                monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A sequence that fails at its 15th token (its step, its text, its output) is not taught to the suffix cache,
    nor is its answer's KV offered to the prefix cache: a request sharing its prompt and answer finds the prompt's
    3 blocks only; also one whose text fails at the token its max_tokens ends it with."""
    engine = start_engine(tiny4k, speculative="suffix")

    def due(seq: Sequence) -> bool:
        return seq.prompt_ids == PROMPTS[2] and len(seq.output_ids) == 15

    if where == "step":
        run_step = engine.runner.run

        def failing_step(plan):
            if any(due(item.seq) for item in plan):
                raise RuntimeError("a kernel failed")
            return run_step(plan)

        monkeypatch.setattr(engine.runner, "run", failing_step)
    elif where == "output":
        output = OutputProcessor._output

        def failing_output(self, seq, error):
            if due(seq):
                raise RuntimeError("no output")
            return output(self, seq, error)

        monkeypatch.setattr(OutputProcessor, "_output", failing_output)
    else:
        reason = OutputProcessor.finish_reason

        def failing_text(self, seq, token, by_id):
            if due(seq):
                monkeypatch.setattr(seq.detokenizer, "add_token", lambda token: int("not a token"))
            return reason(self, seq, token, by_id)

        monkeypatch.setattr(OutputProcessor, "finish_reason", failing_text)
    try:
        sink = run(engine, PROMPTS[2], greedy(max_tokens=15 if where == "text at the end" else 40))
        assert sink.last.finish_reason == "error" and len(sink.outputs) == (16 if where == "step" else 15)
        assert len(engine.proposer.index) == 0
        follow = run(engine, PROMPTS[2] + plain[2][:15] + [1], greedy(max_tokens=1))
        assert follow.last.cached_tokens == 48
    finally:
        engine.stop()


def test_a_sink_that_raises_ends_its_sequence_unseen(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def raising(out: SequenceOutput) -> None:
        calls.append(out)
        raise RuntimeError("the client went away")

    engine.add(PROMPT, greedy(max_tokens=50), raising)
    assert run(engine, [7, 8, 9], greedy(max_tokens=3)).last.finish_reason == "length"
    assert len(calls) == 1 and engine.num_unfinished == 0
    assert logged(caplog, "sequence 0 could not be given its output, it ends:", "RuntimeError: the client went away")
    assert counted(engine.metrics.prompt_tokens) == 5 + 3
    assert_no_live_blocks(engine)


# --- the output side -------------------------------------------------------------------------------------------------


def test_an_end_token_ends_the_answer_without_text_or_a_logprob(engine: Engine, plain: list[list[int]]) -> None:
    """The eos (and a request's stop token) finish with "stop", not part of the answer; include_stop_str_in_output
    keeps a stop token's text, as vLLM does; ignore_eos runs past the eos."""
    token = plain[0][3]
    bias = {EOS: 0.0}
    stopped = run(engine, PROMPT, greedy(ignore_eos=False, logit_bias={token: 0.0}, stop_token_ids=[token],
                                         logprobs=1))
    assert stopped.tokens == plain[0][:4] and stopped.last.finish_reason == "stop"
    assert stopped.text == run(engine, PROMPT, greedy(max_tokens=3)).text
    assert [lp.token_id for out in stopped.outputs for lp in out.logprobs] == plain[0][:3]
    kept = run(engine, PROMPT, greedy(stop_token_ids=[token], include_stop_str_in_output=True, logprobs=0))
    assert kept.text == run(engine, PROMPT, greedy(max_tokens=4)).text and len(
        [lp for out in kept.outputs for lp in out.logprobs]) == 4
    forced = {EOS: 100.0}  # the eos after the first token
    eos = run(engine, PROMPT, greedy(ignore_eos=False, logit_bias=forced, min_tokens=2, logprobs=0))
    assert eos.last.finish_reason == "stop" and eos.tokens[-1] == EOS and len(eos.tokens) == 3
    assert len([lp for out in eos.outputs for lp in out.logprobs]) == 2
    assert eos.tokens[:2] == plain[0][:2] and eos.text == run(engine, PROMPT, greedy(max_tokens=2)).text
    ignored = run(engine, PROMPT, greedy(logit_bias=forced, max_tokens=4, logprobs=0))
    assert ignored.tokens == [EOS] * 4 and ignored.last.finish_reason == "length"
    assert [lp.token_id for out in ignored.outputs for lp in out.logprobs] == [EOS] * 4  # the last one too
    assert run(engine, PROMPT, greedy(logit_bias=bias)).tokens == plain[0][:12]
    assert not engine.output._end_token and not engine.output._errors  # nothing kept of a finished sequence


def test_a_stop_string_ends_the_answer_before_it(engine: Engine, plain: list[list[int]]) -> None:
    text = engine.tokenizer.decode(plain[2][:12])
    stop = text[6:8]
    sink = run(engine, PROMPTS[2], greedy(stop=[stop], logprobs=0))
    assert sink.last.finish_reason == "stop" and sink.text == text[:text.index(stop)]
    entries = [lp for out in sink.outputs for lp in out.logprobs]
    assert len(entries) == len(sink.tokens)
    kept = run(engine, PROMPTS[2], greedy(stop=[stop], include_stop_str_in_output=True))
    assert kept.text == text[:text.index(stop) + 2]
    # A stop string that never comes holds back its length less one of each delta, all given with the last.
    held = run(engine, PROMPTS[2], greedy(stop=["never said"]))
    assert held.text == text and held.last.finish_reason == "length" and held.last.text != ""


def test_logprobs_come_with_their_tokens(engine: Engine) -> None:
    sink = run(engine, PROMPT, greedy(max_tokens=4, logprobs=2))
    entries = [lp for out in sink.outputs for lp in out.logprobs]
    assert [lp.token_id for lp in entries] == sink.tokens and all(len(lp.top) == 2 for lp in entries)
    assert all(len(out.logprobs) == len(out.token_ids) for out in sink.outputs)


def test_prompt_logprobs_come_with_the_first_output_only(engine: Engine) -> None:
    sink = run(engine, PROMPT, greedy(max_tokens=3, prompt_logprobs=1))
    first, *rest = sink.outputs
    assert [lp.token_id for lp in first.prompt_logprobs] == PROMPT[1:]
    assert all(len(lp.top) == 1 for lp in first.prompt_logprobs)
    assert all(out.prompt_logprobs is None for out in rest)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_is_the_prompts_pooled_state_normalized(tiny4k: LoadedModel, pooling: str) -> None:
    engine = start_engine(tiny4k, pooling=pooling)
    try:
        sink = run(engine, list(range(40, 90)), SamplingParams(max_tokens=1), embed=True)
        [out] = sink.outputs
        assert out.finish_reason == "stop" and out.token_ids == [] and len(out.embedding) == 64
        assert torch.tensor(out.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)
        other = run(engine, list(range(40, 90)), SamplingParams(max_tokens=1), embed=True).last.embedding
        assert other == pytest.approx(out.embedding, abs=1e-6)
        assert counted(engine.metrics.prompt_tokens) == 100 and counted(engine.metrics.generation_tokens) == 0
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_aborted_midway_has_no_vector(tiny4k: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                                   pooling: str) -> None:
    """Its prompt runs in chunks of 7; aborted after the first, its one output carries no half-pooled vector (a
    mean's running sum has one by then)."""
    engine = start_engine(tiny4k, max_num_batched_tokens=7, pooling=pooling)
    try:
        run_step = engine.runner.run
        ids = []

        def aborting(plan):
            logits = run_step(plan)
            if ids:
                engine.abort(ids[0])
            return logits

        monkeypatch.setattr(engine.runner, "run", aborting)
        sink = Collector()
        ids.append(engine.add(list(range(40, 90)), SamplingParams(max_tokens=1), sink, embed=True))
        [out] = sink.wait(engine)
        assert out.finish_reason == "abort" and out.embedding is None
    finally:
        engine.stop()


# --- speculation's bookkeeping ---------------------------------------------------------------------------------------


def speculating(loaded: LoadedModel, oracle: Oracle, **config) -> Engine:
    """An engine whose proposals are the oracle's."""
    engine = start_engine(loaded, speculative="ngram", **config)
    engine.speculation.proposer = oracle
    return engine


def test_right_proposals_are_accepted_a_run_at_a_time_and_keep_plain_decodings_tokens(
        tiny4k: LoadedModel, plain: list[list[int]]) -> None:
    """Each sequence asks for num_speculative_tokens, at most what its max_tokens leaves after the next token; every
    proposal is accepted, 5 tokens a step; the proposer hears of each sequence that finishes."""
    oracle = Oracle({tuple(p): answer for p, answer in zip(PROMPTS, plain, strict=True)})
    engine = speculating(tiny4k, oracle)
    try:
        sinks = [Collector() for _ in PROMPTS]
        for prompt, sink in zip(PROMPTS, sinks, strict=True):
            engine.add(prompt, greedy(max_tokens=20, logprobs=0), sink)
        for sink in sinks:
            sink.wait(engine)
        assert [sink.tokens for sink in sinks] == [answer[:20] for answer in plain]
        assert [len(out.token_ids) for out in sinks[0].outputs] == [1, 5, 5, 5, 4]
        assert all(len(out.logprobs) == len(out.token_ids) for sink in sinks for out in sink.outputs)
        assert sorted(oracle.asked) == sorted((i, k) for i in range(3) for k in (4, 4, 4, 3))
        assert sorted(oracle.finished) == [0, 1, 2]
        assert counted(engine.metrics.spec_draft_tokens) == counted(engine.metrics.spec_accepted_tokens) == 45
        assert counted(engine.metrics.generation_tokens) == 60
        assert engine.snapshot()["speculative"]["acceptance_rate"] == 1.0
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_wrong_proposals_keep_the_tokens_and_pause_the_sequences_asking(tiny4k: LoadedModel,
                                                                         plain: list[list[int]]) -> None:
    """Every proposal rejected: 5 checks bring the acceptance average below 0.2 (an 8-step pause), then 2 more."""
    oracle = Oracle({tuple(PROMPT): plain[0]}, wrong_at=0)
    engine = speculating(tiny4k, oracle)
    try:
        sink = run(engine, PROMPT, greedy(max_tokens=20))
        assert sink.tokens == plain[0][:20] and all(len(out.token_ids) == 1 for out in sink.outputs)
        assert len(oracle.asked) == 7 and counted(engine.metrics.spec_accepted_tokens) == 0
    finally:
        engine.stop()


def test_a_proposal_fits_in_the_context_that_is_left(tiny4k: LoadedModel) -> None:
    """A context of 1024 (the KV memory's): a sequence near its end asks for at most what is left of it."""
    per_token = 2 * 2 * 2 * 16 * 4
    oracle = Oracle({})
    engine = speculating(tiny4k, oracle, kv_cache_memory=str(64 * 16 * per_token))
    try:
        sink = run(engine, [3 + i % 200 for i in range(1018)], greedy(max_tokens=100))
        assert sink.last.finish_reason == "length" and len(sink.tokens) == 6
        assert [k for _, k in oracle.asked] == [4, 4, 3, 2, 1]
    finally:
        engine.stop()


@pytest.mark.parametrize(("max_seqs", "asks"), [(2, False), (3, True)])
def test_speculation_pauses_while_more_sequences_decode_than_speculative_max_seqs(
        tiny4k: LoadedModel, max_seqs: int, asks: bool) -> None:
    """The three sequences are added one at a time, so a step may see fewer of them decoding (and ask for those); every
    step that sees all three asks for them all or for none."""
    oracle = Oracle({})
    engine = speculating(tiny4k, oracle, speculative_max_seqs=max_seqs)
    try:
        generate(engine, PROMPTS, [greedy(max_tokens=16)] * 3, timeout=10)
        assert (3 in oracle.at_once) == asks
    finally:
        engine.stop()


def test_no_proposals_for_a_grammar_or_an_embedding(tiny4k: LoadedModel) -> None:
    """A grammar's masks follow accepted tokens only; an embedding never samples (here it reaches its last prompt
    token in chunks of 7, as a decode would)."""
    from tokenmill.structured import StructuredSpec

    oracle = Oracle({})
    engine = speculating(tiny4k, oracle, max_num_batched_tokens=7)
    try:
        grammar = engine.grammars.compile(StructuredSpec("regex", "[a-z]{6}"), "regex").new()
        constrained = run(engine, PROMPT, greedy(max_tokens=10, ignore_eos=False), grammar=grammar)
        assert constrained.last.finish_reason == "stop" and len(constrained.text) == 6
        run(engine, list(range(40, 90)), SamplingParams(max_tokens=1), embed=True)
        assert oracle.asked == []
        run(engine, PROMPT, greedy(max_tokens=3))
        assert [seq_id for seq_id, _ in oracle.asked] == [2, 2]
    finally:
        engine.stop()


def test_a_proposer_that_fails_is_let_go_and_the_requests_go_on(tiny4k: LoadedModel, plain: list[list[int]],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    class Failing(Oracle):
        def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
            raise RuntimeError("the draft model failed")

    engine = speculating(tiny4k, Failing({}))
    try:
        assert run(engine, PROMPT, greedy()).tokens == plain[0][:12]
        assert engine.proposer is None
        assert logged(caplog, "speculative proposals failed, speculation is off from now on:",
                      "RuntimeError: the draft model failed")
    finally:
        engine.stop()


def test_a_stop_inside_an_accepted_run_ends_the_answer_as_plain_decoding_does(tiny4k: LoadedModel,
                                                                               plain: list[list[int]]) -> None:
    """A stop string, a stop token and the eos inside a run of accepted proposals: the same tokens, text, logprob
    entries and finish reason as without speculation, and only the kept tokens counted as generated."""
    engine = start_engine(tiny4k)
    try:
        text = run(engine, PROMPTS[2], greedy(max_tokens=20)).text
        stop = text[7:9]
        token = plain[2][8]
        cases = [greedy(max_tokens=20, stop=[stop], logprobs=1), greedy(max_tokens=20, stop_token_ids=[token],
                                                                        logprobs=0),
                 greedy(max_tokens=20, ignore_eos=False, logit_bias={EOS: 100.0}, min_tokens=7, logprobs=0)]
        run_plain = [run(engine, PROMPTS[2], params) for params in cases]
    finally:
        engine.stop()
    oracle = Oracle({tuple(PROMPTS[2]): plain[2][:7] + [EOS] + plain[2][7:]})
    engine = speculating(tiny4k, oracle)
    try:
        for params, expected in zip(cases, run_plain, strict=True):
            oracle.plain = {tuple(PROMPTS[2]): expected.tokens + plain[2][len(expected.tokens):]}
            before = counted(engine.metrics.generation_tokens)
            got = run(engine, PROMPTS[2], params)
            assert (got.tokens, got.text, got.last.finish_reason) == (expected.tokens, expected.text,
                                                                    expected.last.finish_reason)
            entries = [lp.token_id for out in got.outputs for lp in out.logprobs]
            assert entries == [lp.token_id for out in expected.outputs for lp in out.logprobs]
            assert counted(engine.metrics.generation_tokens) - before == len(expected.tokens)
            assert len(got.outputs) < len(expected.outputs)  # proposals were accepted
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


# --- what a request asks for reaches its sequence ------------------------------------------------------------------


def test_a_seeded_request_draws_the_same_tokens_whatever_runs_beside_it(engine: Engine) -> None:
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    alone = run(engine, PROMPT, sampled).tokens
    sinks = [Collector(), Collector(), Collector()]
    engine.add([7, 8, 9], SamplingParams(max_tokens=12, temperature=1.0), sinks[0])
    engine.add(PROMPT, sampled, sinks[1])
    engine.add(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=8), sinks[2])
    assert [sink.wait(engine) and sink.tokens for sink in sinks][1:] != [alone, alone]
    assert sinks[1].tokens == alone


def test_special_tokens_asked_to_be_shown_keep_their_text(engine: Engine) -> None:
    """What delimits a tool call is a special token the text otherwise skips."""
    start = 257  # <|im_start|>: special, and no end token
    forced = greedy(max_tokens=2, logit_bias={start: 100.0})
    assert run(engine, PROMPT, forced).text == ""
    shown = SamplingParams(**{**forced.__dict__, "shown_special_token_ids": [start]})
    assert run(engine, PROMPT, shown).text == "<|im_start|>" * 2


def test_min_tokens_holds_back_a_stop_string_too(engine: Engine, plain: list[list[int]]) -> None:
    stop = engine.tokenizer.decode(plain[2][:1])  # the first token's text, and nowhere after it
    assert run(engine, PROMPTS[2], greedy(stop=[stop])).last.finish_reason == "stop"
    held = run(engine, PROMPTS[2], greedy(stop=[stop], min_tokens=4))
    assert held.last.finish_reason == "length" and held.tokens == plain[2][:12]


# --- what start-up builds ------------------------------------------------------------------------------------------


def test_a_draft_model_is_loaded_for_the_models_context_with_a_pool_for_its_sequences(
        tiny4k: LoadedModel, tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The draft (trained on 512 positions) serves the model's 4096; its pool holds speculative_max_seqs contexts
    (2048 blocks of 16) and each one's 20 guesses (2 blocks), said in one log line; it proposes within the
    vocabulary; a long prompt past its own context still gets proposals."""
    from tokenmill.engine.draft import DraftModelProposer

    with caplog.at_level(logging.INFO, logger="tokenmill.engine.builder"):
        engine = start_engine(tiny4k, speculative="draft", draft_model=str(tiny_gguf), dtype="float32",
                              speculative_max_seqs=8, num_speculative_tokens=20)
    try:
        draft = engine.proposer
        assert isinstance(draft, DraftModelProposer) and draft.vocab_size == 259
        assert draft.kv_cache.pool.num_blocks == 2048 + 8 * 2
        assert draft.kv_cache.k.shape[::2] == (2, 16, 16) and draft.kv_cache.k.shape[3] == 2  # layers, heads, dim
        assert "draft model tiny.gguf: its KV pool 0.02 GiB for 33024 tokens" in caplog.messages
        run(engine, [3 + i % 200 for i in range(600)], greedy(max_tokens=8))
        assert engine.proposer is draft and counted(engine.metrics.spec_draft_tokens) > 0
    finally:
        engine.stop()


def test_a_draft_of_another_vocabulary_is_refused(tiny4k: LoadedModel, tiny_gguf: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(tiny4k.tokenizer), "same_vocabulary", lambda self, other: False)
    with pytest.raises(ConfigError, match=rf"^--draft-model {re.escape(str(tiny_gguf))}: its vocabulary is not the "
                                          r"model's \(a draft's tokens must mean what the model's do\)$"):
        start_engine(tiny4k, speculative="draft", draft_model=str(tiny_gguf), dtype="float32")


def test_the_gpu_switches_are_set_at_start(tiny4k: LoadedModel) -> None:
    from tokenmill.kernels import gpu

    try:
        for on in (False, True):
            start_engine(tiny4k, gpu_row_matmul=on, gpu_pdl=not on).stop()
            assert gpu._row_matmul[0] is on and gpu._pdl[0] is (not on)
    finally:
        gpu.use_row_matmul(True)
        gpu.use_pdl(True)


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_decode_attention_fetches_ahead_as_the_engine_was_started(tiny4k: LoadedModel) -> None:
    try:
        for on in (False, True):
            start_engine(tiny4k, decode_fetch_ahead=on).stop()
            assert kernels.use_decode_fetch_ahead(True) is on  # the switch as the start left it
    finally:
        kernels.use_decode_fetch_ahead(True)


def test_turning_the_fetch_ahead_on_loads_no_kernels() -> None:
    """The kernels load with it on, so an engine's start sets it without building them (a GPU never runs them)."""
    code = ("from tokenmill import kernels; kernels.use_decode_fetch_ahead(True); "
            "print(kernels.load.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "0"


def test_cuda_graphs_are_built_on_a_gpu_with_a_paged_pool_and_the_kernels_only(
        engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Decided from the device, --enforce-eager, the KV layout, the kernels and the model's experts (the graphs
    themselves: tests/model/test_decode_graphs.py)."""
    from dataclasses import replace
    from types import SimpleNamespace

    built = []
    monkeypatch.setattr(builder_module, "DecodeGraphs", lambda *args: built.append(args) or "graphs")
    ready = {"on": True}
    asked = []
    monkeypatch.setattr(builder_module.gpu, "ready", lambda device: asked.append(device) or ready["on"])

    def loaded(device: str = "cuda", experts: int = 0) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(num_experts=experts),
                               model="the model")

    caplog.set_level(logging.INFO, logger="tokenmill.engine.builder")
    config, kv = engine.config, engine.kv_cache

    def graphs(loaded: SimpleNamespace, config: object = config, kv: object = kv) -> object:
        return builder_module.decode_graphs(config, loaded, kv, 4096)

    assert graphs(loaded("cpu")) is None
    assert graphs(loaded()) == "graphs"
    assert built == [("the model", engine.kv_cache, 64, 4096)] and asked == [torch.device("cuda")]
    assert graphs(loaded(), config=replace(config, enforce_eager=True)) is None
    assert graphs(loaded(), kv=object()) is None  # not a paged pool
    assert len(built) == 1 and caplog.messages == []
    ready["on"] = False
    assert graphs(loaded()) is None
    assert caplog.messages == ["decode steps run op by op: CUDA graphs need the Triton kernels (kernels/gpu.py), not "
                               "here"]
    ready["on"] = True
    assert graphs(loaded(experts=4)) is None and len(built) == 1
    assert caplog.messages[1] == ("decode steps run op by op: a mixture of experts routes on the host (layers/moe.py "
                                  "reads how many tokens each expert takes), which a CUDA graph cannot hold")


def write_sliding_gguf(path: Path) -> Path:
    """A 2-layer Gemma 3 of random weights, its layers attending to their last 8 keys."""
    import numpy as np
    from helpers import TINY_TOKENS, write_gguf

    rng = np.random.default_rng(0)

    def weight(*shape: int, norm: bool = False) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.2 * rng.standard_normal(shape)).astype(
            np.float32)

    tensors = {"token_embd.weight": weight(len(TINY_TOKENS), 64), "output_norm.weight": weight(64, norm=True)}
    for i in range(2):
        tensors |= {f"blk.{i}.{name}.weight": weight(64, norm=True) for name in (
            "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}
        tensors |= {f"blk.{i}.attn_q_norm.weight": weight(32, norm=True),
                    f"blk.{i}.attn_k_norm.weight": weight(32, norm=True),
                    f"blk.{i}.attn_q.weight": weight(128, 64), f"blk.{i}.attn_k.weight": weight(64, 64),
                    f"blk.{i}.attn_v.weight": weight(64, 64), f"blk.{i}.attn_output.weight": weight(64, 128),
                    f"blk.{i}.ffn_gate.weight": weight(128, 64), f"blk.{i}.ffn_up.weight": weight(128, 64),
                    f"blk.{i}.ffn_down.weight": weight(64, 128)}
    metadata = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
                "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
                "attention.value_length": 32, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
                "attention.sliding_window": 8}
    return write_gguf(path, "gemma3", metadata, tensors, chat_template=None)


def test_a_model_with_sliding_layers_gets_a_pool_for_their_windows(tmp_path: Path) -> None:
    loaded = load_model(str(write_sliding_gguf(tmp_path / "sliding.gguf")), WeightPlan(dtype="float32", device="cpu"))
    engine = start_engine(loaded)
    try:
        kv = engine.kv_cache  # both layers slide: the full pool holds none, the sliding one both (2 heads of 32)
        assert loaded.config.sliding_layers == (True, True) and kv.window == 8
        assert kv.k.shape[0] == 0 and kv.sliding.k.shape[::2] == (2, 16, 32) and kv.sliding.k.shape[3] == 2
        assert kv.sliding.k.dtype == torch.float32
        assert len(run(engine, list(range(3, 43)), greedy(max_tokens=5)).tokens) == 5
    finally:
        engine.stop()

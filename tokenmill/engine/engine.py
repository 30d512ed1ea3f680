"""The engine: a loop on a background thread that owns the model, tokenizer and KV memory.

Callers on any thread `add` a request with a sink for its outputs; everything that touches the model happens on
the engine thread, one step at a time: schedule -> run -> sample -> update -> emit.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable

import torch

from tokenmill import __version__
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.cache.sizing import build_kv_cache
from tokenmill.config import EngineConfig, parse_size
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.draft import DraftModelProposer
from tokenmill.engine.graphs import DecodeGraphs
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.request import Sequence, SequenceOutput, Status, TokenLogprob
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler, seeded_generator
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.spec import AcceptanceGate, NgramProposer, Proposer, SuffixCacheProposer
from tokenmill.errors import ConfigError
from tokenmill.kernels import gpu
from tokenmill.loader import LoadedModel, load_model
from tokenmill.models.config import attention_crossover
from tokenmill.sampling import SamplingParams
from tokenmill.structured.backend import Grammar, GrammarCompiler

log = logging.getLogger(__name__)

Sink = Callable[[SequenceOutput], None]


class Engine:
    """Pass a LoadedModel, or let start() load config.model on the engine thread.

    Loading on the engine thread matters on CPU: OpenMP runs matmuls markedly slower (measured 30-40%) in a
    thread other than the first one that used it, so the thread that computes should be the one that loaded.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._seqs: dict[int, Sequence] = {}
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self._closed = False  # close(): no more sequences
        self.metrics = EngineMetrics()
        # Sequences added and not finished, and how many of them run: the waiting ones are the difference.
        self._unfinished = 0
        self._unfinished_lock = threading.Lock()
        self._num_running = 0
        self._num_waiting_at_step = 0

    def _setup(self) -> None:
        c = self.config
        c.check()
        gpu.use_row_matmul(c.gpu_row_matmul)
        gpu.use_pdl(c.gpu_pdl)
        if self.loaded is None:
            if c.threads:
                torch.set_num_threads(c.threads)
            self.loaded = self._load(c.model, c.max_model_len)
        loaded = self.loaded
        if loaded.deterministic != c.deterministic:
            raise ConfigError(f"deterministic={c.deterministic} but the model was loaded with "
                              f"deterministic={loaded.deterministic}")
        self.tokenizer = loaded.tokenizer
        self.tokenizer.token_bytes(0)  # its table is built here, not on the first request that asks for logprobs
        self.chat_template = loaded.chat_template
        self.model_path = loaded.path
        self.hidden_size = loaded.config.hidden_size  # an embedding's length
        mc = loaded.config
        spec = KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, loaded.dtype, mc.sliding_layers, mc.sliding_window)
        self.kv_cache = build_kv_cache(c, spec, loaded.device, loaded.max_model_len)
        self.max_model_len = self._context_that_fits(loaded.max_model_len, self.kv_cache.capacity_tokens)
        self.scheduler = Scheduler(c, self.kv_cache, self.max_model_len, self.tokenizer.eos_token_ids,
                                   attention_crossover(mc))
        self.runner = ModelRunner(loaded.model, self.kv_cache, loaded.device, self._decode_graphs(loaded))
        # Read by API threads (compile) and by the sampler (masks); built here, before any request arrives.
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), mc.vocab_size, self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, loaded.device, c.seed, self.grammars)
        self.proposer = self._proposer()
        self.gate = AcceptanceGate()

    def _decode_graphs(self, loaded: LoadedModel) -> DecodeGraphs | None:
        """CUDA graphs of decode steps, on a CUDA device over a paged pool where the GPU kernels run (they read the
        block tables themselves); none with --enforce-eager."""
        c = self.config
        if loaded.device.type != "cuda" or c.enforce_eager or not isinstance(self.kv_cache, PagedKVCache):
            return None
        if not gpu.ready(loaded.device):
            log.info("decode steps run op by op: CUDA graphs need the Triton kernels (kernels/gpu.py), not here")
            return None
        if loaded.config.num_experts:
            log.info("decode steps run op by op: a mixture of experts routes on the host (layers/moe.py reads how "
                     "many tokens each expert takes), which a CUDA graph cannot hold")
            return None
        return DecodeGraphs(loaded.model, self.kv_cache, c.max_num_seqs, self.max_model_len)

    def _load(self, model: str, max_model_len: int | None, draft: bool = False) -> LoadedModel:
        """draft: the draft model, served the target's context even past its own: its guesses only get worse there,
        and the target checks every one."""
        c = self.config
        budget = None if c.dense_weights_budget == "auto" else parse_size(c.dense_weights_budget)
        return load_model(model, c.dtype, c.device, max_model_len, prepack=c.prepack_weights,
                          quantized=c.quantized_weights, dense_budget=budget,
                          dequantize_from_rows=c.dequantize_from_rows, fused_decode=c.fused_decode_layers,
                          deterministic=c.deterministic, tiles_from_rows=c.amx_from_rows,
                          past_trained_context=draft or c.allow_long_max_model_len, bf16_kernels=c.bf16_kernels)

    def _proposer(self) -> Proposer | None:
        c = self.config
        if c.speculative is None:
            return None
        if c.speculative == "draft":
            return self._draft_proposer()
        if c.speculative == "suffix":
            return SuffixCacheProposer(c.prompt_lookup_min, c.prompt_lookup_max)
        return NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max)

    def _draft_proposer(self) -> DraftModelProposer:
        """The draft model, of the target's vocabulary and context, and its own KV pool: as many tokens as the
        target's, at most speculative_max_seqs whole contexts (sequences not speculating give theirs up when
        short), each with room for its guesses."""
        c = self.config
        assert c.draft_model is not None, "EngineConfig.check() refuses --speculative draft without one"
        draft = self._load(c.draft_model, self.max_model_len, draft=True)
        if not draft.tokenizer.same_vocabulary(self.tokenizer):
            raise ConfigError(f"--draft-model {c.draft_model}: its vocabulary is not the model's (a draft's tokens "
                              "must mean what the model's do)")
        mc = draft.config
        spec = KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, draft.dtype)
        tokens = min(self.kv_cache.capacity_tokens, c.speculative_max_seqs * self.max_model_len)
        num_blocks = -(-tokens // c.block_size) + c.speculative_max_seqs * -(-c.num_speculative_tokens // c.block_size)
        cache = PagedKVCache(spec, draft.device, num_blocks, c.block_size)
        log.info("draft model %s: its KV pool %.2f GiB for %d tokens", draft.path.name,
                 num_blocks * c.block_size * spec.bytes_per_token / 2**30, num_blocks * c.block_size)
        return DraftModelProposer(draft, cache, self.tokenizer.vocab_size)

    def _context_that_fits(self, context: int, kv_tokens: int) -> int:
        """The context served: the model's, or less when the KV memory cannot hold one whole context (otherwise a
        request that leaves out max_tokens, which defaults to the rest of the context, could never run)."""
        if kv_tokens >= context:
            return context
        if self.config.max_model_len is not None:
            raise ConfigError(f"--max-model-len {context} needs KV memory for {context} tokens; "
                             f"--kv-cache-memory holds {kv_tokens}: raise it or lower --max-model-len")
        log.warning("KV memory holds %d tokens, less than the model's context of %d: serving a context of %d",
                    kv_tokens, context, kv_tokens)
        return kv_tokens

    # --- any thread -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread and wait until it has its model; re-raise what went wrong loading it."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    @property
    def system_fingerprint(self) -> str:
        """The API's system_fingerprint: the settings that decide a request's numbers (version, compute dtype,
        deterministic mode); read once started."""
        assert self.loaded is not None, "the engine has not loaded its model"
        mode = "-deterministic" if self.config.deterministic else ""
        return f"tokenmill-{__version__}-{str(self.loaded.dtype).removeprefix('torch.')}{mode}"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    def waiting_with(self, count: int) -> int:
        """How many sequences would wait for a slot with `count` more: all those beyond the running ones where the
        last step left some waiting (memory, not slots, held them back: newcomers queue behind them), else those
        beyond --max-num-seqs (the ones added since the last step take its free slots first)."""
        if self._num_waiting_at_step:
            return self._unfinished + count - self._num_running
        return max(0, self._unfinished + count - self.config.max_num_seqs)

    def snapshot(self) -> dict[str, object]:
        """What the dashboard shows (GET /stats): the engine's state now, read from any thread while the loop runs
        on (a glance: a sequence may move on while it is read), and its counters."""
        now = time.perf_counter()
        running, waiting = tuple(self.scheduler.running), tuple(self.scheduler.waiting)
        sequences = [{"id": seq.seq_id, "state": state, "prompt_tokens": len(seq.prompt_ids),
                      "generated_tokens": len(seq.output_ids), "computed_tokens": seq.num_computed_tokens,
                      "cached_tokens": seq.num_cached_tokens or 0, "blocks": self.kv_cache.blocks_of(seq.seq_id),
                      "age_s": round(now - seq.arrival_time, 3)}
                     for state, group in (("running", running), ("waiting", waiting)) for seq in group]
        return {"running": len(running), "waiting": len(waiting), "kv": self.kv_cache.occupancy(),
                **self.metrics.snapshot(speculative=self.proposer is not None), "sequences": sequences}

    def add(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, grammar: Grammar | None = None,
            embed: bool = False) -> int:
        """Queue one sequence (params.max_tokens resolved, ids checked: see api/engine_client.py); its outputs go to
        sink, called on the engine thread; grammar: its own, from self.grammars (structured output); embed: only
        prefill the prompt and send its pooled hidden state (config.pooling) as the one output. Returns its id,
        for abort."""
        seq_id = next(self._ids)
        with self._unfinished_lock:
            self._unfinished += 1
        self._inbox.put(("add", (seq_id, prompt_ids, params, sink, time.perf_counter(), grammar, embed)))
        return seq_id

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))

    def close(self) -> None:
        """Take no more sequences (the end of a graceful shutdown): submitting one is an EngineUnavailableError."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def abort_all(self) -> None:
        """Finish every unfinished sequence with finish_reason 'abort' (the end of a graceful shutdown)."""
        self._inbox.put(("abort_all", None))

    # --- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as exc:  # handed to start(), which raises it in the caller's thread
            self._start_error = exc
            return
        finally:
            self._ready.set()
        while not self._stopping:
            # Block for news only when idle; otherwise take what has arrived and step.
            self._drain_inbox(block=not self.scheduler.has_work())
            if self._stopping:
                break
            if self.scheduler.has_work():
                self._step()
            self._num_running = len(self.scheduler.running)
            self._num_waiting_at_step = len(self.scheduler.waiting)
            self.metrics.set_gauges(self.scheduler, self.kv_cache)
        self._drain_inbox(block=False)  # what was added meanwhile is finished too, not left hanging
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort")

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                self._add(*item)  # type: ignore[misc]
            elif kind == "abort":
                seq = self._seqs.get(item)  # type: ignore[call-overload]
                if seq is not None:
                    self._finish(seq, "abort")
            elif kind == "abort_all":
                for seq in list(self._seqs.values()):
                    self._finish(seq, "abort")
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, sink: Sink, arrival: float,
             grammar: Grammar | None, embed: bool) -> None:
        device = self.runner.device
        try:
            seq = Sequence(
                seq_id=seq_id, prompt_ids=prompt_ids, params=params,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                                   params.include_stop_str_in_output, params.shown_special_token_ids,
                                                   params.min_tokens),
                sink=sink, arrival_time=arrival,
                # A seeded request samples from its own stream, so its tokens do not depend on its neighbours.
                generator=None if params.seed is None else seeded_generator(params.seed, device),
                grammar=grammar, pooling=self.config.pooling if embed else None,
            )
        except Exception:
            # A request the engine cannot take (one the API should have refused) fails alone, not the engine loop.
            log.error("sequence %d could not be added:\n%s", seq_id, traceback.format_exc())
            with self._unfinished_lock:
                self._unfinished -= 1
            try:
                sink(SequenceOutput(seq_id, "", [], [], "error", len(prompt_ids), 0,
                                    error="internal error while adding the request"))
            except Exception:
                log.error("sequence %d could not be given its error:\n%s", seq_id, traceback.format_exc())
            return
        self._seqs[seq_id] = seq
        self.scheduler.add(seq)

    def _step(self) -> None:
        self._propose()
        plan = self.scheduler.schedule()
        # Before any output, so whoever has the step's tokens sees them counted; prefill: prompt chunks, and the
        # tokens a preempted sequence recomputes.
        self.metrics.count(self.scheduler, sum(item.num_tokens for item in plan if not item.seq.decoding))
        if not plan:
            return
        sampling = [item for item in plan if item.samples]
        sampled = [item.seq for item in sampling]
        drafts = [item.draft for item in sampling]
        try:
            logits = self.runner.run(plan)
            if any(drafts):
                tokens, logprobs = self.sampler.verify(logits, sampled, drafts)
                self.metrics.count_drafts(drafts, tokens)
                for seq, draft, kept in zip(sampled, drafts, tokens, strict=True):
                    if draft:
                        self.gate.record(seq, len(draft), len(kept) - 1)
            else:
                one, their_logprobs = self.sampler(logits, sampled)
                tokens, logprobs = [[t] for t in one], [[lp] for lp in their_logprobs]
        except Exception:
            # A failing step fails the sequence that raises, not the server nor its batch neighbours: a batch
            # that fails is rerun one sequence at a time to find it.
            log.error("engine step failed:\n%s", traceback.format_exc())
            if len(plan) == 1:
                self._finish(plan[0].seq, "error", error="internal error while running the model")
            else:
                self.scheduler.isolate([item.seq for item in plan])
            return
        before = [len(seq.output_ids) for seq in sampled]
        self.scheduler.update(plan, tokens)
        # The logprobs of the tokens appended: a stop inside an accepted run drops the rest.
        self._emit(sampled, [lps[:len(seq.output_ids) - n]
                             for seq, lps, n in zip(sampled, logprobs, before, strict=True)])
        for item in plan:
            if item.pools:  # an embedding, finished by update: its one output carries the pooled vector
                self._send(item.seq)

    def _propose(self) -> None:
        """Speculative decoding: a proposal for each decoding sequence (none with a grammar, whose masks follow
        accepted tokens only; none while its proposals fail, see AcceptanceGate), at most what its max_tokens and
        the context leave room for; none at all while more sequences than speculative_max_seqs decode."""
        if self.proposer is None:
            return
        c, running = self.config, self.scheduler.running
        decoding = [s for s in running if s.decoding and s.grammar is None and s.pooling is None]
        going = len([s for s in running if s.decoding]) <= c.speculative_max_seqs
        for seq in running + list(self.scheduler.waiting):
            seq.draft = []
        asking = [seq for seq in (decoding if going else []) if self.gate.allows(seq)]
        ks = [min(c.num_speculative_tokens, seq.max_tokens - len(seq.output_ids) - 1,
                  self.max_model_len - seq.num_tokens) for seq in asking]
        try:
            drafts = self.proposer.propose(asking, ks)
        except Exception:
            # Proposals only ever save time: a proposer that fails (a draft model's error) is let go, and every
            # sequence goes on without them.
            log.error("speculative proposals failed, speculation is off from now on:\n%s", traceback.format_exc())
            self.proposer = None
            return
        for seq, draft in zip(asking, drafts, strict=True):
            seq.draft = draft

    def _emit(self, seqs: list[Sequence], logprobs: list[list[TokenLogprob | None]]) -> None:
        """Turn the step's new tokens into outputs: text, stop strings (which finish a sequence), timings."""
        now = time.perf_counter()
        self.metrics.observe_tokens([now - seq.arrival_time for seq in seqs if not seq.num_sent_tokens],
                                    [now - seq.last_token_time for seq in seqs if seq.num_sent_tokens])
        generated = 0
        for seq, logprob in zip(seqs, logprobs, strict=True):
            seq.last_token_time = now
            try:
                self._detokenize(seq, logprob)
            except Exception:
                # One sequence's text failing (a tokenizer's error) fails that request, not the engine loop.
                log.error("output of sequence %d failed:\n%s", seq.seq_id, traceback.format_exc())
                self._fail(seq, "internal error while decoding the output")
                continue
            generated += len(seq.output_ids) - seq.num_sent_tokens  # what a stop string left of the step's
            self._send(seq)
        self.metrics.generation_tokens.inc(generated)
        self.metrics.rates.add(time.time(), generated=generated)

    def _detokenize(self, seq: Sequence, logprob: list[TokenLogprob | None]) -> None:
        """The sequence's new tokens (and their logprobs) into its text; a stop string ends the sequence at the
        token that completes it, dropping any after it in the step."""
        new = seq.output_ids[seq.num_sent_tokens:]
        ended = self._ended_by_end_token(seq)
        for i, token in enumerate(new[:-1] if ended else new):
            seq.detokenizer.add_token(token)
            if seq.detokenizer.stopped:
                self.scheduler.stop_at(seq, seq.num_sent_tokens + i + 1)
                logprob, ended = logprob[:i + 1], False
                break
        seq.pending_logprobs += [lp for lp in logprob[:len(logprob) - ended] if lp is not None]

    def _ended_by_end_token(self, seq: Sequence) -> bool:
        """The sequence's last token is the end-of-generation or stop token that finished it: not part of the
        answer, so neither its text nor (as OpenAI's) a logprob entry; the entries' bytes then add up to the text.
        A request's own stop token is kept with include_stop_str_in_output, as vLLM keeps it."""
        last = seq.output_ids[-1] if seq.output_ids else None
        if seq.status != Status.FINISHED or seq.finish_reason != "stop" or last is None:
            return False
        return last in self.tokenizer.eos_token_ids or (
            last in seq.params.stop_token_ids and not seq.params.include_stop_str_in_output)

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
        """With the sequence's first output, where asked: its prompt's logprob entries in order."""
        if seq.params.prompt_logprobs is None or seq.num_sent_tokens or not seq.output_ids:
            return None
        return [seq.prompt_logprobs[p] for p in range(1, len(seq.prompt_ids))]

    @staticmethod
    def _embedding(seq: Sequence) -> list[float] | None:
        if seq.pooling is None or seq.pooled is None:
            return None
        vector = seq.pooled / len(seq.prompt_ids) if seq.pooling == "mean" else seq.pooled
        return torch.nn.functional.normalize(vector, dim=0).tolist()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence from outside the step's update (abort, failure) and send its last output."""
        if seq.status == Status.FINISHED:
            return
        self.scheduler.finish(seq, reason)
        self._send(seq, error)

    def _fail(self, seq: Sequence, error: str) -> None:
        """End a sequence with an error, also one the step's update just finished (its last output not sent)."""
        if seq.status == Status.FINISHED:
            seq.finish_reason = "error"
            self._send(seq, error)
        else:
            self._finish(seq, "error", error)

    def _send(self, seq: Sequence, error: str | None = None) -> None:
        """Hand the sequence's news to its sink. An output that fails to build ends the sequence with an error,
        and a sink that raises (its reader's loop closed) ends it unseen: either way that sequence alone, not the
        engine loop, and its blocks go back to the pool."""
        try:
            out = self._output(seq, error)
        except Exception:
            log.error("output of sequence %d failed:\n%s", seq.seq_id, traceback.format_exc())
            if seq.status != Status.FINISHED:
                self.scheduler.finish(seq, "error")
            seq.finish_reason = "error"
            out = SequenceOutput(seq.seq_id, "", [], [], "error", len(seq.prompt_ids), len(seq.output_ids),
                                 error="internal error while preparing the output")
        seq.num_sent_tokens, seq.pending_logprobs = len(seq.output_ids), []
        if out.finish_reason is not None:
            self._forget(seq)
        try:
            seq.sink(out)
        except Exception:
            log.error("sequence %d could not be given its output, it ends:\n%s", seq.seq_id, traceback.format_exc())
            if out.finish_reason is None:
                self.scheduler.finish(seq, "abort")
                self._forget(seq)

    def _output(self, seq: Sequence, error: str | None) -> SequenceOutput:
        final = seq.status == Status.FINISHED
        return SequenceOutput(
            seq_id=seq.seq_id, text=seq.detokenizer.take_delta(final=final),
            token_ids=seq.output_ids[seq.num_sent_tokens:], logprobs=seq.pending_logprobs,
            finish_reason=seq.finish_reason if final else None, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens or 0, error=error,
            embedding=self._embedding(seq) if final and seq.finish_reason == "stop" else None,
            prompt_logprobs=self._prompt_logprobs(seq),
        )

    def _forget(self, seq: Sequence) -> None:
        """A finished sequence's last output is on its way: the engine's own records of it go."""
        self._seqs.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.finish(seq)
        with self._unfinished_lock:
            self._unfinished -= 1
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

"""The engine's core: a loop on a background thread that owns the model, tokenizer and KV memory.

Callers on any thread `add` a request with a sink for its outputs; everything that touches the model happens on
the engine thread, one step at a time: schedule -> run -> sample -> update -> emit. What the engine is made of
comes from builder.py, the outputs from output.py, speculation's policy from spec.py.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tokenmill import __version__, backend
from tokenmill.config import EngineConfig
from tokenmill.engine.builder import build
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request import NOBODY, Owner, Sequence, SequenceOutput, Status, TokenLogprob
from tokenmill.engine.sampler import seeded_generator
from tokenmill.engine.spec import Proposer, Speculation
from tokenmill.engine.tensor_parallel import RankFailure, ShardedModel
from tokenmill.errors import EngineUnavailableError, RequestError
from tokenmill.loader import LoadedModel, weight_bytes
from tokenmill.loader.lora import load_adapter
from tokenmill.sampling import SamplingParams
from tokenmill.structured.backend import Grammar

log = logging.getLogger(__name__)

Sink = Callable[[SequenceOutput], None]


@dataclass
class _Arrival:
    """A sequence on its way from add() to the engine thread."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float
    grammar: Grammar | None
    embed: bool
    lora: str | None
    owner: Owner


class Engine:
    """Pass a LoadedModel, or let start() load config.model on the engine thread (builder.build says why)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._seqs: dict[int, Sequence] = {}
        self._namespaces: dict[str, int] = {}  # owners' prefix-cache namespaces, numbered as they come
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
        parts = build(self.config, self.loaded)
        self.loaded, self.kv_cache, self.max_model_len = parts.loaded, parts.kv_cache, parts.max_model_len
        self.scheduler, self.runner, self.sampler = parts.scheduler, parts.runner, parts.sampler
        self.grammars = parts.grammars
        self.tensor_parallel = parts.tensor_parallel
        self.lora = parts.lora
        self.speculation = Speculation(parts.proposer, self.config, self.max_model_len)
        self.tokenizer = self.loaded.tokenizer
        self.chat_template = self.loaded.chat_template
        self.model_path = self.loaded.path
        self.hidden_size = self.loaded.config.hidden_size  # an embedding's length
        self.output = OutputProcessor(self.tokenizer, self.metrics, self._end)

    @property
    def proposer(self) -> Proposer | None:
        """Speculative decoding's proposer; None without, or once one failed."""
        return self.speculation.proposer

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
        if self.config.freeze_gc:
            gc.unfreeze()  # this engine's cycles become collectable again (and every other engine's, until it starts)

    @property
    def system_fingerprint(self) -> str:
        """The API's system_fingerprint: the settings that decide a request's numbers (version, compute dtype,
        deterministic mode); read once started."""
        assert self.loaded is not None, "the engine has not loaded its model"
        mode = "-deterministic" if self.config.deterministic else ""
        return f"tokenmill-{__version__}-{str(self.loaded.dtype).removeprefix('torch.')}{mode}"

    def memory_bytes(self) -> int:
        """What its model's weights and its KV memory take on this host (read once started): a hosted model's
        footprint. Tensor-parallel ranks hold a share each, rank 0's as much as any."""
        assert self.loaded is not None, "the engine has not loaded its model"
        model = self.loaded.model
        local = sum(weight_bytes(model.model if isinstance(model, ShardedModel) else model))
        ranks = self.config.tensor_parallel_size // self.config.nnodes
        return (local + self.kv_cache.memory_bytes) * ranks

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
                      "age_s": round(now - seq.arrival_time, 3), "tenant": seq.owner.name}
                     for state, group in (("running", running), ("waiting", waiting)) for seq in group]
        ranks = {"size": 1} if self.tensor_parallel is None else self.tensor_parallel.describe()
        return {"running": len(running), "waiting": len(waiting), "kv": self.kv_cache.occupancy(),
                "tensor_parallel": ranks, "tenants": self.scheduler.shares(),
                **self.metrics.snapshot(speculative=self.proposer is not None), "sequences": sequences}

    def add(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, grammar: Grammar | None = None,
            embed: bool = False, lora: str | None = None, owner: Owner = NOBODY) -> int:
        """Queue one sequence (params.max_tokens resolved, ids checked: see api/engine_client.py); its outputs go to
        sink, called on the engine thread; grammar: its own, from self.grammars (structured output); embed: only
        prefill the prompt and send its pooled hidden state (config.pooling) as the one output; lora: the LoRA
        adapter it runs with (None: the base model); owner: the tenant it is served for. Returns its id, for
        abort."""
        seq_id = next(self._ids)
        with self._unfinished_lock:
            self._unfinished += 1
        self._inbox.put(("add", _Arrival(seq_id, prompt_ids, params, sink, time.perf_counter(), grammar, embed,
                                          lora, owner)))
        return seq_id

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded now (a glance from any thread)."""
        return [] if self.lora is None else list(self.lora.adapters)

    def load_lora(self, name: str, path: str, timeout: float = 60.0) -> None:
        """Read a PEFT adapter (in the caller's thread) and put it in a free slot (on the engine thread, between
        steps); a RequestError or ModelFormatError says why not."""
        if self.lora is None:
            raise RequestError("this server serves no LoRA adapters (--enable-lora)", param="lora_name")
        adapter = load_adapter(name, path, self.loaded.config, self.lora.max_rank)  # type: ignore[union-attr]
        self._on_engine_thread("load_lora", adapter, timeout)

    def unload_lora(self, name: str, timeout: float = 60.0) -> None:
        if self.lora is None:
            raise RequestError("this server serves no LoRA adapters (--enable-lora)", param="lora_name")
        self._on_engine_thread("unload_lora", name, timeout)

    def _on_engine_thread(self, kind: str, item: object, timeout: float) -> None:
        done: Future[None] = Future()
        if not self.alive or self._stopping:
            raise EngineUnavailableError("the engine is not running")
        self._inbox.put((kind, (item, done)))
        done.result(timeout)

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
            if self.config.freeze_gc:
                gc.collect()
                gc.freeze()
                # thawed before the interpreter's end too: an engine never stopped (the in-process chat's) left
                # the heap frozen into finalization, which crashed (SIGSEGV) as the process left
                atexit.unregister(gc.unfreeze)
                atexit.register(gc.unfreeze)
        except BaseException as exc:  # handed to start(), which raises it in the caller's thread
            self._start_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except RankFailure as exc:  # the engine ends (and the server with it): every request gets an error
            log.error("engine stopped: %s", exc)
            self._stopping = True
            self._drain_inbox(block=False)
            for seq in list(self._seqs.values()):
                self._finish(seq, "error", error="the server lost a tensor-parallel rank")
        finally:
            if self.tensor_parallel is not None:
                self.tensor_parallel.close()

    def _loop(self) -> None:
        while not self._stopping:
            # Block for news only when idle (the thread's OpenMP team let go meanwhile, so that another engine's
            # steps run at full speed); otherwise take what has arrived and step.
            idle = not self.scheduler.has_work()
            if idle:
                backend.release_threads(self.runner.device)
            self._drain_inbox(block=idle)
            if self.tensor_parallel is not None:
                self.tensor_parallel.check()
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
                self._add(item)  # type: ignore[arg-type]
            elif kind == "abort":
                seq = self._seqs.get(item)  # type: ignore[call-overload]
                if seq is not None:
                    self._finish(seq, "abort")
            elif kind == "abort_all":
                for seq in list(self._seqs.values()):
                    self._finish(seq, "abort")
            elif kind in ("load_lora", "unload_lora"):
                self._change_lora(kind, *item)  # type: ignore[misc]
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _change_lora(self, kind: str, item: object, done: Future[None]) -> None:
        assert self.lora is not None
        try:
            if kind == "load_lora":
                self.lora.load(item)  # type: ignore[arg-type]
            else:
                self.lora.unload(item)  # type: ignore[arg-type]
        except Exception as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _add(self, new: _Arrival) -> None:
        seq_id, prompt_ids, params, sink, owner = new.seq_id, new.prompt_ids, new.params, new.sink, new.owner
        device = self.runner.device
        adapter = None
        if new.lora is not None:
            adapter = None if self.lora is None else self.lora.adapters.get(new.lora)
            if adapter is None:  # unloaded between the API's look and now
                self._refuse(seq_id, len(prompt_ids), sink, f"the LoRA adapter {new.lora} is not loaded")
                return
        try:
            seq = Sequence(
                seq_id=seq_id, prompt_ids=prompt_ids, params=params,
                detokenizer=self.output.detokenizer(prompt_ids, params),
                sink=sink, arrival_time=new.arrival,
                # A seeded request samples from its own stream, so its tokens do not depend on its neighbours.
                generator=None if params.seed is None else seeded_generator(params.seed, device),
                grammar=new.grammar, pooling=self.config.pooling if new.embed else None, owner=owner,
                cache_salt=self._namespace(owner.cache_namespace) << 32,
            )
        except Exception:
            # A request the engine cannot take (one the API should have refused) fails alone, not the engine loop.
            log.error("sequence %d could not be added:\n%s", seq_id, traceback.format_exc())
            self._refuse(seq_id, len(prompt_ids), sink, "internal error while adding the request")
            return
        if adapter is not None and self.lora is not None:
            seq.lora_slot = adapter.slot
            seq.cache_salt += adapter.salt
            self.lora.users[adapter.slot] += 1
        self._seqs[seq_id] = seq
        self.scheduler.add(seq)

    def _namespace(self, name: str) -> int:
        """The number of an owner's prefix-cache namespace (0: the owner-less one), shifted above the adapters'
        salts: KV is shared only within one namespace and one adapter."""
        if not name:
            return 0
        return self._namespaces.setdefault(name, len(self._namespaces) + 1)

    def _refuse(self, seq_id: int, prompt_tokens: int, sink: Sink, error: str) -> None:
        """End a sequence that was never added: it is no longer unfinished, and its one output is the error."""
        with self._unfinished_lock:
            self._unfinished -= 1
        try:
            sink(SequenceOutput(seq_id, "", [], [], "error", prompt_tokens, 0, error=error))
        except Exception:
            log.error("sequence %d could not be given its error:\n%s", seq_id, traceback.format_exc())

    def _step(self) -> None:
        self.speculation.propose(self.scheduler.running, self.scheduler.waiting)
        plan = self.scheduler.schedule()
        # Before any output, so whoever has the step's tokens sees them counted; prefill: prompt chunks, and the
        # tokens a preempted sequence recomputes.
        self.metrics.count(self.scheduler, sum(item.num_tokens for item in plan if not item.seq.decoding))
        if not plan:
            return
        sampled = [item.seq for item in plan if item.samples]
        started = time.perf_counter()
        try:
            logits = self.runner.run(plan)
            tokens, logprobs = self._sample(logits, sampled, [item.draft for item in plan if item.samples])
        except Exception as exc:
            if self.tensor_parallel is not None:  # the ranks are out of step now: no step can run again
                self.tensor_parallel.check(exc)
            # A failing step fails the sequence that raises, not the server nor its batch neighbours: a batch
            # that fails is rerun one sequence at a time to find it.
            log.error("engine step failed:\n%s", traceback.format_exc())
            if len(plan) == 1:
                self._finish(plan[0].seq, "error", error="internal error while running the model")
            else:
                self.scheduler.isolate([item.seq for item in plan])
            return
        self.scheduler.time_decodes(plan, time.perf_counter() - started)
        self.scheduler.update(plan, tokens, self.output.finish_reason)
        self.output.emit(sampled, logprobs)
        for item in plan:
            if item.pools:  # an embedding, finished by update: its one output carries the pooled vector
                self.output.send(item.seq)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[list[int]]) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """Each sequence's tokens and their logprobs: one sampled, or a proposal's accepted tokens and one more."""
        if not any(drafts):
            one, logprobs = self.sampler(logits, seqs)
            return [[t] for t in one], [[lp] for lp in logprobs]
        tokens, per_token = self.sampler.verify(logits, seqs, drafts)
        self.metrics.count_drafts(drafts, tokens)
        self.speculation.record(seqs, drafts, tokens)
        return tokens, per_token

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence from outside the step's update (abort, failure) and send its last output."""
        if seq.status == Status.FINISHED:
            return
        self.scheduler.finish(seq, reason)
        self.output.send(seq, error)

    def _end(self, seq: Sequence, reason: str) -> None:
        """A sequence's last output is on its way (or its sink failed): it is finished (an error outranks the reason
        it had), and the engine's own records of it go."""
        self.scheduler.finish(seq, reason)
        self._seqs.pop(seq.seq_id, None)
        self.speculation.finish(seq)
        if seq.lora_slot >= 0 and self.lora is not None:
            self.lora.users[seq.lora_slot] -= 1
        with self._unfinished_lock:
            self._unfinished -= 1
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

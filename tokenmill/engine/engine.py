"""The engine: a loop on a background thread that owns the model, tokenizer and KV memory.

HTTP handlers call `submit` and iterate the returned stream; everything that touches the model happens on the
engine thread, one step at a time: schedule -> run -> sample -> postprocess.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator

import torch

from tokenmill.cache.kv_cache import build_kv_cache
from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.request import Sequence, SequenceOutput, Status, TokenLogprob
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.errors import RequestError
from tokenmill.loader import LoadedModel, load_model
from tokenmill.models.config import attention_crossover
from tokenmill.sampling import SamplingParams

log = logging.getLogger(__name__)


class RequestStream:
    """The asyncio side of one sequence: outputs arrive from the engine thread, thread-safely."""

    def __init__(self, engine: Engine, seq_id: int) -> None:
        self.seq_id = seq_id
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self.finished = False

    def put(self, output: SequenceOutput) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def __aiter__(self) -> AsyncIterator[SequenceOutput]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = output.finish_reason is not None
            yield output

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.seq_id)


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
        self.metrics = EngineMetrics()
        self._exported: dict[object, int] = {}
        # Sequences submitted and not finished, and how many of them run: the waiting ones are the difference.
        self._unfinished = 0
        self._unfinished_lock = threading.Lock()
        self._num_running = 0

    def _setup(self) -> None:
        if self.loaded is None:
            c = self.config
            if c.threads:
                torch.set_num_threads(c.threads)
            self.loaded = load_model(c.model, c.dtype, c.device, c.max_model_len, prepack=c.prepack_weights)
        loaded = self.loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        c = self.config
        self.kv_cache = build_kv_cache(c.kv, c.kv_cache_memory, c.block_size, loaded.config, loaded.dtype,
                                       loaded.device, c.max_num_seqs * loaded.max_model_len, c.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens, c.chunked_prefill,
                            c.long_prefill_token_threshold, c.long_prefill_chunk, attention_crossover(loaded.config)),
            self.kv_cache,
        )
        self.runner = ModelRunner(loaded.model, self.kv_cache, loaded.device)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, loaded.device, c.seed)

    # --- the asyncio side -------------------------------------------------------------------------------

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
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    def check_capacity(self, count: int) -> None:
        """Refuse `count` more sequences while the engine is down or its waiting queue is full (backpressure)."""
        if not self.alive:
            raise RequestError("the engine is not running", status=503, type="service_unavailable")
        waiting = self._unfinished - self._num_running
        if waiting + count > self.config.max_queued_requests:
            raise RequestError(
                f"The server is busy: {waiting} sequences are waiting, the queue holds "
                f"{self.config.max_queued_requests}. Retry later.",
                status=429, type="rate_limit_error", code="server_busy", headers={"Retry-After": "1"},
            )

    def abort_all(self) -> None:
        """Finish every unfinished sequence with finish_reason 'abort' (the end of a graceful shutdown)."""
        self._inbox.put(("abort_all", None))

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> int:
        """Resolve max_tokens against the context; refuse what can never fit, with the numbers."""
        if prompt_len == 0:
            raise RequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - prompt_len
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 1)
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the prompt, {max_tokens or 1} for the completion). Please reduce "
                f"the length of the prompt or of the completion.",
                param="max_tokens" if room >= 1 else "messages", code="context_length_exceeded",
            )
        max_tokens = room if max_tokens is None else max_tokens
        if prompt_len + max_tokens > self.kv_cache.capacity_tokens:
            raise RequestError(
                f"This request needs KV memory for {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion), more than the server's whole KV cache holds "
                f"({self.kv_cache.capacity_tokens} tokens). Please lower max_tokens.",
                param="max_tokens", code="kv_cache_exceeded",
            )
        return max_tokens

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue one sequence; call from the event loop. Raises RequestError for what can never run."""
        params.validate(self.tokenizer.vocab_size)
        max_tokens = self.check_fits(len(prompt_ids), params.max_tokens)
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
            raise RequestError("the prompt holds token ids outside the vocabulary", param="prompt")
        seq_id = next(self._ids)
        stream = RequestStream(self, seq_id)
        with self._unfinished_lock:
            self._unfinished += 1
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.loaded.device).manual_seed(params.seed)
        seq = Sequence(
            seq_id=seq_id, prompt_ids=prompt_ids, params=params, max_tokens=max_tokens,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                               params.include_stop_str_in_output),
            sink=stream.put, generator=generator, arrival_time=time.perf_counter(),
        )
        self._inbox.put(("add", seq))
        return stream

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))

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
            self._update_gauges()
        self._drain_inbox(block=False)  # what was submitted meanwhile is finished too, not left hanging
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort")

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                assert isinstance(item, Sequence)
                self._seqs[item.seq_id] = item
                self.scheduler.add(item)
            elif kind == "abort":
                seq = self._seqs.get(item)  # type: ignore[arg-type]
                if seq is not None:
                    self._finish(seq, "abort")
            elif kind == "abort_all":
                for seq in list(self._seqs.values()):
                    self._finish(seq, "abort")
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            return
        try:
            logits, sampled = self.runner.execute(plan)
            tokens, logprobs = self.sampler(logits, sampled)
        except Exception:
            # A failing step fails the sequence that raises, not the server nor its batch neighbours: a batch
            # that fails is rerun one sequence at a time to find it.
            log.error("engine step failed:\n%s", traceback.format_exc())
            if len(plan) == 1:
                self._finish(plan[0].seq, "error", error="internal error while running the model")
            else:
                self.scheduler.isolate([item.seq for item in plan])
            return
        self.scheduler.step_succeeded(plan)
        for seq, token, logprob in zip(sampled, tokens, logprobs, strict=True):
            self._append_token(seq, token, logprob)
        for seq in sampled:
            self._emit(seq)

    def _update_gauges(self) -> None:
        m, sched = self.metrics, self.scheduler
        self._num_running = len(sched.running)
        m.running.set(self._num_running)
        m.waiting.set(len(sched.waiting))
        m.kv_usage.set(self.kv_cache.usage())
        # Counters the scheduler keeps as totals: export what was added since the last look.
        for counter, total in ((m.preemptions, sched.num_preemptions),
                               (m.prefix_queries, sched.prefix_queried_tokens),
                               (m.prefix_hits, sched.prefix_hit_tokens)):
            counter.inc(total - self._exported.get(counter, 0))
            self._exported[counter] = total

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        now = time.perf_counter()
        if seq.output_ids:
            self.metrics.itl.observe(now - seq.last_token_time)
        else:
            self.metrics.ttft.observe(now - seq.arrival_time)
        seq.last_token_time = now
        self.metrics.generation_tokens.inc()
        seq.output_ids.append(token)
        seq.pending_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        p = seq.params
        seq.detokenizer.add_token(token)
        if token in p.stop_token_ids or (token in self.tokenizer.eos_token_ids and not p.ignore_eos):
            seq.finish_reason = "stop"
        elif seq.detokenizer.stopped:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _emit(self, seq: Sequence) -> None:
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason)
            return
        self._send(seq, None)

    def _send(self, seq: Sequence, finish_reason: str | None, error: str | None = None) -> None:
        out = SequenceOutput(
            seq_id=seq.seq_id, text=seq.detokenizer.take_delta(final=finish_reason is not None),
            token_ids=seq.pending_ids, logprobs=seq.pending_logprobs, finish_reason=finish_reason,
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
            cached_tokens=seq.num_cached_tokens or 0, error=error,
        )
        seq.pending_ids, seq.pending_logprobs = [], []
        seq.sink(out)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status == Status.FINISHED:
            return
        self.scheduler.finish(seq, reason)
        self._seqs.pop(seq.seq_id, None)
        with self._unfinished_lock:
            self._unfinished -= 1
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        self._send(seq, reason, error)

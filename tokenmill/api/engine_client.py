"""The API's side of the engine: admission (what a request must pass before the engine takes it) and the bridge
that carries a sequence's outputs from the engine thread to the asyncio handler awaiting them."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace

from tokenmill.engine.engine import Engine
from tokenmill.engine.request import NOBODY, Owner, SequenceOutput
from tokenmill.errors import EngineError, EngineUnavailableError, PermissionDeniedError, RequestError, ServerBusyError
from tokenmill.sampling import SamplingParams
from tokenmill.structured.backend import CompiledGrammar
from tokenmill.tenants.limits import TenantLimits
from tokenmill.tenants.usage import Usage, UsageLedger


@dataclass(frozen=True)
class Account:
    """Whom a request's sequences are served for and charged to: the tenant's name (usage goes by it, under
    `model`), its limits (None: none), the engine's view of it (owner), and its cap on max_tokens."""

    tenant: str = ""
    model: str = ""
    ledger: UsageLedger | None = None
    limits: TenantLimits | None = None
    owner: Owner = NOBODY
    max_tokens: int | None = None


@dataclass
class _Charge:
    """What a sequence's end counts in its request's usage: its prompt once per prompt (its first choice's), the
    request once (its first sequence's), as the answer's usage counts them; once, though an error may follow a
    finished sequence's last output."""

    account: Account
    prompt: bool = True
    request: bool = True
    recorded: bool = False

    def record(self, out: SequenceOutput) -> None:
        if self.account.ledger is None or out.finish_reason == "error" or self.recorded:
            return  # a failed sequence's answer is an error, with no usage
        self.recorded = True
        usage = Usage(out.prompt_tokens if self.prompt else 0, out.completion_tokens,
                      out.cached_tokens if self.prompt else 0, int(self.request))
        self.account.ledger.record(self.account.tenant, self.account.model, usage)


class _Mailbox:
    """Outputs bound for one event loop's streams: the engine thread drops them here and wakes the loop once for
    all it drops before the loop drains them, not once per output (a wake-up is a write to the loop's pipe: at 256
    streams, 256 a step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._outputs: list[tuple[asyncio.Queue[SequenceOutput], SequenceOutput]] = []

    def put(self, queue: asyncio.Queue[SequenceOutput], output: SequenceOutput) -> None:  # engine thread
        with self._lock:
            self._outputs.append((queue, output))
            if len(self._outputs) > 1:  # a wake-up is already on its way
                return
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # the loop
        with self._lock:
            outputs, self._outputs = self._outputs, []
        for queue, output in outputs:
            queue.put_nowait(output)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()


class RequestStream:
    """One sequence's outputs, put by the engine thread, iterated on the event loop."""

    def __init__(self, engine: Engine, charge: _Charge | None = None) -> None:
        self._engine = engine
        self._charge = charge
        loop = asyncio.get_running_loop()
        self._mailbox = _MAILBOXES.get(loop) or _MAILBOXES.setdefault(loop, _Mailbox(loop))
        self._queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self.seq_id = -1  # set once the engine has taken the sequence
        self.finished = False
        self.cut = False  # its tenant's tokens per minute ran out: it ends with "length", the stream with an error

    def put(self, output: SequenceOutput) -> None:  # engine thread
        if output.finish_reason == "quota":
            self.cut = True
            output = replace(output, finish_reason="length")
        if output.finish_reason is not None and self._charge is not None:
            self._charge.record(output)
        self._mailbox.put(self._queue, output)

    async def __aiter__(self) -> AsyncIterator[SequenceOutput]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = output.finish_reason is not None
            yield output

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.seq_id)


class EngineClient:
    """lora: the LoRA adapter every sequence submitted runs with (None: the base model); account: whom they are
    served for and charged to."""

    def __init__(self, engine: Engine, lora: str | None = None, account: Account | None = None) -> None:
        self.engine = engine
        self.lora = lora
        self.account = account or Account()

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int = 1, prompt_param: str = "prompt",
               grammar: CompiledGrammar | None = None, embed: bool = False,
               max_tokens_param: str = "max_tokens") -> list[RequestStream]:
        """n sequences per prompt, all or none; call from the event loop. A seeded request gives choice i the
        seed + i, so choices differ but repeat. prompt_param and max_tokens_param name the prompt's field and the
        output length's in errors; grammar: what every
        sequence's text must match (each follows it on its own); embed: each prompt's pooled hidden state is its
        one output (see Engine.add)."""
        self._check_capacity(len(prompts) * n)
        # every check before any add
        admitted = [(ids, self._admit(ids, params, prompt_param, max_tokens_param)) for ids in prompts]
        account = self.account
        if account.limits is not None:  # the last check: the prompts' tokens are counted if it passes
            account.limits.charge_prompt(sum(len(ids) for ids in prompts), generates=not embed)
        streams = []
        for k, (prompt_ids, resolved) in enumerate(admitted):
            for i in range(n):
                # past 2**64 - 1, seed + i wraps (sampler.seeded_generator)
                p = resolved if resolved.seed is None or i == 0 else replace(resolved, seed=resolved.seed + i)
                stream = RequestStream(self.engine, _Charge(account, prompt=i == 0, request=k == i == 0))
                stream.seq_id = self.engine.add(prompt_ids, p, stream.put, grammar.new() if grammar else None, embed,
                                                self.lora, account.owner)
                streams.append(stream)
        return streams

    def _check_capacity(self, count: int) -> None:
        """Refuse `count` more sequences while the engine is down or its waiting queue is full (backpressure)."""
        engine = self.engine
        if not engine.alive:
            raise EngineUnavailableError("the engine is not running")
        if engine.closed:
            raise EngineUnavailableError("the server is shutting down")
        limit, slots = engine.config.max_queued_requests, engine.config.max_num_seqs
        if count > slots + limit:
            raise RequestError(f"the request asks for {count} sequences (prompts x n); this server runs {slots} "
                               f"and queues {limit} at once", param="n")
        if engine.waiting_with(count) > limit:
            raise ServerBusyError(f"The server is busy: {engine.waiting_with(0)} sequences are waiting, the queue "
                                  f"holds {limit}. Retry later.")

    def _admit(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str,
               max_tokens_param: str) -> SamplingParams:
        """Check what needs the model, and resolve max_tokens against the context: the params the sequence runs
        with."""
        vocab = self.engine.tokenizer.vocab_size

        def outside(ids: Iterable[int]) -> int | None:
            return next((t for t in ids if not 0 <= t < vocab), None)

        if not prompt_ids:
            raise RequestError("the prompt is empty", param=prompt_param)
        if outside(prompt_ids) is not None:
            raise RequestError("the prompt holds token ids outside the vocabulary", param=prompt_param)
        if (token_id := outside(params.logit_bias)) is not None:
            raise RequestError(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab})",
                               param="logit_bias")
        if (token_id := outside(params.stop_token_ids)) is not None:
            raise RequestError(f"stop_token_ids: {token_id} is outside the vocabulary", param="stop_token_ids")
        return replace(params, max_tokens=self._max_tokens(len(prompt_ids), params.max_tokens, prompt_param,
                                                           max_tokens_param))

    def _max_tokens(self, prompt_len: int, asked: int | None, prompt_param: str, max_tokens_param: str) -> int:
        """What was asked, or the rest of the context; refuses what can never fit, with the numbers. The engine
        serves no context longer than its KV memory holds, so what fits the context fits the memory."""
        cap = self.account.max_tokens
        if cap is not None and asked is not None and asked > cap:
            raise PermissionDeniedError(f"{max_tokens_param} {asked} is more than this key may ask for ({cap})",
                                        param=max_tokens_param, code="max_tokens_not_allowed")
        limit = self.engine.max_model_len
        room, least = limit - prompt_len, 1 if asked is None else asked  # an embedding asks for 0: no output
        if room < least:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + least} tokens ({prompt_len} in the prompt, {least} for the completion). "
                f"Please reduce the length of the prompt or of the completion.",
                param=max_tokens_param if room >= 1 else prompt_param, code="context_length_exceeded",
            )
        if asked is not None:
            return asked
        return room if cap is None else min(room, cap)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, SequenceOutput]]:
    """Outputs of several sequences as they come, tagged with the choice index."""
    if len(streams) == 1:  # most requests: straight from the stream, not through a task and a second queue
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, SequenceOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for out in stream:
            await merged.put((index, out))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, out = await merged.get()
            if out is None:
                remaining -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[RequestStream]) -> list[list[SequenceOutput]]:
    """Every output of every choice, for a non-streaming answer; aborts all if the handler is cancelled."""
    results: list[list[SequenceOutput]] = [[] for _ in streams]
    try:
        async for index, out in merge(streams):
            results[index].append(out)
    finally:
        for s in streams:
            s.abort()
    for outs in results:
        if outs and outs[-1].finish_reason == "error":
            raise EngineError(outs[-1].error or "internal error while running the model")
    return results

"""The state of one sequence as it moves through the engine, and what the engine hands back for it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling import SamplingParams
from tokenmill.structured.backend import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens and their logprobs, best first


@dataclass
class SpeculationState:
    """A sequence's record of its proposals (engine/spec.py AcceptanceGate): the running acceptance rate, steps
    to go without proposals, and the pause the next one will take."""

    rate: float = 1.0
    skip: int = 0
    cooldown: int = 0


class TokenQuota(Protocol):
    def take(self, tokens: int) -> bool:
        """Count `tokens` more completion tokens against the owner's limit; False (counting none) where they do not
        fit, and the sequence ends there (finish reason "quota")."""
        ...


@dataclass(frozen=True)
class Owner:
    """Who a sequence is served for (a tenant, tenants/): the name and weight its fair share goes by, the prefix
    cache's namespace it may share KV within, and the quota its completion tokens are drawn from (None: none)."""

    name: str = ""
    weight: float = 1.0
    cache_namespace: str = ""
    quota: TokenQuota | None = None


NOBODY = Owner()  # a server without tenants: every sequence is the same owner's


@dataclass
class SequenceOutput:
    """One engine step's news for one sequence."""

    seq_id: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str | None = None
    embedding: list[float] | None = None  # an embedding sequence's result: the pooled vector, L2-normalized
    # SamplingParams.prompt_logprobs, with the first output: one entry per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved against the context at admission
    detokenizer: IncrementalDetokenizer
    sink: Callable[[SequenceOutput], None]  # called on the engine thread; must be thread-safe
    generator: torch.Generator | None = None  # seeded requests sample from their own stream
    grammar: Grammar | None = None  # structured output: what the text must match, advanced token by token
    pooling: str | None = None  # an embedding: "last" or "mean" of the prompt's final hidden states; never samples
    pooled: torch.Tensor | None = None  # its running sum (mean) or last hidden state, fp32, set by the runner
    lora_slot: int = -1  # the LoRA adapter's slot it runs with (engine/lora.py); -1: the base model
    cache_salt: int = 0  # the prefix cache's namespace: its adapter's and its owner's, 0 for neither
    owner: Owner = NOBODY
    # SamplingParams.prompt_logprobs: the entry of each prompt position after the first, set by the runner as the
    # prompt's chunks run (a recompute after preemption writes the same again)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    arrival_time: float = 0.0  # perf_counter() at submit, for time to first token
    last_token_time: float = 0.0
    decode_turn: int = 0  # the scheduler's count of decodes at its latest one: who goes first in a shared step
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache: the single measure of progress
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_sent_tokens: int = 0  # of output_ids, those already handed to the sink
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens not yet sent
    # Speculative decoding: tokens proposed to follow this sequence, checked by the next step (engine/spec.py).
    draft: list[int] = field(default_factory=list)
    speculation: SpeculationState = field(default_factory=SpeculationState)

    def __post_init__(self) -> None:
        if self.params.max_tokens is None:
            raise ValueError("max_tokens is resolved against the context before a sequence is made")

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens  # type: ignore[return-value]  # never None: see __post_init__

    @property
    def final_len(self) -> int:
        """The most tokens this sequence can reach: what its KV memory is reserved against."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def decoding(self) -> bool:
        """One token left to run: the step after it samples (a decode, or a prompt's last token)."""
        return self.num_tokens - self.num_computed_tokens == 1

    def tokens(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:  # a decode step's: no copy of the whole sequence
            return self.output_ids[start - prompt_len:end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[:end - prompt_len]

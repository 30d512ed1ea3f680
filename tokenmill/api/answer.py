"""What the chat and completions answers share: the reply's identity, usage, choices joined from engine outputs,
stream chunks and their usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.api.errors import error_body
from tokenmill.engine.request import SequenceOutput, TokenLogprob
from tokenmill.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one answer shares: its id, the model id, the engine's system_fingerprint, and
    the tokenizer that spells its logprobs' tokens."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    fingerprint: str | None = None


@dataclass(frozen=True)
class StreamUsage:
    """A stream's usage: in a last chunk (stream_options.include_usage), and with `continuous` in every chunk, each
    choice's so far (vLLM's continuous_usage_stats)."""

    include: bool = False
    continuous: bool = False


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def joined_outputs(outs: list[SequenceOutput]) -> tuple[str, list[TokenLogprob], str | None, int]:
    text = "".join(o.text for o in outs)
    logprobs = [lp for o in outs for lp in o.logprobs]
    last = outs[-1]
    return text, logprobs, last.finish_reason, last.completion_tokens


def cached_per_prompt(cached_by_choice: dict[int, int], n: int) -> int:
    """Prompt tokens served from the prefix cache, counted like prompt_tokens: once per prompt (its first choice)."""
    return sum(cached for index, cached in cached_by_choice.items() if index % n == 0)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason_of(finish: str | None, called: bool) -> str | None:
    """A sequence that ended on its own after calling tools, every call whole, finished to have them run."""
    return "tool_calls" if called and finish == "stop" else finish


def chunker(reply: Reply, object_: str, include_usage: bool) -> Callable[..., dict[str, Any]]:
    """Chunks of one stream share id, object, created, model and system_fingerprint; with include_usage each
    carries usage: null, or the usage given (vLLM's continuous_usage_stats)."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": reply.request_id, "object": object_, "created": created, "model": reply.model,
                "system_fingerprint": reply.fingerprint, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    return chunk


class ChoiceUsage:
    """Each choice's completion and cached tokens so far, for the last chunk's usage and, with vLLM's
    continuous_usage_stats (prompt_lengths: each prompt's tokens, choice i's being prompt i // n), every chunk's."""

    def __init__(self, n: int, prompt_lengths: list[int] | None) -> None:
        self.n, self.prompt_lengths = n, prompt_lengths
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def record(self, index: int, out: SequenceOutput) -> None:
        self.completion[index], self.cached[index] = out.completion_tokens, out.cached_tokens

    def of(self, index: int) -> dict[str, Any] | None:
        """Choice index's usage so far where every chunk carries one, else None."""
        if self.prompt_lengths is None:
            return None
        prompt = self.prompt_lengths[index // self.n]
        return usage_body(prompt, self.completion.get(index, 0), self.cached.get(index, 0))

    def total(self, prompt_tokens: int) -> dict[str, Any]:
        return usage_body(prompt_tokens, sum(self.completion.values()), cached_per_prompt(self.cached, self.n))


def stream_error(out: SequenceOutput) -> dict[str, Any]:
    return error_body(out.error or "internal error", "server_error")

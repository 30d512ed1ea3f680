"""OpenAI request models (pydantic) and their translation into SamplingParams.

Fields OpenAI defines keep OpenAI's names and defaults; vLLM's extensions (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output) are accepted too. Unknown fields are ignored,
as OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.errors import RequestError
from tokenmill.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(f"content parts of type {part.type!r} are not supported; send text",
                                   param="messages")
            parts.append(part.text)
        return "".join(parts)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None)
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if not 1 <= self.n <= 16:
            raise RequestError(f"n must be between 1 and 16, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 16:
            raise RequestError("at most 16 stop sequences are allowed", param="stop")
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError as exc:
            raise RequestError("logit_bias keys must be token ids", param="logit_bias") from exc
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise RequestError("messages must hold at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            message = {**m.model_dump(exclude_none=True), "content": m.text()}
            out.append(message)
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is supported only equal to n", param="best_of")
        if self.echo and self.stream:
            raise RequestError("echo is not supported with stream", param="echo")
        return self._sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field's four shapes as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

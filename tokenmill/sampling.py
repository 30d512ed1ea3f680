"""Per-request sampling parameters, validated once at the edge (the API), trusted everywhere after."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.errors import RequestError

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top k
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        def bad(message: str, param: str) -> RequestError:
            return RequestError(message, param=param)

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {value}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                      "repetition_penalty")
        for token_id, bias in self.logit_bias.items():
            if not 0 <= token_id < vocab_size:
                raise bad(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})",
                          "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise bad(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise bad(f"stop_token_ids: {token_id} is outside the vocabulary", "stop_token_ids")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty", "stop")
        if self.min_tokens < 0:
            raise bad("min_tokens must be >= 0", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens must not exceed max_tokens", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "top_logprobs")

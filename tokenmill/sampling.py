"""Per-request sampling parameters and their defaults (the one place they are set). Ranges are checked once, at the
edge (api/protocol.py); what needs the model (token ids in the vocabulary, max_tokens against the context) once,
at admission (api/engine_client.py). Trusted everywhere after."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length; resolved to a number at admission
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
    # None: off; k >= 0: each prompt token's logprob (after the first) plus the top k at its position, as the
    # model read the prompt (the prefix cache is skipped: cached positions have no logits)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Special tokens whose text the output keeps (they are skipped otherwise): what delimits a tool call
    shown_special_token_ids: list[int] = field(default_factory=list)

"""Every toggle in one place. The CLI's flags are generated from these fields (cli.py), one flag per field."""

from __future__ import annotations

from dataclasses import dataclass, field


def _opt(default, help: str):  # noqa: A002 - the argparse word
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    model: str = _opt("smollm2-135m", "a .gguf file, a Hugging Face folder, a hub id or an alias")
    dtype: str = _opt("auto", "compute dtype: auto (bf16 on CUDA and AMX CPUs, else fp32), float32, bfloat16, "
                              "float16")
    device: str = _opt("auto", "auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    max_model_len: int | None = _opt(None, "context length served (default: the model's, at most 8192)")
    max_num_seqs: int = _opt(64, "sequences running at once")
    max_num_batched_tokens: int = _opt(2048, "tokens one engine step may process (prefill chunks + decodes)")
    chunked_prefill: bool = _opt(True, "prefill long prompts in chunks that interleave with other users' decodes")
    long_prefill_token_threshold: int = _opt(
        64, "while others decode, a prompt prefills at most this many tokens a step (0: the whole budget)")
    kv: str = _opt("paged", "KV memory layout: paged (a pool of fixed-size blocks) or contiguous (one buffer per "
                            "sequence, reserved for its whole length)")
    block_size: int = _opt(16, "tokens per KV block (paged)")
    prefix_caching: bool = _opt(True, "share the KV of prompt prefixes computed before (radix tree over blocks)")
    kv_cache_memory: str | None = _opt(None, "KV memory, e.g. 2GiB (default: 10%% of available RAM on CPU, 85%% of "
                                             "free GPU memory on CUDA, at most what max-num-seqs full contexts need)")
    seed: int = _opt(0, "seed of the sampler for requests that give none")
    threads: int | None = _opt(None, "CPU threads for the model (default: torch's choice)")


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to bind; 127.0.0.1 keeps the server local")
    port: int = _opt(8000, "TCP port")
    served_model_name: str | None = _opt(None, "the model id /v1/models lists (default: the MODEL argument)")
    log_level: str = _opt("info", "debug, info, warning or error")

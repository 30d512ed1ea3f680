"""Every toggle in one place. The CLI's flags are generated from these fields (cli.py), one flag per field.

Each config's `check()` refuses what is wrong with its settings alone, before any model loads; what depends on the
model (its context, its kernels) is refused where that is known."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ByteSize, TypeAdapter, ValidationError

from tokenmill import cpu
from tokenmill.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def option(default, help: str, choices: Sequence[str] | None = None):  # noqa: A002 - the argparse word
    """choices: the values the field takes (None aside, where it is optional); `check()` and the CLI refuse others."""
    return field(default=default, metadata={"help": help, "choices": choices})


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError as exc:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1.5GB)") from exc


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, what: str = "keep_alive") -> float | None:
    """Ollama's keep_alive: seconds as a number, or a duration ("5m", "1h30m", "500ms"); a negative one: forever
    (None); 0: unload as soon as idle."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{what}: a duration such as 5m, 30s or 1h, seconds, or -1 for forever")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            text = text.removeprefix("-")
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ConfigError(f"{what} {value!r}: a duration such as 5m, 30s or 1h, seconds, or -1 for "
                                  "forever") from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        seconds = float(value)
    if seconds != seconds:  # NaN
        raise ConfigError(f"{what}: not a number")
    return None if seconds < 0 else seconds


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _check_choices(config: object) -> None:
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{_flag(f.name)} {value}: choose {', '.join(choices[:-1])} or {choices[-1]}")


def _check_counts(config: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)} {value}: at least 1")


@dataclass(frozen=True)
class WeightPlan:
    """How a model's weights are held and run, passed whole from the settings to the loader and the model builder
    (loader.load_model, models/registry.py build_model): the compute dtype and device ("auto": resolved there,
    from the device and the CPU probe), and the weight layouts.

    quantized: keep a GGUF's quantized matrices in their quantization where the CPU's or GPU's kernels run them;
    dense_budget: bytes that dense copies of them may take, for many-row steps (None: the default for the CPU and
    dtype); dequantize_from_rows: without copies, steps of this many rows or more dequantize each matrix for its
    matmul (0: never); prepack: reorder dense weights for the CPU's matmul library; fused_decode: decode steps run
    each layer as one C++ op; stacked_decode: every layer's in one call a step; deterministic: batch-invariant
    throughout; tiles_from_rows: a bf16 model's steps of this many rows or more run on AMX tiles where there are any
    (0: never, None: the default); bf16_kernels: on CPU, dense matrices of bf16 values run tokenmill's kernels;
    bf16_pair_matmul: there, bf16 rows multiply them as bf16 pairs (on, off, or auto: measured); huge_pages: on CPU,
    the weights the kernels read lie in memory the OS may back with 2 MiB pages."""

    dtype: str = "auto"
    device: str = "auto"
    quantized: bool = True
    dense_budget: int | None = 0
    dequantize_from_rows: int = 0
    prepack: bool = True
    fused_decode: bool = True
    deterministic: bool = False
    stacked_decode: bool = True
    tiles_from_rows: int | None = 0
    bf16_kernels: bool = True
    bf16_pair_matmul: str = "auto"
    huge_pages: bool = True


# `--help` shows the flags in these groups, in this order; the A/B switches and kernel tuning last (each exists to
# measure an optimization by turning it off, or to tune a kernel's threshold).
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device", "max_model_len", "allow_long_max_model_len", "threads", "pooling",
              "chat_template"),
    "several models": ("models_file", "max_memory", "keep_alive", "model_load_timeout"),
    "scheduling and KV memory": ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_queued_requests",
                                 "kv_cache_dtype", "fair_share", "shared_step_ms", "seed",
                                 "deterministic"),
    "LoRA adapters": ("lora", "enable_lora", "max_loras", "max_lora_rank"),
    "tensor parallelism": ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port"),
    "speculative decoding": ("speculative", "draft_model", "num_speculative_tokens", "prompt_lookup_min",
                             "prompt_lookup_max", "speculative_max_seqs"),
    "server": ("host", "port", "served_model_name", "log_level", "ui", "api_key", "api_keys", "allowed_origins",
               "shutdown_timeout"),
    "API: limits and features": ("max_request_bytes", "max_json_depth", "max_seqs_per_request", "max_messages",
                                 "max_stop", "max_embedding_inputs", "max_logit_bias", "chat_template_timeout",
                                 "chat_template_max_chars", "grammar_compile_timeout", "tool_call_parser",
                                 "responses_store", "responses_store_max", "allow_request_chat_template"),
    "A/B switches and kernel tuning": ("chunked_prefill", "long_prefill_token_threshold", "long_prefill_chunk", "kv",
                                       "block_size", "prefix_caching", "sliding_window_kv", "prepack_weights",
                                       "quantized_weights", "dense_weights_budget", "dequantize_from_rows",
                                       "amx_from_rows", "bf16_kernels", "fused_decode_layers",
                                       "stacked_decode_layers", "decode_fetch_ahead", "huge_pages",
                                       "cpu_prefill_attention",
                                       "amx_attention", "bf16_pair_attention", "bf16_pair_matmul",
                                       "tp_shared_memory", "freeze_gc", "enforce_eager",
                                       "gpu_row_matmul", "gpu_pdl"),
}


@dataclass
class EngineConfig:
    model: str = option("smollm2-135m", "a .gguf file, a Hugging Face folder, a hub id or an alias")
    dtype: str = option("auto", "compute dtype: auto (bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else "
                              "fp32), float32, bfloat16, float16",
                        ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"))
    device: str = option("auto", "auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    max_model_len: int | None = option(None, "context length served (default: the model's, at most 8192)")
    allow_long_max_model_len: bool = option(
        False, "let --max-model-len exceed the context the model was trained for (past it the output degrades; "
               "refused otherwise, as vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set)")
    max_num_seqs: int = option(64, "sequences running at once")
    max_num_batched_tokens: int = option(2048, "tokens one engine step may process (prefill chunks + decodes)")
    chunked_prefill: bool = option(True, "prefill long prompts in chunks that interleave with other users' decodes")
    long_prefill_token_threshold: int = option(
        256, "a prompt of more tokens than this is long (0: none is)")
    long_prefill_chunk: int = option(
        32, "while others decode, long prompts together prefill at most this many tokens a step, fewer as their "
            "context grows, so the decoders' inter-token latency stays low (0: no cap)")
    kv: str = option("paged", "KV memory layout: paged (a pool of fixed-size blocks) or contiguous (one buffer per "
                            "sequence, reserved for its whole length)", ("paged", "contiguous"))
    block_size: int = option(16, "tokens per KV block (paged)")
    kv_cache_dtype: str = option("auto", "the KV cache's numbers: auto (the compute dtype), bf16, or quantized "
                                         "with a scale per token and KV head, int8 or fp8_e4m3 (fp8): about twice "
                                         "the tokens in the same memory (paged, CPU)",
                                 ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "int8"))
    prefix_caching: bool = option(True, "share the KV of prompt prefixes computed before (radix tree over blocks)")
    sliding_window_kv: bool = option(True, "paged, a model with sliding-window layers (Gemma 3): those layers keep "
                                           "only the blocks their window sees, in a pool of their own sized for "
                                           "--max-num-seqs windows (off: every layer keeps every token)")
    kv_cache_memory: str | None = option(None, "KV memory, e.g. 2GiB (default: 10%% of available RAM on CPU, 85%% of "
                                             "free GPU memory on CUDA, at most what max-num-seqs full contexts need)")
    max_queued_requests: int = option(256, "sequences that may wait for a slot; beyond, requests get 429 with "
                                           "Retry-After")
    fair_share: bool = option(True, "with tenants (--api-keys): admit and preempt by the tokens each tenant was "
                                    "served recently against its weight, so no tenant's burst starves another "
                                    "(off: first come, first served)")
    shared_step_ms: float = option(0.0, "with the fair share, while two or more tenants were served recently: "
                                        "a step decodes only as many sequences as fit in about this many "
                                        "milliseconds (by the measured time of a decode), the least served "
                                        "tenants' first, so that a tenant's new request waits less for the step "
                                        "in progress, at some of the busiest tenant's throughput (0: every "
                                        "running sequence decodes every step)")
    seed: int = option(0, "seed of the sampler for requests that give none")
    chat_template: str | None = option(None, "a Jinja chat template file to use instead of the model's own")
    pooling: str = option("last", "/v1/embeddings: the prompt's final hidden states pooled as last (the last "
                                  "token's, for decoder embedding models such as Qwen3-Embedding) or mean; "
                                  "L2-normalized", ("last", "mean"))
    threads: int | None = option(None, "CPU threads for the model (default: torch's choice)")
    prepack_weights: bool = option(True, "on CPU, reorder the weights once at load into oneDNN's blocked layout "
                                         "(matmuls several times faster)")
    quantized_weights: bool = option(True, "keep a GGUF's Q2_K-Q6_K/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrices in their "
                                           "quantization, run by tokenmill's C++ kernels on CPU and Triton kernels "
                                           "on CUDA (off: dequantize them to --dtype at load)")
    dense_weights_budget: str = option("auto", "memory that dense copies of the quantized weights may take, for "
                                               "steps of 32 rows or more (on CUDA: more than 8); beyond it (or 0) "
                                               "every step runs the quantized kernels (on CUDA, longer steps "
                                               "dequantize each matrix for cuBLAS). auto: 0 (the kernels, and AMX "
                                               "tiles where there are any, are as fast as dense matmuls or faster), "
                                               "but 1GiB for bf16 on a CPU with AMX when the tiles are off")
    dequantize_from_rows: int = option(0, "without dense copies, steps of this many rows or more (prefill chunks) "
                                          "dequantize each quantized matrix into a transient dense one for the "
                                          "matmul library (0: never; slower than the kernels wherever measured)")
    amx_from_rows: int | None = option(None, "on a CPU with AMX, a bf16 model's steps of this many rows or more "
                                             "(prefill, large batches) run the quantized matrices on AMX tiles, "
                                             "each panel of weights dequantized to bf16 in cache (0: never; default "
                                             "24, and then no dense copies by default; 1 where every matrix is bf16 "
                                             "weights kept for the kernels, which the tiles read as they lie)")
    bf16_kernels: bool = option(True, "on CPU, a dense model's matrices of bf16 values (a bf16 model; an fp32 one of "
                                      "a bf16 checkpoint) are kept in bf16 in the layout of tokenmill's quantized "
                                      "kernels and run by them: decode steps run each layer fused, and on a CPU "
                                      "with AMX every step's matmuls run on tiles read from the weights as they lie "
                                      "(off: oneDNN's prepacked matmuls, op by op)")
    fused_decode_layers: bool = option(True, "on CPU, decode steps with the weights kept for the kernels (quantized "
                                             "or bf16; of fewer than 32 rows where dense copies exist) run each "
                                             "decoder layer as one C++ op on fp32 rows, whatever the dtype (off: one "
                                             "op per norm, projection, RoPE, attention...)")
    stacked_decode_layers: bool = option(True, "where decode steps run the fused layers, one C++ call runs them all, "
                                               "the loop over the layers in C++ (off: one call a layer from Python)")
    decode_fetch_ahead: bool = option(True, "on CPU, decode attention fetches the next chunk of keys and values "
                                            "a thread takes into its cache while it works on the present one, so "
                                            "that reading the KV pool overlaps the arithmetic; one switch for the "
                                            "process (off: each chunk's rows come from memory as it reads them)")
    huge_pages: bool = option(True, "on CPU, the weights tokenmill's kernels read (quantized, or bf16 kept for "
                                    "them) lie in one mapping advised for transparent huge pages, where the OS "
                                    "grants them: a step streams them with fewer TLB misses (off: the allocator's "
                                    "pages)")
    cpu_prefill_attention: bool = option(True, "on CPU, prompt chunks attend through tokenmill's flash-attention "
                                               "kernel, straight from the paged KV pool (off: torch's SDPA over "
                                               "keys gathered from it, with a mask)")
    amx_attention: bool = option(True, "on a CPU with AMX, bf16 prompt chunks attend on AMX tiles in tokenmill's "
                                       "flash-attention kernel (off: on bf16 pairs or fp32, as "
                                       "--bf16-pair-attention picks)")
    bf16_pair_attention: str = option("auto", "on CPU with AVX512-BF16, bf16 prompt chunks attend on bf16 pairs "
                                              "(vdpbf16ps) or on fp32 tiles: auto measures which runs faster at "
                                              "start", ("auto", "on", "off"))
    bf16_pair_matmul: str = option("auto", "on CPU with AVX512-BF16, a bf16 model's rows multiply its bf16 weights "
                                           "(kept for the kernels) as bf16 pairs (vdpbf16ps) or widened to fp32 "
                                           "multiply-adds: auto measures which runs faster at start",
                                   ("auto", "on", "off"))
    lora: tuple[str, ...] = option((), "a LoRA adapter served beside the model as NAME=PATH (a PEFT folder: "
                                        "adapter_config.json and adapter_model.safetensors; or a GGUF adapter as "
                                        "llama.cpp converts one); NAME is a model name in requests and /v1/models; "
                                        "repeat for several")
    enable_lora: bool = option(False, "serve LoRA adapters (on with --lora): loaded at start (--lora) or at run "
                                      "time (POST /v1/load_lora_adapter), requests for different adapters and the "
                                      "base model in the same steps")
    max_loras: int = option(4, "LoRA adapters loaded at once (each takes a slot beside every adapted projection)")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have (the slots' rank)")
    tensor_parallel_size: int = option(1, "ranks on this host that each hold a share of every layer's heads and "
                                          "MLP rows, run each step together and sum their partial results (on CPU "
                                          "each rank takes --threads, by default the CPUs split among them)")
    nnodes: int = option(1, "hosts the tensor-parallel ranks span, each running --tensor-parallel-size / --nnodes "
                            "of them; the ranks of several hosts sum through torch.distributed's gloo")
    node_rank: int = option(0, "this host's place among --nnodes: 0 serves the API and runs rank 0; the others run "
                               "only their ranks (start them with the same model and flags)")
    master_addr: str = option("127.0.0.1", "the address of host 0, where the ranks meet (torch.distributed's TCP "
                                           "store); with --nnodes > 1, one the other hosts can reach")
    master_port: int | None = option(None, "the port the ranks meet on at --master-addr (default: a free one, on "
                                           "one host; needed with --nnodes > 1)")
    tp_shared_memory: bool = option(True, "tensor-parallel ranks on one CPU host all-reduce through shared memory "
                                          "(off: torch.distributed's gloo)")
    freeze_gc: bool = option(True, "once the model is loaded, Python's garbage collector sets aside every object "
                                   "alive then (gc.freeze): its full collections, which pause every stream, then "
                                   "walk only what serving made, not the model, tokenizer and libraries; thawed "
                                   "when the engine stops or the process exits")
    enforce_eager: bool = option(False, "on CUDA, run decode steps op by op instead of replaying CUDA graphs (one "
                                        "per batch size 1, 2, 4, 8, 16, 24, ... up to --max-num-seqs, captured at "
                                        "start-up)")
    gpu_row_matmul: bool = option(True, "on CUDA, a one-sequence decode step's projections run as one Triton "
                                        "kernel each, with the norm or SwiGLU before them fused in (off: cuBLAS, "
                                        "and a kernel each for the norms and SwiGLU)")
    gpu_pdl: bool = option(True, "on a CUDA GPU of sm_90 or newer (H100, H200, Blackwell), tokenmill's Triton "
                                 "kernels launch with programmatic dependent launch: each starts while the one "
                                 "before it finishes, the projections reading their weights meanwhile (off: each "
                                 "starts when the one before has ended)")
    speculative: str | None = option(None, "speculative decoding: ngram (prompt lookup: the tokens that followed "
                                           "the latest earlier occurrence of the sequence's last n-gram are proposed "
                                           "and checked in the next step, lossless) or suffix (the same, then "
                                           "earlier requests' prompts and outputs) or draft (a smaller model of the "
                                           "same vocabulary guesses, --draft-model); default off",
                                    ("ngram", "suffix", "draft"))
    draft_model: str | None = option(None, "--speculative draft: the draft model (a .gguf file, a Hugging Face "
                                           "folder or an alias) of the model's vocabulary, loaded with the model's "
                                           "dtype and weight options")
    num_speculative_tokens: int = option(4, "tokens proposed per sequence and step")
    prompt_lookup_min: int = option(2, "ngram: the shortest suffix n-gram looked up")
    prompt_lookup_max: int = option(5, "ngram: the longest suffix n-gram looked up (the longest found wins)")
    speculative_max_seqs: int = option(4, "speculation pauses while more sequences than this decode (a batch "
                                          "already fills the step: proposals would only add work)")
    deterministic: bool = option(False, "same request, same tokens: each token's logits depend only on its own "
                                        "request, never on the batch it shares, how its prompt was chunked or what "
                                        "the prefix cache held (batch-invariant kernels; CPU with the C++ kernels, "
                                        "paged KV; no dense weight copies)")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora's (name, path) pairs."""
        return [(entry.partition("=")[0], entry.partition("=")[2]) for entry in self.lora]

    def weight_plan(self) -> WeightPlan:
        """The weight settings, for the model and a draft model alike."""
        budget = None if self.dense_weights_budget == "auto" else parse_size(self.dense_weights_budget)
        return WeightPlan(dtype=self.dtype, device=self.device, quantized=self.quantized_weights, dense_budget=budget,
                          dequantize_from_rows=self.dequantize_from_rows, prepack=self.prepack_weights,
                          fused_decode=self.fused_decode_layers, stacked_decode=self.stacked_decode_layers,
                          deterministic=self.deterministic, tiles_from_rows=self.amx_from_rows,
                          bf16_kernels=self.bf16_kernels, bf16_pair_matmul=self.bf16_pair_matmul,
                          huge_pages=self.huge_pages)

    def check(self) -> None:
        """Refuse (ConfigError) what is wrong with these settings alone, before the model loads."""
        _check_choices(self)
        # A step of no tokens would never run anything (a server whose requests waited forever).
        _check_counts(self, ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "threads",
                             "num_speculative_tokens", "tensor_parallel_size", "nnodes", "max_loras",
                             "max_lora_rank"))
        if not 0 <= self.shared_step_ms < float("inf"):  # NaN too
            raise ConfigError(f"--shared-step-ms {self.shared_step_ms}: 0 (off) or a positive number of ms")
        for entry in self.lora:
            name, _, path = entry.partition("=")
            if not name or not path:
                raise ConfigError(f"--lora {entry}: give NAME=PATH (a PEFT adapter folder)")
        if self.lora_enabled and self.tensor_parallel_size > 1:
            raise ConfigError("LoRA adapters are not served with --tensor-parallel-size > 1 yet")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"--prompt-lookup-min {self.prompt_lookup_min} --prompt-lookup-max "
                              f"{self.prompt_lookup_max}: n-grams of at least 1 token, min at most max")
        if self.chat_template and not os.path.isfile(self.chat_template):
            raise ConfigError(f"--chat-template {self.chat_template}: no such file")
        if self.draft_model is not None and self.speculative != "draft":
            raise ConfigError("--draft-model is read with --speculative draft only")
        if self.speculative == "draft" and self.draft_model is None:
            raise ConfigError("--speculative draft needs --draft-model (a smaller model of the same vocabulary)")
        if self.deterministic and self.kv != "paged":
            raise ConfigError("--deterministic needs --kv paged: its attention reads every row through the block "
                              "tables")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size} does not divide among --nnodes "
                              f"{self.nnodes} hosts")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank}: a host of --nnodes {self.nnodes} is 0 to "
                              f"{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr): where the hosts' ranks meet")
        if self.kv_cache_dtype != "auto" and self.kv != "paged":
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype} needs --kv paged: a cache of its own dtype "
                              "lives in the block pool")
        if self.tensor_parallel_size > 1 and self.kv != "paged":
            raise ConfigError("--tensor-parallel-size needs --kv paged: every rank's pool holds the same blocks")
        if self.kv_cache_memory:  # None or "": the default
            parse_size(self.kv_cache_memory)
        if self.dense_weights_budget != "auto":
            parse_size(self.dense_weights_budget)
        cpu.level(), cpu.auto_dtype()  # the environment's TOKENMILL_CPU_ISA and TOKENMILL_DTYPE


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind; 127.0.0.1 keeps the server local")
    port: int = option(8000, "TCP port")
    served_model_name: str | None = option(None, "the model id /v1/models lists (default: the MODEL argument)")
    models_file: str | None = option(None, "a TOML file of the models to serve, a [[models]] table each: source, "
                                           "name, aliases, keep_alive, tool_call_parser and any engine setting "
                                           "(docs/features/many-models.md); the flags are every model's defaults")
    max_memory: str | None = option(None, "memory the loaded models may take together, e.g. 12GiB; a load that "
                                          "would pass it first unloads the least recently used idle models "
                                          "(default: what the machine has)")
    keep_alive: str = option("-1", "how long a model stays loaded once idle, e.g. 5m, 30s, 1h, 0 (at once); -1: "
                                   "until its memory is needed (a request's own keep_alive field overrides it)")
    model_load_timeout: float = option(300.0, "seconds a request waits for its model to load (or for memory to "
                                              "free) before a 503 with Retry-After")
    log_level: str = option("info", "how much the server logs", LOG_LEVELS)
    ui: bool = option(True, "the chat page at / and the engine dashboard at /dashboard (--no-ui: neither)")
    api_key: tuple[str, ...] = option((), "accept only requests that carry one of these keys as a Bearer token (every "
                                          "route but /health); repeat for several; default: $TOKENMILL_API_KEY, "
                                          "comma-separated, or none")
    api_keys: str | None = option(None, "a TOML file of tenants and their keys' hashes, with each tenant's limits, "
                                        "allowed models, fair-share weight and role (docs/features/tenants.md; "
                                        "`tokenmill keys add NAME --file FILE` makes a key); re-read on SIGHUP "
                                        "and when it changes")
    allowed_origins: tuple[str, ...] = option((), "origins allowed cross-origin requests (CORS), e.g. "
                                                  "http://localhost:3000 or *; default: CORS off")
    shutdown_timeout: float = option(30.0, "seconds that SIGTERM lets in-flight requests finish before aborting them")
    max_request_bytes: int = option(4 * 2**20, "largest request body (413 beyond)")
    max_json_depth: int = option(32, "deepest nesting of arrays and objects in a request body")
    max_seqs_per_request: int = option(16, "sequences one request may ask for: n, times the prompts of a completion")
    max_messages: int = option(1024, "messages of one chat request")
    max_stop: int = option(16, "stop strings of one request")
    max_embedding_inputs: int = option(256, "inputs of one /v1/embeddings request")
    max_logit_bias: int = option(1024, "logit_bias entries of one request")
    chat_template_timeout: float = option(2.0, "seconds a chat template may take to render one request")
    chat_template_max_chars: int = option(8 * 2**20, "characters a chat template may render for one request")
    grammar_compile_timeout: float = option(2.0, "seconds a request's JSON schema, regex or grammar may take to "
                                                 "compile (400 beyond)")
    tool_call_parser: str | None = option(None, "the tool-call format read from outputs: hermes, smollm2 or "
                                                "llama3_json (default: chosen from the chat template)",
                                         ("hermes", "smollm2", "llama3_json"))
    responses_store: str | None = option(None, "SQLite file of stored Responses (previous_response_id, GET/DELETE "
                                               "/v1/responses/ID); default: responses.sqlite3 in tokenmill's cache "
                                               "directory; off: store none")
    responses_store_max: int = option(10_000, "stored Responses kept; beyond, the oldest are deleted")
    allow_request_chat_template: bool = option(False, "let requests bring their own chat_template (rendered in the "
                                                      "same sandbox)")

    def check(self) -> None:
        """Refuse (ConfigError) what is wrong with these settings alone, before the model loads."""
        _check_choices(self)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: a TCP port is 0 to 65535")
        if self.max_memory:
            parse_size(self.max_memory)
        parse_keep_alive(self.keep_alive, "--keep-alive")
        if not self.model_load_timeout > 0:
            raise ConfigError(f"--model-load-timeout {self.model_load_timeout}: more than 0 seconds")

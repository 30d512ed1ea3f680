"""Shared test helpers: a tiny GGUF writer, running the engine without HTTP, an in-process server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import openai
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFWriter
from gguf.quants import dequantize, quantize

from tokenmill import cpu, kernels
from tokenmill.api.engine_client import EngineClient, RequestStream
from tokenmill.api.server import build_server, listen
from tokenmill.bench.noise import prefill_logits as our_logits  # noqa: F401 - the tests' name for it
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import SequenceOutput
from tokenmill.hosting.pool import ModelPool
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the alphabet of a byte-level BPE vocabulary)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


# Byte offsets, inside one block, of the fp16 super-block scales of each K-quant (d, and dmin where it has one).
_KQUANT_SCALES = {
    GGMLQuantizationType.Q2_K: (80, 82), GGMLQuantizationType.Q3_K: (108,), GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,),
}


def _random_kquant(rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf can decode them but not encode them), scaled so the weights have std 0.2."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for offset in _KQUANT_SCALES[qtype]:
            blocks[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    set_scales(1.0)
    set_scales(0.2 / float(dequantize(blocks.reshape(rows, -1), qtype).std()))
    return blocks.reshape(rows, -1)


def _encode(data: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray | None:
    """data in qtype's blocks, or None where it cannot be (not a matrix or a stack of them (MoE experts), rows not
    a whole number of blocks)."""
    if qtype == GGMLQuantizationType.F32 or data.ndim not in (2, 3) or data.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return None
    if qtype in _KQUANT_SCALES:
        rows = data.reshape(-1, data.shape[-1])
        return _random_kquant(*rows.shape, qtype, rng).reshape(*data.shape[:-1], -1)
    return quantize(data, qtype)


TINY_TOKENS = _byte_to_unicode() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # 256 bytes + 3 controls


def _put(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_int32 if value < 0 else writer.add_uint32)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


# Where each type's fp16 scale fields sit in its block: random bytes there could be NaN or huge.
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0,
                  fill: int | None = None) -> np.ndarray:
    """Random blocks of qtype (every bit pattern of the quants, sane scales): raw bytes [rows, bytes per row]; fill:
    every byte but the fp16 scales this one instead, the K-quants' packed sub-block scales included (0xFF: every
    code of Q4_*, Q5_* and Q6_K its largest; 0x80: Q8_0's largest in magnitude)."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per_block * block_bytes), dtype=np.uint8)
    if fill is not None:
        raw[:] = fill
    blocks = raw.reshape(-1, block_bytes)
    for offset in _FP16_FIELDS[qtype.name]:
        scales = rng.normal(0, 0.05, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return raw


def write_gguf(path: Path, architecture: str, metadata: dict[str, Any], tensors: dict[str, np.ndarray],
               chat_template: str | None = CHATML, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               dequantized: bool = False, seed: int = 0, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    """A GGUF with the tiny byte-level BPE vocabulary, `architecture`.KEY metadata (None: left out) and tensors.

    Every matrix whose rows hold whole qtype blocks is stored in qtype; dequantized=True stores the same values
    decoded, as F32: the twin a quantized file must load equal to.
    """
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture, endianess=endianess)
    for key, value in metadata.items():
        if value is not None:
            _put(writer, f"{architecture}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([1] * 256 + [3, 3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, data in tensors.items():
        blocks = _encode(data, qtype, rng)
        if blocks is None:
            writer.add_tensor(name, data)
        elif dequantized:
            writer.add_tensor(name, dequantize(blocks, qtype).astype(np.float32))
        else:
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_READERS: dict[tuple[str, str], Any] = {}  # gguf_read_once's, kept for the session: read-only maps of the files


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """transformers reads a GGUF's metadata twice in one from_pretrained (for the config, then for the weights), and
    gguf-py's reader takes ~12-30 s over Gemma 3's 262,144-token vocabulary; inside these blocks each file is read
    once a test session (the model's test and the tokenizer's share Gemma 3's), from a copy in memory rather than
    a memory map: the reader slices its data a million times, and a memmap's slices cost several times a plain
    array's (the same bytes, so the same fields)."""
    original = gguf.GGUFReader

    def reader(path: str, mode: str = "r") -> Any:
        if (str(path), mode) not in _READERS:
            memmap = np.memmap  # what the reader maps its file with: meanwhile, a plain array of the file's bytes
            np.memmap = lambda file, mode="r": np.fromfile(file, dtype=np.uint8)  # type: ignore[misc,assignment]
            try:
                _READERS[str(path), mode] = original(path, mode)
            finally:
                np.memmap = memmap  # type: ignore[misc]
        return _READERS[str(path), mode]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def tiny_metadata(hidden: int = 64, context_length: int = 512, kv_heads: int = 2) -> dict[str, Any]:
    return {"block_count": 2, "context_length": context_length, "embedding_length": hidden,
            "feed_forward_length": 256, "attention.head_count": 4, "attention.head_count_kv": kv_heads,
            "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5}


def tiny_tensors(hidden: int = 64, seed: int = 0, kv_heads: int = 2, layers: int = 2) -> dict[str, np.ndarray]:
    """Random weights of the tiny model under their GGUF names (q and k as llama.cpp stores them)."""
    rng = np.random.default_rng(seed)
    ffn, heads, head_dim = 256, 4, hidden // 4

    def weight(*shape: int, norm: bool = False) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.2 * rng.standard_normal(shape)).astype(
            np.float32)

    tensors = {"token_embd.weight": weight(len(TINY_TOKENS), hidden), "output_norm.weight": weight(hidden, norm=True)}
    for i in range(layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": weight(hidden, norm=True),
            f"blk.{i}.attn_q.weight": weight(heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": weight(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": weight(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": weight(hidden, heads * head_dim),
            f"blk.{i}.ffn_norm.weight": weight(hidden, norm=True),
            f"blk.{i}.ffn_gate.weight": weight(ffn, hidden),
            f"blk.{i}.ffn_up.weight": weight(ffn, hidden),
            f"blk.{i}.ffn_down.weight": weight(hidden, ffn),
        }
    return tensors


def write_tiny_gguf(path: Path, chat_template: str | None = CHATML, architecture: str = "llama",
                    qtype: GGMLQuantizationType = GGMLQuantizationType.F32, seed: int = 0,
                    context_length: int = 512, hidden: int = 64, dequantized: bool = False, kv_heads: int = 2,
                    metadata: dict[str, Any] | None = None) -> Path:
    """A 2-layer random-weight Llama with the tiny vocabulary; hidden=256 lets every type quantize every matrix.
    metadata: changes to the architecture's metadata (None: left out)."""
    meta = {**tiny_metadata(hidden, context_length, kv_heads), **(metadata or {})}
    return write_gguf(path, architecture, meta, tiny_tensors(hidden, seed, kv_heads), chat_template, qtype,
                      dequantized, seed)


SMALL_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def hf_configs() -> dict[str, Any]:
    """Small transformers configs of each supported family, each with its own numerics."""
    import transformers

    return {
        "qwen3": transformers.Qwen3Config(**SMALL_HF, head_dim=32, tie_word_embeddings=False),
        "qwen2": transformers.Qwen2Config(**SMALL_HF, tie_word_embeddings=True),
        "llama3-rope": transformers.LlamaConfig(**SMALL_HF, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    }


def save_random_hf_model(folder: Path, config: Any, norm_noise: float = 0.0) -> None:
    """A random-weight transformers model of config, saved as a Hugging Face folder with a byte-level tokenizer.
    norm_noise: added to every norm weight (some families initialise them all to one value, so that a norm read the
    wrong way could pass unnoticed)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(norm_noise * torch.randn_like(param))
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(_byte_to_unicode())}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def save_two_layer_gemma3(folder: Path, head_dim: int) -> None:
    """A random Gemma 3 of a sliding layer over 8 keys and a global layer (noisy norms), saved as a folder."""
    import transformers

    save_random_hf_model(folder, transformers.Gemma3TextConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, sliding_window=8, query_pre_attn_scalar=head_dim,
        max_position_embeddings=256, initializer_range=0.2, layer_types=["sliding_attention", "full_attention"]),
        norm_noise=0.3)


async def _generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    streams = [submit(engine, p, sp) for p, sp in zip(prompts, params, strict=True)]

    async def collect(stream) -> list[int]:
        ids: list[int] = []
        async for out in stream:
            ids += out.token_ids
        return ids

    return list(await asyncio.gather(*(collect(s) for s in streams)))


def submit(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
    """One sequence through the API's admission, as a route submits it (call from an event loop)."""
    return EngineClient(engine).submit([prompt_ids], params)[0]


def counted(counter: Any) -> float:
    """A Prometheus counter's value, read in-process."""
    return counter.collect()[0].samples[0].value


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
             timeout: float | None = None) -> list[list[int]]:
    """Submit several sequences at once (so they share engine steps) and return their token ids; timeout: seconds
    after which the test fails (a sequence that never runs), if given."""
    return asyncio.run(asyncio.wait_for(_generate(engine, prompts, params), timeout))


def pretend_cpu_flags(flags: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokenmill/cpu.py reads these /proc/cpuinfo flags (None: no such file, as off Linux) until the test ends, at that
    CPU's own level; the kernels stay those built for the CPU that runs them."""
    kernels.load()  # built before the flags are pretended: they key the build
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    monkeypatch.setattr(cpu, "CPUINFO", str(cpuinfo))
    # A cache of its own, gone with the test: the real flags' stays as it was
    monkeypatch.setattr(cpu, "machine_flags", functools.cache(cpu.machine_flags.__wrapped__))
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)


def assert_preempted_to(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams,
                        alone: list[list[int]], **config) -> None:
    """The prompts at once on an engine whose KV memory (config) makes them take turns: each gets the tokens it got
    alone, there were preemptions, and no block is left behind."""
    engine = start_engine(loaded, **config)
    try:
        assert generate(engine, prompts, [params] * len(prompts)) == alone
        assert counted(engine.metrics.preemptions) > 0
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def assert_no_live_blocks(engine: Engine) -> None:
    """No request holds a block, and every block is free or owned by the prefix cache (nothing leaked)."""
    kv = engine.kv_cache
    assert kv.usage() == 0 and kv.num_sequences == 0
    cached = kv.prefix_cache.num_blocks if kv.prefix_cache is not None else 0
    assert kv.pool.num_free + cached == kv.pool.num_blocks
    if kv.sliding is not None:  # the sliding layers' pool: the same, its blocks in the tree counted by walking it
        nodes = kv.prefix_cache.nodes() if kv.prefix_cache is not None else ()
        cached = sum(1 for node in nodes for block in node.sliding if block)
        assert kv.sliding.blocks.num_free + cached == kv.sliding.blocks.num_blocks


def add_and_abort(engine: Engine, prompts: list[list[int]], params: SamplingParams, count: int = 200,
                  spread_s: float = 0.04) -> None:
    """Add count sequences (the prompts in turn) and abort each at once or after up to spread_s; wait until
    every one has finished."""
    done = threading.Semaphore(0)

    def sink(out: SequenceOutput) -> None:
        if out.finish_reason is not None:
            done.release()

    for i in range(count):
        seq_id = engine.add(prompts[i % len(prompts)], params, sink)
        if i % 3:
            threading.Timer(spread_s * (i % 40) / 40, engine.abort, (seq_id,)).start()
        else:
            engine.abort(seq_id)
    for _ in range(count):
        assert done.acquire(timeout=120)


def count_gpu_kernels(monkeypatch: Any) -> list[str]:
    """Every op that takes a GPU kernel on CUDA takes it here (Triton's interpreter on the CPU's tensors); gives the
    names of the kernels launched, in order."""
    from tokenmill.kernels import gpu

    if torch.cuda.is_available():  # the kernels' start-up probes (gpu.ready, pdl_ready) run now, uncounted
        gpu.ready(torch.device("cuda", torch.cuda.current_device()))
    launched: list[str] = []
    kernels = gpu._kernels()

    class Counting:
        def __getattr__(self, name: str) -> object:
            launched.append(name)
            return getattr(kernels, name)

    monkeypatch.setattr(gpu, "_kernels", Counting)
    monkeypatch.setattr(gpu, "runs", lambda x: True)
    monkeypatch.setattr(gpu, "serves", lambda device: True)
    return launched


def without_pdl_waits(monkeypatch: Any) -> None:
    """The kernels' waits of programmatic dependent launch (triton_kernels.wait_for_inputs) as no-ops: Triton's
    interpreter, which runs a kernel's code as Python, has no griddepcontrol, and ends each launch before the next."""
    from tokenmill.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "wait_for_inputs", lambda PDL: None)


# The engines the tests start leave the collector as it is unless a test asks (--freeze-gc's own tests, and those
# that build their EngineConfig): the full collection before each freeze, ~120 ms in a test process, ran at
# hundreds of starts and took about half a minute of the test command.
UNFROZEN = {"freeze_gc": False}


def like(loaded: LoadedModel | None) -> dict[str, object]:
    """The engine settings the tests start with on `loaded`: UNFROZEN, and deterministic mode where the model was
    loaded for it (None: the engine loads its model, as with tensor parallelism)."""
    return {**UNFROZEN, **({"deterministic": True} if loaded is not None and loaded.deterministic else {})}


def start_engine(loaded: LoadedModel, **config) -> Engine:
    engine = Engine(EngineConfig(**{**like(loaded), **config}), loaded)
    engine.start()
    return engine


class ServerThread:
    """The server tokenmill serve runs, on a free loopback port, in a thread of this process."""

    def __init__(self, loaded: LoadedModel | ModelPool, model_id: str = "", server_config: ServerConfig | None = None,
                 **engine_config) -> None:
        """loaded: one model served as model_id, or the models of a pool (preloaded as `serve` does)."""
        # Listening from here on, on a port the kernel picked: no other test (or worker) can take it meanwhile
        self.sockets = listen("127.0.0.1", 0)
        self.port = self.sockets[0].getsockname()[1]
        if isinstance(loaded, ModelPool):
            self.pool = loaded
            self.pool.preload()
        else:
            self.engine = Engine(EngineConfig(**{**like(loaded), **engine_config}), loaded)
            self.pool = ModelPool.of_engine(self.engine, model_id)
        config = server_config or ServerConfig()
        # Not the user's cache: a store of this server's own, in a folder removed with this object (or at exit)
        self.store_dir = tempfile.TemporaryDirectory(prefix="tokenmill-test-")
        if config.responses_store is None:
            config = replace(config, responses_store=str(Path(self.store_dir.name) / "responses.sqlite3"))
        self.server = build_server(self.pool, replace(config, host="127.0.0.1", port=self.port,
                                                      log_level="warning"))
        self.state = self.server.state
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.sockets}, daemon=True)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.store_dir.cleanup()


def openai_client(server: ServerThread, timeout: float = 120) -> openai.OpenAI:
    """The real openai SDK, pointed at a test server, with no retries (a failure shows at once)."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=timeout)


def read_metrics(root_url: str) -> dict[str, float]:
    """The server's tokenmill:* samples from /metrics (the model_name label aside: summed over the models), by name
    and their other labels as Prometheus writes them (`name{position="0"}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(root_url + "/metrics").text):
        for sample in family.samples:
            if not sample.name.startswith("tokenmill:"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k != "model_name")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            found[key] = found.get(key, 0.0) + sample.value
    return found


class ServerProcess:
    """`tokenmill serve` in a child process, as users run it; for signals, exit codes and memory."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.port = 0  # the kernel picks it, the server says it (a port picked here could be taken meanwhile)
        self.log = tempfile.TemporaryFile()  # a pipe nobody reads could fill up and block the server
        self.store_dir = tempfile.TemporaryDirectory(prefix="tokenmill-test-")  # as ServerThread's
        store = Path(self.store_dir.name) / "responses.sqlite3"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill", "serve", str(model), "--served-model-name", "tiny", "--port", "0",
             "--threads", "1", "--log-level", "info", "--responses-store", str(store), *flags],
            stdout=subprocess.DEVNULL, stderr=self.log, text=True,
        )

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.root_url)

    def __enter__(self) -> ServerProcess:
        deadline = time.time() + 120
        while time.time() < deadline and self.proc.poll() is None:
            if not self.port:
                said = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1", self.output())
                self.port = int(said.group(1)) if said else 0
            try:
                if self.port and httpx.get(self.root_url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        output = self.output()
        self.__exit__()
        raise RuntimeError(f"the server did not start: {output}")

    def output(self) -> str:
        """The server's log so far; read without moving the offset it shares with the server, which still writes."""
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        self.store_dir.cleanup()

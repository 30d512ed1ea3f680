"""Load a model, its tokenizer and its chat template from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import cpu, kernels
from tokenmill.config import WeightPlan
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.kernels import gpu
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.loader import gguf as gguf_loader
from tokenmill.loader import safetensors as st_loader
from tokenmill.loader.chat_template import ChatTemplate, template_from_metadata
from tokenmill.loader.sources import resolve
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.models.config import ModelConfig
from tokenmill.models.registry import CausalLM, build_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    deterministic: bool = False  # built batch-invariant (models/registry.py)


def _return_freed_memory() -> None:
    """glibc keeps the pages of the loader's freed temporaries (conversions, interleaving) in its heap, resident:
    ~90 MiB on a 1B model. malloc_trim hands them back; elsewhere (musl, macOS) nothing is done."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def resolve_device(name: str) -> torch.device:
    """The device named, a GPU with its index (cuda: the current one), as its tensors name it: what is cached per
    device (gpu.ready, gpu.pdl_ready) is then asked once, for the device the kernels run on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: tokenmill runs on cpu and cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"--device {name}: no CUDA GPU is available (torch {torch.__version__}, {build})")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware computes it natively (CUDA; CPUs with AMX or AVX512-BF16), else fp32; on a CPU,
    TOKENMILL_DTYPE's where it is set (tokenmill/cpu.py).

    Without those instructions bf16 matmuls are emulated and slower than fp32 at batch sizes that matter (measured
    3.4x slower at 32 rows on an AVX2 CPU); with AVX512-BF16 they are 2.9x faster (see README).
    """
    if name == "auto" and device.type == "cpu":
        name = cpu.auto_dtype() or name
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu.computes_bf16():
        return torch.bfloat16
    return torch.float32


def weight_bytes(model: CausalLM | torch.nn.Module) -> tuple[int, int]:
    """What the weights (and tables) of a model or a module hold in memory, in the kernels' layouts (quantized, or
    bf16 values) and dense, each tensor counted once."""
    seen: set[int] = set()
    quantized = dense = 0
    for module in model.modules():  # type: ignore[union-attr]
        for value in (*vars(module).values(), *module._parameters.values(), *module._buffers.values()):
            if id(value) in seen or not isinstance(value, (torch.Tensor, QuantizedWeight, gpu.QuantizedRows)):
                continue
            seen.add(id(value))
            if isinstance(value, (QuantizedWeight, gpu.QuantizedRows)):
                quantized += value.nbytes
            else:
                dense += value.numel() * value.element_size()
    return quantized, dense


def _keeps_quantized(device: torch.device, config: ModelConfig) -> bool:
    """Whether device's kernels run a GGUF's quantized matrices: the CPU's C++ ones with their vector loops, or the
    GPU's Triton ones (not a mixture of experts', whose experts run on the host: layers/moe.py)."""
    if device.type == "cuda":
        if config.num_experts:
            log.info("a mixture of experts on CUDA: GGUF weights dequantized at load")
        return not config.num_experts and gpu.serves(device)
    if device.type != "cpu" or not kernels.load():
        return False
    if not kernels.has_vector_kernels():
        log.info("this CPU lacks AVX2/FMA: GGUF weights dequantized at load (the quantized kernels' plain loops are "
                 "slower than dense matmuls)")
        return False
    return True


def _check_context(path: Path, config: ModelConfig, max_model_len: int | None, allowed: bool) -> None:
    """Past the positions a model was trained on, its output degrades into noise: refused, as vLLM does, unless
    allowed (then said in the log)."""
    if max_model_len is None or max_model_len <= config.max_position_embeddings:
        return
    if not allowed:
        raise ConfigError(f"--max-model-len {max_model_len}: the model was trained for a context of "
                          f"{config.max_position_embeddings} tokens (--allow-long-max-model-len serves it anyway)")
    log.warning("%s served a context of %d tokens, past the %d it was trained for: its output degrades there",
                path.name, max_model_len, config.max_position_embeddings)


DEFAULT_PLAN = WeightPlan()


def load_model(model: str, plan: WeightPlan = DEFAULT_PLAN, max_model_len: int | None = None,
               max_model_len_cap: int = 8192, past_trained_context: bool = False) -> LoadedModel:
    """The model, its tokenizer and chat template, its weights held and run as `plan` says; its context
    max_model_len (None: the model's, at most max_model_len_cap), past the context it was trained for only where
    past_trained_context allows."""
    path = resolve(model)
    dev = resolve_device(plan.device)
    torch_dtype = resolve_dtype(plan.dtype, dev)
    if dev.type == "cpu":
        log.info("%s", cpu.describe())
    started = time.perf_counter()
    if path.is_file():
        gguf = gguf_loader.GGUFFile(path)
        config = gguf_loader.model_config(gguf)
        _check_context(path, config, max_model_len, past_trained_context)
        gguf_loader.check_tensor_types(gguf)
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
        template_source = gguf.metadata.get("tokenizer.chat_template")
        keep = plan.quantized and _keeps_quantized(dev, config)
        weights = gguf_loader.load_weights(gguf, config, torch_dtype, keep_quantized=keep)
        del gguf  # the reader's parsed fields: ~150 MiB of small objects (the tensors map the file by themselves)
    elif (path / "config.json").exists():
        config = st_loader.model_config(path)
        _check_context(path, config, max_model_len, past_trained_context)
        tokenizer = Tokenizer.from_folder(path)
        template_source = None
        if (path / "chat_template.jinja").exists():
            template_source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "tokenizer_config.json").exists():
            template_source = st_loader.read_json(path / "tokenizer_config.json").get("chat_template")
        weights = st_loader.load_weights(path, config, torch_dtype)
    else:
        raise ModelFormatError(f"{path} is neither a GGUF file nor a folder with config.json")
    chat_template = ChatTemplate(template_from_metadata(template_source), tokenizer.bos_token, tokenizer.eos_token)
    served_len = max_model_len or min(config.max_position_embeddings, max_model_len_cap)
    net = build_model(config, weights, plan, torch_dtype, dev, served_len)
    del weights
    _return_freed_memory()
    quantized_bytes, dense_bytes = weight_bytes(net)
    log.info("loaded %s (%s, %d layers) as %s on %s in %.1fs; context %d; weights %.0f MiB in the "
             "kernels' layouts + %.0f MiB dense", path.name, config.architecture, config.num_layers, torch_dtype, dev,
             time.perf_counter() - started, served_len, quantized_bytes / 2**20, dense_bytes / 2**20)
    return LoadedModel(path=path, config=config, model=net, tokenizer=tokenizer,
                       chat_template=chat_template, dtype=torch_dtype, device=dev, max_model_len=served_len,
                       deterministic=plan.deterministic)

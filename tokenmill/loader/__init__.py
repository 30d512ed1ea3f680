"""Load a model, its tokenizer and its chat template from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import backend, cpu
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
from tokenmill.parallel.sharding import Shard, check_shardable, shard_config, shard_weights

log = logging.getLogger(__name__)


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


def release_freed_memory() -> None:
    """glibc keeps the pages of the loader's freed temporaries (conversions, interleaving) in its heap, resident:
    ~90 MiB on a 1B model. malloc_trim hands them back; elsewhere (musl, macOS) nothing is done."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def weight_bytes(model: CausalLM | torch.nn.Module) -> tuple[int, int]:
    """What the weights (and tables) of a model or a module hold in memory, in the kernels' layouts (quantized, or
    bf16 values) and dense, each tensor counted once."""
    seen: set[int] = set()
    quantized = dense = 0
    for module in model.modules():  # type: ignore[union-attr]
        held = (*vars(module).values(), *module._parameters.values(), *module._buffers.values())
        for value in (item for v in held for item in (v if isinstance(v, list) else (v,))):
            if id(value) in seen or not isinstance(value, (torch.Tensor, QuantizedWeight, gpu.QuantizedRows)):
                continue
            seen.add(id(value))
            if isinstance(value, (QuantizedWeight, gpu.QuantizedRows)):
                quantized += value.nbytes
            else:
                dense += value.numel() * value.element_size()
    return quantized, dense


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


def read_config(model: str) -> ModelConfig:
    """The model's architecture alone, its weights unread: what a check before loading needs."""
    path = resolve(model)
    if path.is_file():
        return gguf_loader.model_config(gguf_loader.GGUFFile(path))
    if (path / "config.json").exists():
        return st_loader.model_config(path)
    raise ModelFormatError(f"{path} is neither a GGUF file nor a folder with config.json")


def load_model(model: str, plan: WeightPlan = DEFAULT_PLAN, max_model_len: int | None = None,
               max_model_len_cap: int = 8192, past_trained_context: bool = False,
               shard: Shard | None = None) -> LoadedModel:
    """The model, its tokenizer and chat template, its weights held and run as `plan` says; its context
    max_model_len (None: the model's, at most max_model_len_cap), past the context it was trained for only where
    past_trained_context allows; shard: a tensor-parallel rank's share of it (parallel/sharding.py), whose config
    the LoadedModel then holds."""
    path = resolve(model)
    dev = backend.resolve_device(plan.device)
    torch_dtype = backend.resolve_dtype(plan.dtype, dev)
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
        keep = plan.quantized and backend.keeps_quantized(dev, bool(config.num_experts))
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
        # a quantized checkpoint's 4- and 8-bit matrices kept as a GGUF's are, on CPU (not a mixture of experts':
        # its expert stacks are dense; the GPU's kernels are not checked on these layouts yet)
        keep = plan.quantized and dev.type == "cpu" and not config.num_experts and backend.keeps_quantized(dev, False)
        weights = st_loader.load_weights(path, config, torch_dtype, keep_quantized=keep)
    else:
        raise ModelFormatError(f"{path} is neither a GGUF file nor a folder with config.json")
    chat_template = ChatTemplate(template_from_metadata(template_source), tokenizer.bos_token, tokenizer.eos_token)
    served_len = max_model_len or min(config.max_position_embeddings, max_model_len_cap)
    if shard is not None:
        check_shardable(config, shard.size)
        weights, config = shard_weights(weights, config, shard), shard_config(config, shard)
    net = build_model(config, weights, plan, torch_dtype, dev, served_len)
    del weights
    release_freed_memory()
    quantized_bytes, dense_bytes = weight_bytes(net)
    log.info("loaded %s (%s, %d layers) as %s on %s in %.1fs; context %d; weights %.0f MiB in the "
             "kernels' layouts + %.0f MiB dense", path.name, config.architecture, config.num_layers, torch_dtype, dev,
             time.perf_counter() - started, served_len, quantized_bytes / 2**20, dense_bytes / 2**20)
    return LoadedModel(path=path, config=config, model=net, tokenizer=tokenizer,
                       chat_template=chat_template, dtype=torch_dtype, device=dev, max_model_len=served_len,
                       deterministic=plan.deterministic)

"""LoRA adapters as PEFT saves them (a folder of adapter_config.json and adapter_model.safetensors) or as llama.cpp
converts them (a GGUF file), read into each projection's low-rank factors with their scale, checked against the
base model's shapes."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.errors import ModelFormatError
from tokenmill.loader import gguf as gguf_loader
from tokenmill.models.config import ModelConfig

# The projections an adapter may target, by PEFT's module names, and where each sits in the decoder layer.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}


@dataclass
class LoRAAdapter:
    """name: the model name requests use; factors: (layer, projection) -> (A [rank, in], B [out, rank] times the
    scale), in fp32; rank: the largest of them."""

    name: str
    path: Path
    rank: int
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> set[str]:
        return {module for _, module in self.factors}


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each targetable projection's (in, out) features in the model of config."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read a LoRA adapter for the model of config: a PEFT folder, or a GGUF file as llama.cpp's
    convert_lora_to_gguf.py writes one; refuse (ModelFormatError, saying why) one whose rank passes max_rank, whose
    targets the server cannot run, or whose shapes do not fit the model."""
    if config.num_experts:
        raise ModelFormatError(f"LoRA adapter {name}: adapters on a mixture-of-experts model are not supported")
    source = Path(path).expanduser()
    if source.is_file() and source.suffix == ".gguf":
        alpha, halves = gguf_loader.lora_halves(source, config)
        # llama.cpp's scale: alpha over the rank, or 1 where the file gives no alpha
        return _adapter(name, source, config, max_rank, halves, lambda module, rank: alpha / rank if alpha else 1.0)
    settings, halves = _peft_halves(name, source)
    return _adapter(name, source, config, max_rank, halves, lambda module, rank: _scale(settings, module, rank))


def _peft_halves(name: str, folder: Path) -> tuple[dict, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """A PEFT folder's settings and its factors by (layer, module): "A" and "B", in fp32."""
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ModelFormatError(f"LoRA adapter {name}: {folder} has no adapter_config.json and "
                               "adapter_model.safetensors (a PEFT folder), nor is it a GGUF adapter")
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"LoRA adapter {name}: {config_file}: {exc}") from exc
    _check_settings(name, settings)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open is no mapping
            found = _KEY.match(key)
            if found is None or found.group(3) not in TARGETS:
                raise ModelFormatError(f"LoRA adapter {name}: {key} is no LoRA factor of a projection this server "
                                       f"can adapt ({', '.join(TARGETS)})")
            halves.setdefault((int(found.group(1)), found.group(3)), {})[found.group(4)] = \
                tensors.get_tensor(key).float()
    if not halves:
        raise ModelFormatError(f"LoRA adapter {name}: {weights_file} holds no LoRA factors")
    return settings, halves


def _adapter(name: str, path: Path, config: ModelConfig, max_rank: int,
             halves: dict[tuple[int, str], dict[str, torch.Tensor]],
             scale: Callable[[str, int], float]) -> LoRAAdapter:
    """The adapter of these factors, each checked against the model's projection; scale(module path, rank): its
    factor's scale."""
    shapes = projection_shapes(config)
    factors = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"LoRA adapter {name}: layer {layer} {module}"
        if module not in TARGETS:
            raise ModelFormatError(f"{where}: not a projection this server can adapt ({', '.join(TARGETS)})")
        if not 0 <= layer < config.num_layers:
            raise ModelFormatError(f"{where}: the model has {config.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise ModelFormatError(f"{where}: lora_{'A' if 'A' not in pair else 'B'} is missing")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise ModelFormatError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                   f"model's projection of {fan_in} -> {fan_out} features (A is [rank, {fan_in}], "
                                   f"B [{fan_out}, rank])")
        if rank > max_rank:
            raise ModelFormatError(f"{where}: rank {rank} is more than --max-lora-rank {max_rank}")
        factors[(layer, module)] = (a, b * scale(f"model.layers.{layer}.{TARGETS[module]}.{module}", rank))
    if not factors:
        raise ModelFormatError(f"LoRA adapter {name}: {path} holds no LoRA factors")
    return LoRAAdapter(name, path, max(a.shape[0] for a, _ in factors.values()), factors)


def _check_settings(name: str, settings: dict) -> None:
    if str(settings.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelFormatError(f"LoRA adapter {name}: peft_type {settings.get('peft_type')} is not LORA")
    for key, what in _REFUSED.items():
        if settings.get(key):
            raise ModelFormatError(f"LoRA adapter {name}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise ModelFormatError(f"LoRA adapter {name}: bias {settings['bias']!r} (trained biases) is not supported")
    if settings.get("modules_to_save"):
        raise ModelFormatError(f"LoRA adapter {name}: modules_to_save {settings['modules_to_save']} (whole modules "
                               "trained beside the adapter) are not supported")


def _scale(settings: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: lora_alpha (or its alpha_pattern's) over its rank, or over the rank's square
    root with use_rslora."""
    alpha = float(settings.get("lora_alpha", 8))
    for pattern, value in (settings.get("alpha_pattern") or {}).items():
        if module == pattern or re.match(rf".*\.{pattern}$", module):
            alpha = float(value)
            break
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)

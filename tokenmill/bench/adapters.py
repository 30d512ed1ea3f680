"""Random LoRA adapters for a model, written as PEFT writes them (adapter_config.json, adapter_model.safetensors),
for benchmarks (docs/features/lora.md) and tests: every projection of every layer adapted unless told otherwise,
factors of a small random scale.

    python -m tokenmill.bench.adapters MODEL OUT_FOLDER --count 4 --rank 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.loader.lora import TARGETS, projection_shapes
from tokenmill.models.config import ModelConfig


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int, targets: tuple[str, ...] = tuple(TARGETS),
                  scale: float = 0.02, alpha: float | None = None) -> Path:
    """One adapter of `rank` on `targets` in every layer; B is random too (PEFT starts it at zero, which would make
    the adapter a no-op)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets), "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from tokenmill.config import WeightPlan
    from tokenmill.loader import load_model

    config = load_model(args.model, WeightPlan(dtype="float32", device="cpu")).config
    for i in range(args.count):
        print(write_adapter(Path(args.out) / f"lora{i}", config, args.rank, seed=i))


if __name__ == "__main__":
    main()

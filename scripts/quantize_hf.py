"""Write a quantized copy of a dense Hugging Face folder in compressed-tensors' format, by round-to-nearest (no
calibration: for measuring memory and speed, not for quality; llm-compressor makes real ones), to serve and bench
against the dense folder.

    python scripts/quantize_hf.py DENSE_FOLDER OUT_FOLDER --scheme w4a16|w8a8 [--group-size 128]

w4a16: pack-quantized int4, symmetric, one scale per group of the input; w8a8: int-quantized int8 weights, one scale
per output channel (activations quantized per token at run time, as vLLM reads it). Every projection of every layer
is quantized; the embeddings, norms and head stay dense. Needs `compressed-tensors` (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dense", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", choices=["w4a16", "w8a8"], required=True)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    if args.scheme == "w4a16":
        fmt, weights = "pack-quantized", QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                          group_size=args.group_size)
        activations = None
    else:
        fmt, weights = "int-quantized", QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    compressor = BaseCompressor.load_from_registry(fmt)
    args.out.mkdir(parents=True, exist_ok=True)
    for file in sorted(args.dense.glob("*.safetensors")):
        state, out = load_file(str(file)), {}
        for name, tensor in state.items():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS):
                out[name] = tensor
                continue
            weight = tensor.float()
            levels = 7 if args.scheme == "w4a16" else 127
            if args.scheme == "w4a16":
                grouped = weight.reshape(weight.shape[0], -1, args.group_size)
                scale = (grouped.abs().amax(-1) / levels).clamp(min=1e-8).to(tensor.dtype)
            else:
                scale = (weight.abs().amax(1, keepdim=True) / levels).clamp(min=1e-8).to(tensor.dtype)
            parts = compressor.compress({"weight": weight, "weight_scale": scale.float()}, scheme)
            parts["weight_scale"] = parts["weight_scale"].to(tensor.dtype)
            out.update({f"{module}.{part}": value.contiguous() for part, value in parts.items()})
        save_file(out, str(args.out / file.name))
    config = json.loads((args.dense / "config.json").read_text())
    group = {"targets": ["Linear"], "weights": weights.model_dump(),
             "input_activations": None if activations is None else activations.model_dump()}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                     "quantization_status": "compressed", "config_groups": {"group_0": group}}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in args.dense.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            shutil.copy(extra, args.out / extra.name)
    print(f"wrote {args.out} ({args.scheme})")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

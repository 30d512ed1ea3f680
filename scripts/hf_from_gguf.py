"""Write a GGUF's model as a bf16 Hugging Face folder (config.json, model.safetensors, tokenizer.json and the
chat template), through transformers' GGUF reader: a dense target whose own GGUF can serve as its draft model
(speculative decoding's benchmark in README.md).

    python scripts/hf_from_gguf.py OUT_FOLDER [GGUF]    # default GGUF: SmolLM2's, `tokenmill pull smollm2-135m`
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from tokenmill.loader.sources import pull


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("gguf", type=Path, nargs="?")
    args = parser.parse_args()
    gguf = args.gguf or pull("smollm2-135m")
    read = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = read.config
    del config.quantization_config  # the weights are dequantized now: a plain model, which transformers can save
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(args.out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(args.out)


if __name__ == "__main__":
    main()

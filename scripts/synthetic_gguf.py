"""Write a Llama-shaped GGUF of random weights, to measure how serving cost grows with model size.

    python scripts/synthetic_gguf.py OUT.gguf [--hidden 2048 --layers 22 --ffn 5632 --heads 32 --kv-heads 4]
    llama-quantize OUT.gguf OUT-Q4_0.gguf Q4_0  # or Q4_K_M: llama.cpp's own quantizer (docs/performance/bench.md)
    python scripts/synthetic_gguf.py OUT.gguf --type Q4_1   # without llama.cpp: gguf-py quantizes (Q4_0, Q4_1,
                                                            # Q5_0, Q5_1, Q8_0; the embeddings, the tied head, Q8_0)

The defaults give TinyLlama-1.1B's shape (1.1B weights with SmolLM2's 49,152-token vocabulary). Weights are
F16, drawn from a normal distribution scaled 1/sqrt(fan-in) so activations stay finite through the layers; the
tokenizer and chat template are copied from a reference GGUF (default: SmolLM2's, `tokenmill pull smollm2-135m`),
so the model serves and chats (gibberish). Not committed anywhere: made on demand (2.2 GB at the default shape).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from tokenmill.loader.sources import pull


def copy_tokenizer(reference: Path, writer: GGUFWriter) -> int:
    """Every tokenizer.* field of reference into writer; returns the vocabulary size."""
    vocab = 0
    for name, field in GGUFReader(reference).fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(name, value)
            vocab = max(vocab, len(value)) if name == "tokenizer.ggml.tokens" else vocab
        elif field.types[0] == GGUFValueType.STRING:
            writer.add_string(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    return vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--reference", type=Path, default=None, help="GGUF whose tokenizer is copied")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--type", default="F16", choices=["F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"],
                        help="the matrices' type (as SmolLM2's Q4_1 file: the embeddings Q8_0 when quantized)")
    args = parser.parse_args()
    reference = args.reference or pull("smollm2-135m", quiet=True)
    rng = np.random.default_rng(args.seed)
    writer = GGUFWriter(str(args.out), "llama")
    vocab = copy_tokenizer(reference, writer)
    head_dim = args.hidden // args.heads
    for key, value in {"block_count": args.layers, "context_length": 4096, "embedding_length": args.hidden,
                       "feed_forward_length": args.ffn, "attention.head_count": args.heads,
                       "attention.head_count_kv": args.kv_heads, "rope.dimension_count": head_dim}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)

    def add(name: str, rows: int, cols: int, qtype: str = args.type) -> None:  # GGUF's [out, in], as numpy's
        values = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        if qtype == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, GGMLQuantizationType[qtype]),
                              raw_dtype=GGMLQuantizationType[qtype])

    kv = args.kv_heads * head_dim
    add("token_embd.weight", vocab, args.hidden, "F16" if args.type == "F16" else "Q8_0")
    writer.add_tensor("output_norm.weight", np.ones(args.hidden, np.float32))
    for i in range(args.layers):
        for name, shape in {"attn_q": (args.hidden, args.hidden), "attn_k": (kv, args.hidden),
                            "attn_v": (kv, args.hidden), "attn_output": (args.hidden, args.hidden),
                            "ffn_gate": (args.ffn, args.hidden), "ffn_up": (args.ffn, args.hidden),
                            "ffn_down": (args.hidden, args.ffn)}.items():
            add(f"blk.{i}.{name}.weight", *shape)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(args.hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(args.hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()

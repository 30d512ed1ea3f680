"""What a quantized KV cache (--kv-cache-dtype) gives and costs on a real model, against the bf16 cache.

    python -m tokenmill.bench.kv_cache [MODEL] [--prompts 8] [--tokens 256] [--kv-cache-dtype int8 fp8_e4m3]

The model runs in fp32 (its GGUF weights kept quantized, as the tests serve it), so that the cache's numbers are
the only difference between the runs. Each prompt is continued --tokens tokens greedily by the model on a bf16
cache; then each prompt with its continuation is prefilled whole over a cache of each dtype (every row's attention
reads the keys and values as that cache holds them, its own included: what decoding those tokens one by one reads),
and each position's next-token distribution is compared with the bf16 cache's: the KL divergence (mean, 99th
percentile, largest, in nats) and the share of positions whose top token is the same. Also: the bytes a token's KV
takes and the tokens 1 GiB of KV memory holds, against the bf16 cache's. Decode speed per KV dtype:
`python -m tokenmill.bench.decode MODEL --kv-cache-dtype auto int8 fp8_e4m3`.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import torch

from tokenmill import cpu
from tokenmill.api.engine_client import EngineClient
from tokenmill.bench.agree import PROMPTS
from tokenmill.bench.noise import prefill_logits
from tokenmill.cache.kv_cache import KVSpec
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.layers.kv_quant import KV_CACHE_DTYPES
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams


@dataclass
class Against:
    """A KV dtype against the bf16 cache on the same tokens: each position's KL divergence, and whether its top token
    is the same."""

    kl: torch.Tensor
    same_top: torch.Tensor


def continuations(loaded: LoadedModel, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's next `tokens` tokens, greedy, on a bf16 cache (all prompts at once)."""
    engine = Engine(EngineConfig(kv_cache_dtype="bf16", max_num_seqs=len(prompts)), loaded)
    engine.start()

    async def run() -> list[list[int]]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        streams = EngineClient(engine).submit(prompts, params)

        async def collect(stream) -> list[int]:
            return [token async for out in stream for token in out.token_ids]

        return list(await asyncio.gather(*(collect(s) for s in streams)))

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def against_bf16(loaded: LoadedModel, prompts: list[list[int]], outputs: list[list[int]],
                 kv_dtype: torch.dtype) -> Against:
    """Every generated position of every prompt: the distribution over a kv_dtype cache against a bf16 cache's."""
    kls, tops = [], []
    for ids, out in zip(prompts, outputs, strict=True):
        seq = ids + out
        positions = slice(len(ids) - 1, len(seq) - 1)  # the positions whose next token was generated
        ref = prefill_logits(loaded, seq, torch.bfloat16)[positions].float().log_softmax(-1)
        ours = prefill_logits(loaded, seq, kv_dtype)[positions].float().log_softmax(-1)
        kls.append((ref.exp() * (ref - ours)).sum(-1))
        tops.append(ref.argmax(-1) == ours.argmax(-1))
    return Against(torch.cat(kls), torch.cat(tops))


def tokens_in(memory: int, loaded: LoadedModel, kv_dtype: torch.dtype) -> int:
    c = loaded.config
    return memory // KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype).bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="a GGUF, a Hugging Face folder or an alias")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["int8", "fp8_e4m3"],
                        choices=[name for name, dtype in KV_CACHE_DTYPES.items() if dtype is not None])
    args = parser.parse_args()
    print(cpu.describe())
    loaded = load_model(args.model, WeightPlan(dtype="float32", device="cpu"))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    outputs = continuations(loaded, prompts, args.tokens)
    bf16_tokens = tokens_in(2**30, loaded, torch.bfloat16)
    print(f"{args.model}, fp32 compute, {len(prompts)} prompts x {args.tokens} tokens, against the bf16 cache")
    print(f"{'kv dtype':<10} {'bytes/token':>11} {'tokens/GiB':>10} {'x bf16':>6} {'KL mean':>9} {'KL p99':>9} "
          f"{'KL max':>9} {'same top':>8}")
    print(f"{'bf16':<10} {2**30 // bf16_tokens:>11,} {bf16_tokens:>10,} {1:>6.2f}")
    for name in args.kv_cache_dtype:
        dtype = KV_CACHE_DTYPES[name]
        assert dtype is not None
        result = against_bf16(loaded, prompts, outputs, dtype)
        kl = result.kl.sort().values
        fits = tokens_in(2**30, loaded, dtype)
        print(f"{name:<10} {2**30 // fits:>11,} {fits:>10,} {fits / bf16_tokens:>6.2f} {kl.mean():>9.2e} "
              f"{kl[int(0.99 * (len(kl) - 1))]:>9.2e} {kl[-1]:>9.2e} {result.same_top.float().mean():>8.1%}")


if __name__ == "__main__":
    main()

"""Numeric noise per path, the measurements the tests' tolerances come from (tests/tolerances.py).

    python -m tokenmill.bench.noise [MODEL] [--prompts 8] [--paths fp32-dense bf16-quantized ...]

Run it at every instruction-set level a machine runs (TOKENMILL_CPU_ISA, tokenmill/cpu.py): each level's kernels
round in their own order. Two measures, per path (fp32 or bf16, weights dense or kept quantized, AMX tiles where
there are any):

**Prompt logprobs whatever the chunking.** Each token of a prompt gets a logprob twice: from the prompt's echo
(prompt_logprobs: the whole prompt prefilled at once) and from a completion of the prompt cut just before it, which
reports it as its one output token (forced with logit_bias; logprobs are taken before the bias), as lm-eval's
loglikelihood and the echo test compare them. Were every row's arithmetic its own, the two would be equal. They are
not quite: the length of a prefill changes the last bits of its attention (SDPA's reductions run over the chunk's
keys, masked ones included); the quantized kernels round each activation row to 8 bits (as llama.cpp does), where
such a last-bit difference flips a rounding now and then and moves the logits by far more; bf16 rounds every layer's
output; and a one-token prompt (cut 1) alone in its step runs the decode path, the fused layer on fp32 rows, where a
bf16 model's longer prompts run bf16 layers. Every prompt's echo and cuts go at once, sharing steps as a server's
requests do; cut 1 is also measured alone (the decode path). Printed: the median, 99th percentile and largest gap
in nats.

**Against fp32.** The KL divergence of each position's next-token distribution from the dense fp32 model's, over
one prompt of 27 tokens, mean and largest; and the share of 48 greedy tokens, through the decode path, that are the
fp32 model's top choice after the same tokens (tests/model/test_fidelity.py asserts both).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import dataclass

import torch

from tokenmill import backend, cpu
from tokenmill.api.engine_client import EngineClient, RequestStream
from tokenmill.bench.agree import PROMPTS
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import TokenLogprob
from tokenmill.layers.attention import SequenceSlice
from tokenmill.loader import LoadedModel, load_model
from tokenmill.sampling import SamplingParams

# name: (dtype, weights kept quantized, steps on AMX tiles from this many rows: 0 never, None the default)
PATHS = {"fp32-dense": ("float32", False, 0), "fp32-quantized": ("float32", True, 0),
         "bf16-dense": ("bfloat16", False, 0), "bf16-quantized": ("bfloat16", True, 0),
         "bf16-tiles": ("bfloat16", True, None)}
KL_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based inks and a wooden press.")


@dataclass
class Gaps:
    """|echoed - decoded| logprob of prompt tokens: cut 1 (one-token prompts) apart from the rest."""

    longer: list[float]
    one_token: list[float]


async def _collect(stream: RequestStream) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
    """A sequence's prompt logprob entries and its output tokens' ones."""
    prompt: list[TokenLogprob] = []
    output: list[TokenLogprob] = []
    async for out in stream:
        prompt += out.prompt_logprobs or []
        output += out.logprobs
    return prompt, output


def _forced(token: int) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, logit_bias={token: 100.0})


async def _gaps(engine: Engine, prompts: list[list[int]], alone: bool) -> Gaps:
    client = EngineClient(engine)
    echoes = client.submit(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    echoed = await asyncio.gather(*(_collect(s) for s in echoes))
    cuts = [(p, cut) for p, ids in enumerate(prompts) for cut in range(1, 2 if alone else len(ids))]
    if alone:  # one at a time: a one-token prompt alone in its step is a decode
        decoded = [await _collect(client.submit([prompts[p][:cut]], _forced(prompts[p][cut]))[0]) for p, cut in cuts]
    else:
        decoded = await asyncio.gather(*(_collect(client.submit([prompts[p][:cut]], _forced(prompts[p][cut]))[0])
                                         for p, cut in cuts))
    gaps = Gaps([], [])
    for (p, cut), (_, output) in zip(cuts, decoded, strict=True):
        entry, prompt_entry = output[0], echoed[p][0][cut - 1]
        assert entry.token_id == prompt_entry.token_id == prompts[p][cut], "the forced token is the prompt's"
        (gaps.one_token if cut == 1 else gaps.longer).append(abs(entry.logprob - prompt_entry.logprob))
    return gaps


def gaps(engine: Engine, prompts: list[list[int]]) -> Gaps:
    """Every prompt's echo and every cut of it sent at once (they share steps); then each prompt's first token alone,
    as a one-token prompt (the decode path), into one_token."""
    together = asyncio.run(_gaps(engine, prompts, alone=False))
    alone = asyncio.run(_gaps(engine, prompts, alone=True))
    return Gaps(together.longer, together.one_token + alone.one_token)


def prefill_logits(loaded: LoadedModel, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits at every position of one prompt, prefilled whole on the model's device, returned on the CPU; kv_dtype:
    the KV pool's (the model's dtype where None), which every row's attention reads, its own key included."""
    c = loaded.config
    spec = KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or loaded.dtype)
    cache = PagedKVCache(spec, loaded.device, num_blocks=len(ids) // 16 + 1, block_size=16)
    assert cache.reserve(0, len(ids), len(ids))
    with torch.inference_mode():
        meta = metadata.prepare(cache, [SequenceSlice(0, 0, len(ids))])
        dev = loaded.device
        hidden = loaded.model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), meta)
        return loaded.model.compute_logits(hidden).cpu()


@dataclass
class AgainstFp32:
    """A path against the dense fp32 model on KL_PROMPT: the KL divergence of each position's next-token distribution
    from fp32's, and the share of GREEDY_TOKENS greedy tokens (through the decode path) that are fp32's top choice."""

    kl: torch.Tensor
    agreement: float


GREEDY_TOKENS = 48


async def _greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    stream = EngineClient(engine).submit([ids], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    return [token async for out in stream for token in out.token_ids]


def against_fp32(fp32: LoadedModel, other: LoadedModel) -> AgainstFp32:
    ids = fp32.tokenizer.encode(KL_PROMPT)
    ref, ours = prefill_logits(fp32, ids).float().log_softmax(-1), prefill_logits(other, ids).float().log_softmax(-1)
    engine = Engine(EngineConfig(), other)
    engine.start()
    try:
        generated = asyncio.run(_greedy(engine, ids, GREEDY_TOKENS))
    finally:
        engine.stop()
    fp32_top = prefill_logits(fp32, ids + generated)[len(ids) - 1:-1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(generated, fp32_top, strict=True)) / len(generated)
    return AgainstFp32((ref.exp() * (ref - ours)).sum(-1), agree)


def _load(model: str, path: str) -> LoadedModel:
    dtype, quantized, tiles = PATHS[path]
    return load_model(model, WeightPlan(dtype=dtype, device="cpu", quantized=quantized, tiles_from_rows=tiles))


def _row(name: str, values: list[float]) -> str:
    ranked = sorted(values)
    p99 = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]
    return f"{name:<30} {len(values):>5} {statistics.median(values):>10.2e} {p99:>10.2e} {ranked[-1]:>10.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="a GGUF (its weights quantized), or an alias")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    args = parser.parse_args()
    print(cpu.describe())
    paths = list(args.paths)
    if "bf16-tiles" in paths and not backend.tiles(torch.device("cpu")):
        paths.remove("bf16-tiles")
        print("bf16-tiles: no AMX tiles here")
    fp32 = _load(args.model, "fp32-dense")
    print(f"{'path: prompt logprob gaps':<30} {'count':>5} {'median':>10} {'p99':>10} {'max':>10}"
          f"    against fp32: KL mean, max; greedy agreement")
    for path in paths:
        loaded = _load(args.model, path)
        versus = against_fp32(fp32, loaded)
        engine = Engine(EngineConfig(), loaded)
        engine.start()
        try:
            measured = gaps(engine, [loaded.tokenizer.encode(p) for p in PROMPTS[:args.prompts]])
        finally:
            engine.stop()
        print(f"{_row(f'{path}, cut >= 2', measured.longer)}    {versus.kl.mean():.2e}, {versus.kl.max():.2e}; "
              f"{versus.agreement:.0%} of {GREEDY_TOKENS}")
        print(_row(f"{path}, cut 1", measured.one_token), flush=True)


if __name__ == "__main__":
    main()

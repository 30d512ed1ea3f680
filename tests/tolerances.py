"""The tests' numeric tolerances for whole models, in one place, each from measured noise: what was measured, on
which CPU class and level, with which command. A bound is about twice the largest value measured at any level, so
that another class's rounding (its kernels add in another order) passes where a wrong result does not.

Measured with `python -m tokenmill.bench.noise` (SmolLM2-135M Q4_1, its 8 prompts: 60 cuts and 16 one-token prompts
a path) at every level of a 2-core AMD EPYC Zen 4 (TOKENMILL_CPU_ISA avx512_bf16, its own, then avx512, avx2 and
scalar), 2026-11-28. The largest of the four levels, each path (at `scalar` GGUF weights load dense):

| path | median gap | largest gap | one-token prompt | KL against fp32: mean, largest | greedy agreement |
|---|---|---|---|---|---|
| fp32-dense | 1.9e-6 (avx2) | 2.3e-5 (avx2) | 2.1e-5 (scalar) | 0 | 100% |
| fp32-quantized | 1.6e-2 (avx2) | 0.51 (avx2) | 0 | 4.9e-3, 2.1e-2 | 98% |
| bf16-dense | 1.0e-2 (avx2: emulated bf16) | 0.15 (avx2) | 0.31 | 1.1e-3, 3.9e-3 | 98% |
| bf16-quantized | 9.5e-3 (avx2) | 0.27 | 0.23 | 5.5e-3, 1.9e-2 | 90% (avx2) |

The quantized kernels round each activation row to 8 bits per block of 32 (as llama.cpp's do): the last-bit
difference that attention over a longer chunk makes flips one of those roundings now and then, and a flip moves the
logits by up to a few tenths; the median stays about a hundredth. A bf16 model's one-token prompt, alone in its
step, runs the fused decode layer on fp32 rows where a longer prompt runs bf16 layers: their gap is bf16's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.layers.quantized import QuantizedLinear
from tokenmill.loader import LoadedModel


@dataclass(frozen=True)
class Gap:
    """Bounds on |echoed - decoded| logprob, in nats: the median and the largest over a prompt's cuts of two tokens
    or more, and the largest over one-token prompts."""

    median: float
    max: float
    one_token: float


PROMPT_LOGPROB_GAPS = {
    "fp32-dense": Gap(median=5e-6, max=5e-5, one_token=5e-5),
    "fp32-quantized": Gap(median=0.04, max=1.0, one_token=5e-5),
    "bf16-dense": Gap(median=0.03, max=0.4, one_token=0.6),
    "bf16-quantized": Gap(median=0.03, max=0.6, one_token=0.5),
    "bf16-tiles": Gap(median=0.03, max=0.6, one_token=0.5),  # AMX: no machine of that class measured yet
}

# Largest |logit difference| of the fp32 model against transformers' on the same weights (tests/model/test_fidelity.py;
# measured before: ~3e-5 on SmolLM2, ~1e-6 on the random models).
LOGITS_AGAINST_TRANSFORMERS = 1e-3

# KL divergence of the next-token distributions from the dense fp32 model's (tests/model/test_fidelity.py's prompt),
# mean and largest over its positions.
KL_AGAINST_FP32 = {
    "fp32-quantized": (0.01, 0.05),
    "bf16-dense": (0.003, 0.01),
    "bf16-quantized": (0.01, 0.05),
    "bf16-tiles": (0.01, 0.05),  # Sapphire Rapids, 2026-11-26: 0.001, 0.003
}

# The share of 48 greedy tokens, through the decode path, that are the dense fp32 model's top choice after the same
# tokens (tests/model/test_fidelity.py).
AGREEMENT_WITH_FP32 = {
    "fp32-quantized": 0.9,
    "bf16-dense": 0.9,
    "bf16-quantized": 0.8,
    "bf16-tiles": 0.8,
}


def path_of(loaded: LoadedModel) -> str:
    """The path a loaded model runs: its dtype, and whether its weights are kept quantized (below 16 bits) and run on
    AMX tiles from some row count."""
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}[str(loaded.dtype)]
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear) and m.weight.bits < 16]
    if not quantized:
        return f"{dtype}-dense"
    return f"{dtype}-tiles" if any(m.tiles_from_rows for m in quantized) else f"{dtype}-quantized"

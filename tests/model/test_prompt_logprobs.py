"""A prompt token's logprob is one number whatever the chunking, within what the path allows: its echo (the whole
prompt prefilled at once) against what a completion of the prompt cut before it reports for it (a shorter prefill),
on every path, at every instruction-set level (tests/paths). The bounds, and what they were measured from, are in
tests/tolerances.py; tokenmill/bench/noise.py measures them."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from helpers import start_engine
from tolerances import PROMPT_LOGPROB_GAPS, path_of

from tokenmill import kernels
from tokenmill.bench.agree import PROMPTS
from tokenmill.bench.noise import Gaps, gaps
from tokenmill.config import WeightPlan
from tokenmill.loader import LoadedModel, load_model

TESTED_PROMPTS = PROMPTS[:4]  # 41 cuts of SmolLM2's tokens


def measured(loaded: LoadedModel, **config) -> Gaps:
    engine = start_engine(loaded, **config)
    try:
        return gaps(engine, [loaded.tokenizer.encode(p) for p in TESTED_PROMPTS])
    finally:
        engine.stop()


def assert_within(path: str, found: Gaps) -> None:
    bound = PROMPT_LOGPROB_GAPS[path]
    typical, worst = statistics.median(found.longer), max(found.longer)
    assert typical <= bound.median and worst <= bound.max, \
        f"{path}: median gap {typical:.2e} (bound {bound.median:.0e}), largest {worst:.2e} (bound {bound.max:.0e})"
    assert max(found.one_token) <= bound.one_token, \
        f"{path}: one-token prompts' gap {max(found.one_token):.2e} (bound {bound.one_token:.0e})"


@pytest.mark.slow
def test_dense_fp32_prompt_logprobs_are_the_decoded_ones_within_fp32_rounding(smollm: LoadedModel) -> None:
    """No 8-bit rounding and no bf16 between them: only the last bits of attention over a longer chunk."""
    assert path_of(smollm) == "fp32-dense"
    assert_within("fp32-dense", measured(smollm))


@pytest.mark.slow
def test_quantized_fp32_prompt_logprobs_track_the_decoded_ones(smollm_served: LoadedModel) -> None:
    """The served default (the end-to-end tests' server): typically within a hundredth of a nat, a flipped 8-bit
    rounding now and then moving a token by up to a few tenths."""
    assert_within(path_of(smollm_served), measured(smollm_served))


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "quantized"])
def test_bf16_prompt_logprobs_track_the_decoded_ones(smollm_path: Path, quantized: bool) -> None:
    """bf16, the one-token prompt included: alone in its step it runs the fused decode layer on fp32 rows, where the
    echo's row ran bf16 layers (the gap bounded, not closed: every decoded token after the first runs that layer
    too, so lm-eval's scores of a bf16 model carry it either way)."""
    if quantized and not kernels.has_vector_kernels():
        pytest.skip("GGUF weights load dense here: the dense case is this one")
    loaded = load_model(str(smollm_path), WeightPlan(dtype="bfloat16", device="cpu", quantized=quantized,
                                                     tiles_from_rows=0))
    assert_within(path_of(loaded), measured(loaded))


@pytest.mark.slow
def test_in_deterministic_mode_a_prompt_logprob_is_the_decoded_one_bit_for_bit(smollm_path: Path) -> None:
    """Every row's arithmetic its own (one attention kernel for prefill and decode, fixed matmul tiles): the chunk
    changes nothing."""
    loaded = load_model(str(smollm_path), WeightPlan(dtype="float32", device="cpu", deterministic=True))
    found = measured(loaded, deterministic=True)
    assert max(found.longer + found.one_token) == 0.0

"""tokenmill/backend.py decides which kernels compute; nothing else in tokenmill/ probes for them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill import backend, kernels
from tokenmill.kernels import gpu

PACKAGE = Path(backend.__file__).parent
# What picks a path by asking for CUDA, Triton or the C++ kernels
PROBES = ("kernels.load()", "has_vector_kernels()", "has_tiles()", "gpu.runs(", "gpu.serves(", "gpu.ready(",
          "gpu.available(", "torch.cuda.is_available()")


def test_no_module_but_the_backend_probes_for_kernels() -> None:
    """The kernels' own package answers the probes; backend.py asks them; the rest ask backend.py."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "backend.py"
             and not path.is_relative_to(PACKAGE / "kernels")
             for number, line in enumerate(path.read_text().splitlines(), 1) if any(p in line for p in PROBES)]
    assert found == []


def test_without_the_cpu_kernels_torch_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "load", lambda: False)
    assert not backend.cpu_kernels(cpu) and not backend.vector_kernels(cpu) and not backend.tiles(cpu)
    assert not backend.keeps_quantized(cpu, experts=False)


def test_the_cpu_kernels_run_quantized_weights_with_their_vector_code_only(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "load", lambda: True)
    monkeypatch.setattr(kernels, "has_vector_kernels", lambda: True)
    assert backend.cpu_kernels(cpu) and backend.vector_kernels(cpu) and backend.keeps_quantized(cpu, experts=True)
    monkeypatch.setattr(kernels, "has_vector_kernels", lambda: False)
    with caplog.at_level(logging.INFO, logger="tokenmill.backend"):
        assert backend.cpu_kernels(cpu) and not backend.vector_kernels(cpu)
        assert not backend.keeps_quantized(cpu, experts=False)
    assert caplog.messages == ["this CPU lacks AVX2/FMA: GGUF weights dequantized at load (the quantized kernels' "
                               "plain loops are slower than dense matmuls)"]
    assert not backend.cpu_kernels(torch.device("meta"))


def test_on_a_gpu_the_triton_kernels_compute_where_they_are_ready_and_never_a_mixture_of_experts(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cuda, ready = torch.device("cuda", 0), {"on": True}
    monkeypatch.setattr(gpu, "ready", lambda device: ready["on"])
    assert backend.gpu_kernels(cuda) and not backend.gpu_kernels(torch.device("cpu"))
    assert not backend.cpu_kernels(cuda) and not backend.gpu_runs(torch.empty(2))  # a CPU tensor
    assert backend.keeps_quantized(cuda, experts=False)
    with caplog.at_level(logging.INFO, logger="tokenmill.backend"):
        assert not backend.keeps_quantized(cuda, experts=True)
    assert caplog.messages == ["a mixture of experts on CUDA: GGUF weights dequantized at load"]
    ready["on"] = False
    assert not backend.gpu_kernels(cuda) and not backend.keeps_quantized(cuda, experts=False)


@pytest.mark.parametrize(("choose", "measured", "what"), [
    (backend.bf16_pair_attention, backend._pair_attention_measured_faster, "prefill attention"),
    (backend.bf16_pair_matmul, backend._pair_matmul_measured_faster, "matmuls on bf16 weights"),
])
def test_bf16_pairs_are_chosen_by_a_measurement_unless_named(
        choose: Callable[[str], bool], measured: functools._lru_cache_wrapper, what: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert choose("on") and not choose("off")
    monkeypatch.setattr(kernels, "built_with", lambda: ["avx2", "avx512"])
    assert not choose("auto")  # nothing to measure without AVX512-BF16
    if not kernels.load():
        return
    monkeypatch.undo()
    if "avx512_bf16" not in kernels.built_with():
        pytest.skip("no AVX512-BF16 here")
    for pairs, fp32 in ((2.0, 1.0), (1.0, 3.0)):
        measured.cache_clear()
        times = iter([0.0, pairs, 0.0, fp32] * 3)  # each call's start and end
        monkeypatch.setattr(backend.time, "perf_counter", lambda times=times: next(times))
        with caplog.at_level(logging.INFO, logger="tokenmill.backend"):
            assert choose("auto") == (pairs < fp32)
        chose = "bf16 pairs" if pairs < fp32 else "fp32"
        assert f"{what} in bf16: on {chose} (on bf16 pairs {pairs * 1e3:.2f} ms, on fp32 {fp32 * 1e3:.2f} ms" \
            in caplog.text
    measured.cache_clear()


def test_bf16_prefill_attention_takes_amx_tiles_where_the_kernels_run_on_them_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(backend, "tiles", lambda device: True)
    assert backend.bf16_prefill_attention(cpu, "on") == "tiles"
    assert backend.bf16_prefill_attention(cpu, "on", amx=False) == "pairs"
    assert backend.bf16_prefill_attention(cpu, "off", amx=False) == "fp32"
    monkeypatch.setattr(backend, "tiles", lambda device: False)
    assert backend.bf16_prefill_attention(cpu, "on") == "pairs"
    assert backend.bf16_prefill_attention(cpu, "off") == "fp32"

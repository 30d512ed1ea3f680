"""The kernel and fidelity tests at an instruction-set level below this machine's own (tokenmill/cpu.py), each level
in a pytest process of its own with TOKENMILL_CPU_ISA set: its kernels built without the instructions above it,
bf16 and AMX seen as absent, PyTorch's own kernels capped alike. tests/paths/ has a test per level, so the test
command runs every path this machine can run; the machine's own level is the rest of the suite's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import cpu

ROOT = Path(__file__).resolve().parent.parent

# What a level changes: the C++ kernels (each has a path per level), the dtype and weights `auto` picks, and the model
# against transformers and against fp32 through them.
PATH_TESTS = (
    "tests/unit/test_cpu.py",
    "tests/unit/test_layer_kernels.py",
    "tests/unit/test_quantized.py",
    "tests/unit/test_attention.py",
    "tests/unit/test_kv_quant.py",  # a quantized pool read by each level's vector loads
    "tests/unit/test_norm.py",
    "tests/unit/test_linear.py",
    "tests/unit/test_sampler.py",  # kernels/sample.cpp's exp_sum has a path per level
    "tests/unit/test_batch_invariance.py",
    "tests/model/test_fidelity.py",
    "tests/model/test_prompt_logprobs.py",
    "tests/model/test_lora.py",  # kernels/lora.cpp, op by op and inside the fused layer, against PEFT
)
# The real model against transformers, at the machine's own level only: most of its half a minute is transformers
# reading the GGUF; the same fp32 path meets transformers at every level on the random models of the same file.
OWN_LEVEL_ONLY = "test_smollm2_gguf_matches_transformers"
# Without vector code (the plain loops' level) a dense bf16 model's matmuls are PyTorch's (models/registry.py keeps
# bf16 matrices for the kernels only where they are vectorized), and the [quantized] runs of these two tests take
# the same norms and attention through the plain loops: the [dense] ones would test PyTorch's capped matmuls, for
# half a minute.
TORCH_ONLY_WITHOUT_VECTORS = (
    "tests/model/test_fidelity.py::test_smollm2_bf16_tracks_fp32[dense]",
    "tests/model/test_prompt_logprobs.py::test_bf16_prompt_logprobs_track_the_decoded_ones[dense]",
)


def run_at(level: str) -> None:
    """Run PATH_TESTS at `level`; skipped where this machine cannot run it, or where it is the machine's own."""
    supported = cpu.supported_levels()
    if level not in supported:
        pytest.skip(f"this CPU runs {', '.join(supported)}, not {level}")
    if level == supported[-1]:
        pytest.skip(f"{level} is this machine's own level: the rest of the suite runs it")
    env = {key: value for key, value in os.environ.items()
           if key not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env.update({cpu.ISA_ENV: level, "OMP_NUM_THREADS": "1"})
    vectors = {"avx2", "fma"} <= set(cpu.LEVELS[cpu.LEVEL_NAMES.index(level)].requires)
    deselect = [] if vectors else [arg for test in TORCH_ONLY_WITHOUT_VECTORS for arg in ("--deselect", test)]
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-rs", "-p", "no:cacheprovider",
                           "-k", f"not {OWN_LEVEL_ONLY}", *deselect, *PATH_TESTS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"{cpu.ISA_ENV}={level}: {summary}")
    assert done.returncode == 0, f"at {level}:\n{done.stdout[-12000:]}\n{done.stderr[-3000:]}"

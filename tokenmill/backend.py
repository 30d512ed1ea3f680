"""Which kernels compute: the one place that decides, from one probe of the hardware.

A tensor's op runs on Triton's kernels on a CUDA device where they work (kernels/gpu.py, checked once per device),
on tokenmill's C++ kernels on a CPU where they built (kernels/, built once per machine and level), else on
PyTorch's own. The device and dtype that `auto` means are decided here too. The layers, the model builder, the
loader, the KV cache and the engine ask these functions; none of them tests for CUDA, Triton or the C++ kernels
itself (tests/unit/test_backend.py holds them to it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from tokenmill import cpu, kernels
from tokenmill.errors import ConfigError
from tokenmill.kernels import gpu

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def gpu_runs(x: torch.Tensor) -> bool:
    """x's op runs on the GPU kernels (x is on a CUDA device where they work)."""
    return gpu.runs(x)


def gpu_kernels(device: torch.device) -> bool:
    """The tensors a step puts on device run on the GPU kernels (they are ready there)."""
    return gpu.serves(device)


def gpu_count() -> int:
    """The CUDA GPUs this process sees (0 without CUDA): tensor-parallel ranks of one host take one each."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_kernels(device: torch.device) -> bool:
    """device's ops run on tokenmill's C++ kernels: a CPU where they built (TOKENMILL_NO_KERNELS=1: never)."""
    return device.type == "cpu" and kernels.load()


def release_threads(device: torch.device) -> None:
    """Let the calling thread's OpenMP threads go, where device runs on the C++ kernels (kernels/threads.cpp says
    why): an engine's thread, as it idles."""
    if cpu_kernels(device):
        torch.ops.tokenmill.release_threads()


def vector_kernels(device: torch.device) -> bool:
    """The C++ kernels run here with their vector code (AVX2 and FMA, or above); without it they are plain loops,
    correct but slower than the matmul library's dense matmuls."""
    return cpu_kernels(device) and kernels.has_vector_kernels()


def tiles(device: torch.device) -> bool:
    """The C++ kernels run here on AMX tiles."""
    return cpu_kernels(device) and kernels.has_tiles()


def bf16_prefill_attention(device: torch.device, pair_choice: str = "auto", amx: bool = True) -> str:
    """What bf16 prompt chunks multiply on in the CPU's prefill attention kernel: "tiles" (AMX) where the kernels
    run on them and --amx-attention leaves them on, else "pairs" or "fp32" as bf16_pair_attention says."""
    if amx and tiles(device):
        _log_once("prefill attention in bf16: on AMX tiles (--no-amx-attention: bf16 pairs or fp32)")
        return "tiles"
    return "pairs" if bf16_pair_attention(pair_choice) else "fp32"


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def bf16_pair_attention(choice: str = "auto") -> bool:
    """Whether bf16 prompt chunks attend on bf16 pairs (vdpbf16ps) in the CPU's prefill kernel, where it has them,
    rather than on fp32 tiles: on/off as --bf16-pair-attention says, and for auto whichever the CPU runs faster,
    measured once (AMD's Zen 4 runs the pairs 1.6x faster, Intel's Emerald Rapids 1.5x slower)."""
    if choice != "auto":
        return choice == "on"
    return "avx512_bf16" in kernels.built_with() and _pair_attention_measured_faster()


def bf16_pair_matmul(choice: str = "auto") -> bool:
    """Whether bf16 rows multiply bf16 weights (a bf16 model's, kept for the kernels) as bf16 pairs (vdpbf16ps) in
    the CPU's matmul kernel, where it has them, rather than widened to fp32 multiply-adds: on/off as
    --bf16-pair-matmul says, and for auto whichever the CPU runs faster, measured once (Intel's Emerald Rapids runs
    the multiply-adds 1.7-1.9x faster from 4 rows)."""
    if choice != "auto":
        return choice == "on"
    return "avx512_bf16" in kernels.built_with() and _pair_matmul_measured_faster()


def _pairs_faster(what: str, flag: str, run: Callable[[bool], object]) -> bool:
    """run(pairs) each way three times in turn: whether the pairs were the faster by their best time, logged."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(3):
        for pairs in best:
            started = time.perf_counter()
            run(pairs)
            best[pairs] = min(best[pairs], time.perf_counter() - started)
    faster = best[True] < best[False]
    log.info("%s in bf16: on %s (on bf16 pairs %.2f ms, on fp32 %.2f ms; %s on|off to choose)", what,
             "bf16 pairs" if faster else "fp32", best[True] * 1e3, best[False] * 1e3, flag)
    return faster


@functools.cache
def _pair_attention_measured_faster() -> bool:
    """A SmolLM2-shaped chunk: 9 query heads and 3 KV heads of 64; 256 rows after 512 cached keys."""
    heads, kv_heads, dim, rows, cached = 9, 3, 64, 256, 512
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2, (rows + cached) // 16 + 1, 16, kv_heads, dim, generator=generator).bfloat16()
    q = torch.randn(rows, heads, dim, generator=generator).bfloat16()
    table = torch.arange(1, pool.shape[1])
    return _pairs_faster("prefill attention", "--bf16-pair-attention", lambda pairs: (
        torch.ops.tokenmill.paged_prefill_attention(q, pool[0], pool[1], table, cached, 0.125, 0, pairs)))


@functools.cache
def _pair_matmul_measured_faster() -> bool:
    """A SmolLM2-shaped matmul: 32 rows by the down projection's 1,536 x 576 bf16 weights, in the kernels' 16-bit
    layout (layers/quantized.py's from_dense: [16-row groups, blocks of 32, 16 pairs, 16 rows, 2]; any values)."""
    rows, width, out = 32, 1536, 576
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out // 16, width // 32, 16, 16, 2, generator=generator).bfloat16().view(torch.uint8)
    x = torch.randn(rows, width, generator=generator).bfloat16()
    return _pairs_faster("matmuls on bf16 weights", "--bf16-pair-matmul", lambda pairs: (
        torch.ops.tokenmill.quantized_linear(x, weight, torch.empty(0), None, 32, 0, out, 0, False, False, pairs)))


def fp8_kv_runs(device: torch.device) -> bool:
    """An fp8 (e4m3) KV pool runs here: on the CPU, the torch path, or GPU kernels on sm_89 or newer (Triton converts
    e4m3 there only)."""
    return device.type != "cuda" or not gpu_kernels(device) or torch.cuda.get_device_capability(device) >= (8, 9)


def keeps_quantized(device: torch.device, experts: bool) -> bool:
    """Whether device's kernels run a GGUF's quantized matrices: the CPU's C++ ones with their vector loops, or the
    GPU's Triton ones (not a mixture of experts', whose experts run on the host: layers/moe.py)."""
    if device.type == "cuda":
        if experts:
            log.info("a mixture of experts on CUDA: GGUF weights dequantized at load")
        return not experts and gpu_kernels(device)
    if not cpu_kernels(device):
        return False
    if not kernels.has_vector_kernels():
        log.info("this CPU lacks AVX2/FMA: GGUF weights dequantized at load (the quantized kernels' plain loops are "
                 "slower than dense matmuls)")
        return False
    return True


def resolve_device(name: str) -> torch.device:
    """The device named, a GPU with its index (cuda: the current one), as its tensors name it: what is cached per
    device (gpu.ready, gpu.pdl_ready) is then asked once, for the device the kernels run on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: tokenmill runs on cpu and cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"--device {name}: no CUDA GPU is available (torch {torch.__version__}, {build})")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware computes it natively (CUDA; CPUs with AMX or AVX512-BF16), else fp32 (emulated
    bf16 matmuls are slower than fp32 ones at the row counts that matter: docs/serving.md); on a CPU,
    TOKENMILL_DTYPE's where it is set (tokenmill/cpu.py)."""
    if name == "auto" and device.type == "cpu":
        name = cpu.auto_dtype() or name
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu.computes_bf16():
        return torch.bfloat16
    return torch.float32

"""Which kernels compute: the one place that decides, from one probe of the hardware.

A tensor's op runs on Triton's kernels on a CUDA device where they work (kernels/gpu.py, checked once per device),
on tokenmill's C++ kernels on a CPU where they built (kernels/, built once per machine and level), else on
PyTorch's own. The device and dtype that `auto` means are decided here too. The layers, the model builder, the
loader, the KV cache and the engine ask these functions; none of them tests for CUDA, Triton or the C++ kernels
itself (tests/unit/test_backend.py holds them to it).
"""

from __future__ import annotations

import logging

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


def vector_kernels(device: torch.device) -> bool:
    """The C++ kernels run here with their vector code (AVX2 and FMA, or above); without it they are plain loops,
    correct but slower than the matmul library's dense matmuls."""
    return cpu_kernels(device) and kernels.has_vector_kernels()


def tiles(device: torch.device) -> bool:
    """The C++ kernels run here on AMX tiles."""
    return cpu_kernels(device) and kernels.has_tiles()


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

"""tokenmill: an OpenAI-compatible LLM inference server in plain PyTorch."""

from tokenmill import cpu

__version__ = "0.1.0"

cpu.cap_torch()  # TOKENMILL_CPU_ISA caps PyTorch's kernels too: before torch runs any

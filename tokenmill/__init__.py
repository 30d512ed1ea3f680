"""tokenmill: an OpenAI-compatible LLM inference server in plain PyTorch."""

__version__ = "0.1.0"

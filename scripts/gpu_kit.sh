#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what scripts/gpu_check.sh needs on a GPU machine that has CUDA, PyTorch, Triton
# and transformers but cannot reach a package index (a lent GPU box):
#   .whl/  wheels of tokenmill's other requirements for CPython 3.12 (the tokenizer, server and test packages;
#          pytest-timeout, which gpu_check.sh's --timeout needs)
#   .gpu/smollm2-tokenizer.gguf  SmolLM2's tokenizer and chat template alone (a few MB), which the synthetic models
#          of scripts/synthetic_gguf.py copy: they serve like the default model, on random weights
# Both stay out of git (.git/info/exclude); carry them to the GPU machine with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
for path in /.whl/ /.gpu/; do grep -qx "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
rm -rf .whl && mkdir -p .whl .gpu
# Pinned to the versions the tests pass with here; the GPU image's own torch, numpy, tokenizers, transformers,
# jinja2, safetensors, httpx, anyio, pytest stay as they are.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  llguidance==1.9.1 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  opentelemetry-api==1.45.2 openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 distro sniffio==1.3.1 h11==0.16.0 pytest-timeout==2.4.0
PYTHONPATH=. "$py" - <<'EOF'
from gguf import GGUFWriter

from tokenmill.loader.sources import pull
from scripts.synthetic_gguf import copy_tokenizer

writer = GGUFWriter(".gpu/smollm2-tokenizer.gguf", "llama")
copy_tokenizer(pull("smollm2-135m", quiet=True), writer)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
EOF
du -sh .whl .gpu

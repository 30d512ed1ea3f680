#!/usr/bin/env bash
# The CUDA path's checks and measurements in one run on a GPU machine (issue 20; under 9 minutes on an H200):
#   bash scripts/gpu_check.sh [OUT_DIR]        from the checkout's root, after scripts/gpu_kit.sh (on a machine with
#                                              PyPI) made .whl/ and .gpu/, carried along with the checkout
# 1. the CUDA tests, tests/gpu first (bf16 fidelity against transformers, graphs against op-by-op steps, greedy alone
#    against a batch of 32, PDL against plain launches, prefix cache, chunks, preemption, aborts, quantized weights
#    against their dense twins), then the GPU kernels' and the random-model fidelity tests on CUDA; 2. synthetic
#    Llama GGUFs of random weights with SmolLM2's tokenizer in Q4_1 (SmolLM2's own file's types: Q4_1, the
#    embeddings Q8_0), of the default model's shape (135M) and of TinyLlama's (1.1B); 3. bf16 decode tok/s at 1, 32
#    and 256 streams and prefill tok/s (tokenmill.bench.decode), all with CUDA graphs: the 135M kept quantized and
#    dequantized at load (--no-quantized-weights, the dense bf16 path), each with programmatic dependent launch and
#    without (--no-gpu-pdl), with a profile of one-stream decode steps each way; the 1.1B kept quantized and
#    dequantized; 4. where scripts/gpu_kit_llama.sh built .gpu/llama-batched-bench.xz, llama.cpp's CUDA build on the
#    same GGUFs: 128 tokens after a 16-token prompt (about the bench's) at 1, 32 and 256 sequences, and 8 prompts of
#    1,000 tokens. Each part has a time limit, in order of what matters most, and gpu.txt logs when each started.
# Writes gpu.txt, tests.txt, bench-135m-q4_1.txt, bench-1b-q4_1.txt, llama.txt and llama-log.txt into OUT_DIR
# (default $OUT, else /tmp/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out" /tmp/models
started=$SECONDS
: > "$out/gpu.txt"  # this run's log alone
stage() { echo "[$((SECONDS - started)) s] $*" | tee -a "$out/gpu.txt"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  # the bandwidth ceiling the bench's GB/s are read against: a device-to-device copy of 2 GiB, bytes read + written
  python3 -c "
import torch
a = torch.empty(2**30, dtype=torch.bfloat16, device='cuda'); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10): b.copy_(a)
end.record(); torch.cuda.synchronize()
print(f'copy bandwidth {2 * a.nbytes * 10 / start.elapsed_time(end) / 1e6:.0f} GB/s (read + written)')"
} 2>&1 | tee -a "$out/gpu.txt"
reference=.gpu/smollm2-tokenizer.gguf
[ -f "$reference" ] || reference=""  # then synthetic_gguf.py pulls SmolLM2 itself (needs the network)
small=/tmp/models/smollm2-shape-q4_1.gguf large=/tmp/models/tinyllama-shape-q4_1.gguf
python3 scripts/synthetic_gguf.py $small --hidden 576 --layers 30 --ffn 1536 --heads 9 --kv-heads 3 --type Q4_1 \
  ${reference:+--reference "$reference"} > /dev/null &
python3 scripts/synthetic_gguf.py $large --type Q4_1 ${reference:+--reference "$reference"} > /dev/null &
stage "tests"
TOKENMILL_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -s -p no:cacheprovider --timeout 90 tests/gpu \
  tests/unit/test_gpu_kernels.py tests/model/test_fidelity.py::test_random_hf_model_matches_transformers 2>&1 \
  | tee "$out/tests.txt"
wait
bench() {  # LIMIT_S MODEL OUTPUT [FLAGS...]
  local limit=$1 model=$2 file=$3
  shift 3
  stage "bench $model $*"
  timeout "$limit" python3 -m tokenmill.bench.decode "$model" --device cuda --dtype bfloat16 --streams 1 32 256 \
    --prefill --runs 3 --tokens 128 "$@" 2>&1 | grep -v -E "^(INFO|WARNING):" | tee "$out/$file"
}
bench 200 $small bench-135m-q4_1.txt --quantized both --pdl both --profile
bench 120 $large bench-1b-q4_1.txt --quantized both
bench 90 $small bench-135m-kv.txt --kv-cache-dtype int8 fp8_e4m3 --streams 1 32  # a quantized KV pool's kernels
if [ -f .gpu/llama-batched-bench.xz ]; then
  stage "llama.cpp"
  llama=/tmp/llama-batched-bench
  xz -dc .gpu/llama-batched-bench.xz > $llama && chmod +x $llama
  # cudart and cuBLAS: the GPU image's nvidia wheels (PyTorch's), else its toolkit
  libs=$(python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__
    for p in glob.glob(d + '/**/lib*.so.*', recursive=True)})))")
  export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  ldd $llama | grep "not found"
  for model in $small $large; do  # -ngl 99: every layer on the GPU; -fa on: flash attention
    echo "$model"
    timeout 60 $llama -m "$model" -ngl 99 -fa on -c 40960 -b 2048 -ub 512 -npp 16 -ntg 128 -npl 1,32,256 \
      2>>"$out/llama-log.txt"
    timeout 30 $llama -m "$model" -ngl 99 -fa on -c 8192 -b 2048 -ub 512 -npp 1000 -ntg 1 -npl 8 \
      2>>"$out/llama-log.txt"
  done 2>&1 | tee "$out/llama.txt"
fi
stage "done"

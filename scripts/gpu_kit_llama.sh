#!/usr/bin/env bash
# Build llama.cpp's batched benchmark with CUDA for Hopper (sm_90: H100, H200) into .gpu/llama-batched-bench.xz, so
# that scripts/gpu_check.sh times llama.cpp beside tokenmill, on the same GGUFs, on a GPU machine that cannot fetch
# anything. Run it where PyPI is reachable, with CUDA's compiler installed (CUDA_HOME, default /usr/local/cuda;
# CUDA 13, the lent GPU machines' version), cmake and g++; 40 minutes on 2 cores, nothing on the GPU's clock.
#   llama.cpp: the tree vendored in llama-cpp-python's sdist (the one docs/performance/bench.md builds for the CPU)
#   cuBLAS: the toolkit's, else the nvidia-cublas wheel's (what PyTorch's CUDA 13 builds install)
#   libcuda: the driver's library is the GPU machine's own; the link takes a stand-in that names the calls ggml makes
# The binary links cudart and cuBLAS dynamically: gpu_check.sh finds them among the GPU image's nvidia wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
cuda=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
work=${WORK:-/tmp/llama-cuda}
version=0.3.36
mkdir -p "$work" .gpu
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
if [ ! -d "$work/llama.cpp" ]; then
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
  tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$work/llama.cpp"
fi
toolkit=$work/toolkit
if [ ! -d "$toolkit" ]; then
  cp -a "$cuda" "$toolkit.part"
  if [ ! -f "$toolkit.part/include/cublas_v2.h" ]; then
    "$py" -m pip download -q --no-deps --only-binary=:all: "nvidia-cublas>=13.0,<14" -d "$work/wheels"
    "$py" -m zipfile -e "$work"/wheels/nvidia_cublas-*.whl "$work/cublas"
    cp -a "$work"/cublas/nvidia/cu13/include/. "$toolkit.part/include/"
    cp -a "$work"/cublas/nvidia/cu13/lib/. "$toolkit.part/lib64/"
    for lib in cublas cublasLt; do ln -sf "lib$lib.so.13" "$toolkit.part/lib64/lib$lib.so"; done
  fi
  mkdir -p "$toolkit.part/lib64/stubs"
  calls=$(grep -ohE '\bcu[A-Z][A-Za-z0-9_]+\s*\(' "$work"/llama.cpp/ggml/src/ggml-cuda/*.cu* | grep -vE '^cu(da|b|BLAS)' \
    | sed 's/\s*($//' | sort -u)
  for call in $calls; do echo "int $call(void) { return 0; }"; done > "$toolkit.part/lib64/stubs/cuda.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$toolkit.part/lib64/stubs/libcuda.so" \
    "$toolkit.part/lib64/stubs/cuda.c"
  mv "$toolkit.part" "$toolkit"
fi
export PATH="$toolkit/bin:$PATH" CUDA_PATH="$toolkit"
cmake -S "$work/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_COMPILER="$toolkit/bin/nvcc" -DCUDAToolkit_ROOT="$toolkit" \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_SKIP_RPATH=ON > "$work/cmake.log"
cmake --build "$work/build" --target llama-batched-bench -j "$(nproc)"
strip -o "$work/llama-batched-bench" "$work/build/bin/llama-batched-bench"
xz -T0 -6 -c "$work/llama-batched-bench" > .gpu/llama-batched-bench.xz
du -h .gpu/llama-batched-bench.xz

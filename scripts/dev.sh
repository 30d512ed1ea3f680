#!/usr/bin/env bash
# Set up (once) and run tokenmill from a checkout.
#   bash scripts/dev.sh serve [MODEL] [FLAGS...]   the OpenAI-compatible server (default model: smollm2-135m)
#   bash scripts/dev.sh test [PYTEST ARGS...]      lint, import layers, types, then the test suite
#   bash scripts/dev.sh mutate MODULE|all          mutation testing of a module with the tests that cover it (mutmut;
#                                                  slow, not part of CI): scripts/mutate.py lists the modules
# The virtual environment lives in .venv (TOKENMILL_VENV overrides). PyTorch is installed first, as
# TOKENMILL_TORCH says (default torch==2.13.0; for a CUDA build on another machine, set it to the torch
# requirement your CUDA wants), and only if the venv has none yet.
set -euo pipefail
cd "$(dirname "$0")/.."
# Packages install without their bytecode (--no-compile below): each module is compiled when first imported and
# its .pyc written then, which PYTHONDONTWRITEBYTECODE would forbid. Under it every process (the test workers, each
# tensor-parallel rank, each server a test starts) compiled torch's and transformers' sources again: collecting the
# tests took 39 s a worker instead of 13 on a 2-core Zen 3.
unset PYTHONDONTWRITEBYTECODE
verb=${1:?usage: bash scripts/dev.sh serve|test|mutate [ARGS...]}
shift
venv=${TOKENMILL_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
case "$verb" in test) extras="[dev]" ;; mutate) extras="[dev,mutation]" ;; *) extras="" ;; esac
# The C++ kernels for this CPU's level, then for the lower ones tests/paths runs, in the background: the tests wait
# for a build still running (kernels.build_lock) or redo a failed one.
kernels_building=""
build_kernels() {
  PYTHONPATH=. "$py" scripts/build_kernels.py > "$venv/kernel-build.log" 2>&1 &
  kernels_building=yes
}
stamp="$venv/.installed-$verb-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # --no-compile: Python compiles what it imports on first use; compiling every module of torch and transformers at
  # install took longer than their install (24 s against 7 s for torch on a 2-core Zen 3).
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q --no-compile "${TOKENMILL_TORCH:-torch==2.13.0}"
  if [ "$verb" = test ]; then
    # The C++ kernels need torch and ninja alone: they start compiling now, beside the rest of the install.
    "$py" -m pip install -q --no-compile ninja
    build_kernels
  fi
  "$py" -m pip install -q --no-compile -e ".$extras"
  touch "$stamp"
fi
case "$verb" in
  serve) exec "$venv/bin/tokenmill" serve "$@" ;;
  test)
    [ -n "$kernels_building" ] || build_kernels  # beside the static checks, on the core mypy leaves idle
    "$venv/bin/ruff" check tokenmill tests scripts
    "$venv/bin/lint-imports"  # the layers of .importlinter: a request flows one way
    "$venv/bin/mypy"  # [tool.mypy] in pyproject.toml
    "$venv/bin/mkdocs" build --strict --site-dir "$venv/docs-site"  # docs/ as a site: a broken link fails the tests
    # tests/e2e/test_browser.py drives Debian's Chromium: installed here where this user may (root, apt-get);
    # without it those tests are skipped.
    if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
        || echo "could not install chromium: the browser tests will be skipped" >&2
    fi
    # Test files run in parallel workers (pytest-xdist; one file's tests stay on one worker, so its module fixtures
    # load once), each on one thread: two torch processes of two threads on two cores spin against each other.
    # One worker per core and per 6 GiB of available memory (also under a container's limit), 4 at most: two workers
    # on a 2-core VM peaked at 13.7 GiB together, one at 9.5 GiB (the real Gemma 3 against transformers takes 6.5
    # GiB alone). tests/unit/test_layer_kernels.py runs the C++ kernels on 1 and 3 threads. `-n 0` runs the tests
    # in this process, one after another. (GNU nproc would count OMP_NUM_THREADS as the cores.)
    workers=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null \
      || echo 1)
    memory=$(awk '/^MemAvailable:/ {print int($2 / 6291456)}' /proc/meminfo 2>/dev/null || echo 1)
    container=$(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo max)
    [ "$container" = max ] && container=4 || container=$(( container / 6442450944 ))
    for limit in "${memory:-1}" "$container" 4; do [ "$workers" -le "$limit" ] || workers=$limit; done
    [ "$workers" -ge 1 ] || workers=1
    # --no-loadscope-reorder: files in tests/conftest.py's order, longest first (xdist's own puts the files with the
    # most tests first, which left the CPU levels' minutes to the end).
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$py" -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
      --durations=15 "$@" ;;
  mutate) exec "$py" scripts/mutate.py "$@" ;;
  *) echo "unknown verb $verb: use serve, test or mutate" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Set up (once) and run tokenmill from a checkout.
#   bash scripts/dev.sh serve [MODEL] [FLAGS...]   the OpenAI-compatible server (default model: smollm2-135m)
#   bash scripts/dev.sh test [PYTEST ARGS...]      the test suite
# The virtual environment lives in .venv (TOKENMILL_VENV overrides). PyTorch is installed first, as
# TOKENMILL_TORCH says (default torch==2.13.0; for a CUDA build on another machine, set it to the torch
# requirement your CUDA wants), and only if the venv has none yet.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:?usage: bash scripts/dev.sh serve|test [ARGS...]}
shift
venv=${TOKENMILL_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
extras=$([ "$verb" = test ] && echo "[dev]" || echo "")
stamp="$venv/.installed-$verb-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "${TOKENMILL_TORCH:-torch==2.13.0}"
  "$py" -m pip install -q -e ".$extras"
  touch "$stamp"
fi
case "$verb" in
  serve) exec "$venv/bin/tokenmill" serve "$@" ;;
  test) "$venv/bin/ruff" check tokenmill tests && exec "$py" -m pytest "$@" ;;
  *) echo "unknown verb $verb: use serve or test" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Side by side over HTTP, in interleaved rounds: tokenmill (default), tokenmill --no-quantized-weights,
# tokenmill --amx-from-rows 0 (no-tiles), tokenmill --no-amx-attention, tokenmill without its C++ kernels
# (TOKENMILL_NO_KERNELS=1), tokenmill --no-sliding-window-kv (one-pool: a sliding-window model's every layer in one
# KV pool), llama-server;
# one server at a time, 2 threads each.
#   LLAMA_SERVER=path/to/llama-server [SERVERS="tokenmill fp32 llama-server"] \
#     bash scripts/serve_ab.sh [GGUF] [ROUNDS] [OUT]
# The server `before` is tokenmill from another checkout (BEFORE=its folder; run with PYTHON, default python), for
# a before/after of a change in one sitting.
# Each server: 8 warm-up requests, then baseline (4 x 128 tokens), burst 8, burst 32, burst 32 sampled at
# temperature 0.7 and top_p 0.9 (SAMPLED=0: not), and a prefill probe
# (4 prompts of 400 words, 2 tokens out), and with LONG=N (default 2531; 0: none) a long-prompt probe (2 prompts of
# N tokens, 128 tokens out, one at a time: the first token's time and the decode after it); JSON reports in OUT as
# SERVER-rROUND-WORKLOAD.json, memory in OUT/rss.txt. `tokenmill bench --compare A.json B.json` compares two of them,
# `python scripts/serve_ab_table.py OUT` gives the medians of every server and figure.
set -u
GGUF=$(realpath "${1:-$HOME/.cache/tokenmill/SmolLM2-135M-Instruct.Q4_1.gguf}")
ROUNDS=${2:-3}
OUT=${3:-results}
LS=${LLAMA_SERVER:-llama-server}  # a llama-server binary (docs/performance/bench.md builds one)
LONG=${LONG:-2531}
TM=${TOKENMILL:-tokenmill}
SERVERS=${SERVERS:-tokenmill dequantized no-kernels llama-server}  # any of start()'s names, in each round's order
PORT=8123
mkdir -p "$OUT"
# llama-server's -kvu: its slots share one KV pool (without it each slot gets c / np = 2,048 tokens and refuses the
# long prompt). Each server is exec'd by the background subshell, so $! is the server itself (what kill and rss() need).
start() {
  case $1 in
    tokenmill) exec $TM serve "$GGUF" --port $PORT --threads 2 ;;
    before) cd / && PYTHONPATH=${BEFORE:?set BEFORE to a checkout} exec "${PYTHON:-python}" -m tokenmill serve "$GGUF" \
      --port $PORT --threads 2 ;;  # from /: python -m puts the working folder first on the path
    fp32) exec $TM serve "$GGUF" --port $PORT --threads 2 --dtype float32 ;;
    dequantized) exec $TM serve "$GGUF" --port $PORT --threads 2 --no-quantized-weights ;;
    no-tiles) exec $TM serve "$GGUF" --port $PORT --threads 2 --amx-from-rows 0 ;;
    no-amx-attention) exec $TM serve "$GGUF" --port $PORT --threads 2 --no-amx-attention ;;
    no-kernels) TOKENMILL_NO_KERNELS=1 exec $TM serve "$GGUF" --port $PORT --threads 2 ;;
    one-pool) exec $TM serve "$GGUF" --port $PORT --threads 2 --no-sliding-window-kv ;;
    llama-server) exec $LS -m "$GGUF" -t 2 -np 32 -c 65536 -kvu --host 127.0.0.1 --port $PORT ;;
    tokenmill-hf) exec $TM serve "${HF:?set HF to a bf16 Hugging Face folder}" --port $PORT --threads 2 ;;
    vllm) exec bash "${VLLM_SH:-$(dirname "$0")/../../shared/peers/vllm-cpu.sh}" serve "${HF:?set HF}" $PORT ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac > "$OUT/$1.log" 2>&1 &
  echo $!
}
rss() { grep -E "VmRSS|VmHWM" "/proc/$1/status" | awk '{printf "%s %d MiB ", $1, $2 / 1024}'; }
for r in $(seq "$ROUNDS"); do
  for s in $SERVERS; do
    pid=$(start "$s")
    for _ in $(seq 300); do curl -sf 127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    B="$TM bench --url http://127.0.0.1:$PORT/v1 --output-len 128 --ignore-eos"
    $B --workload burst --num-requests 8 --seed $((100 + r)) --warmup 0 > /dev/null
    echo "round $r $s start: $(rss "$pid")" >> "$OUT/rss.txt"
    $B --workload baseline --num-requests 4 --seed $((10 + r)) --json "$OUT/$s-r$r-baseline.json" > /dev/null
    $B --workload burst --num-requests 8 --concurrency 8 --seed $((20 + r)) --json "$OUT/$s-r$r-burst8.json" > /dev/null
    $B --workload burst --num-requests 32 --concurrency 32 --seed $((30 + r)) --json "$OUT/$s-r$r-burst32.json" \
      > /dev/null
    echo "round $r $s after burst32: $(rss "$pid")" >> "$OUT/rss.txt"
    if [ "${SAMPLED:-1}" = 1 ]; then  # the same burst sampled as chat clients do: temperature 0.7, top_p 0.9
      $B --workload burst --num-requests 32 --concurrency 32 --temperature 0.7 --top-p 0.9 --seed $((60 + r)) \
        --json "$OUT/$s-r$r-sampled32.json" > /dev/null
    fi
    $TM bench --url http://127.0.0.1:$PORT/v1 --workload baseline --num-requests 4 --prompt-len 400 --output-len 2 \
      --ignore-eos --seed $((40 + r)) --json "$OUT/$s-r$r-prefill.json" > /dev/null
    if [ "$LONG" -gt 0 ]; then
      $TM bench --url http://127.0.0.1:$PORT/v1 --workload baseline --num-requests 2 --prompt-len "$LONG" \
        --output-len 128 --ignore-eos --seed $((50 + r)) --json "$OUT/$s-r$r-long.json" > /dev/null
    fi
    pkill -P "$pid" 2> /dev/null; kill "$pid"; wait "$pid" 2> /dev/null; sleep 2  # vLLM's workers are children
  done
done

#!/usr/bin/env bash
# Speculative decoding side by side over HTTP, in interleaved rounds: tokenmill serving TARGET plain (plain), with
# DRAFT as its draft model (draft; draft6: 6 tokens a guess), with prompt lookup (ngram), with the suffix cache
# (suffix), plain-fp32 and ngram-fp32 in fp32, plain-bf16 and ngram-bf16 in bf16 (where `--dtype auto` is fp32:
# AVX2-only CPUs); one server at a time, 2 threads each.
#   [TOKENMILL=tokenmill] [SERVERS="plain draft"] bash scripts/spec_ab.sh TARGET DRAFT [ROUNDS] [OUT]
# Each server: baseline (one stream, 4 x 128 tokens), rewrite (one stream, 4 answers of 300 tokens that copy a
# 200-token prompt), repeated (one stream, 2 prompts sent 4 times each in turn, 128 tokens), burst 32 (32 x 128 at
# once); JSON reports in OUT as SERVER-rROUND-WORKLOAD.json, the
# speculative counters after them in SERVER-rROUND-spec.txt, memory at start in OUT/rss.txt.
set -u
TARGET=${1:?the model to serve}
DRAFT=${2:?its draft model}
ROUNDS=${3:-3}
OUT=${4:-results}
TM=${TOKENMILL:-tokenmill}
SERVERS=${SERVERS:-plain draft}
PORT=8124
mkdir -p "$OUT"
start() {
  case $1 in
    plain) exec $TM serve "$TARGET" --port $PORT --threads 2 ;;
    draft) exec $TM serve "$TARGET" --port $PORT --threads 2 --speculative draft --draft-model "$DRAFT" ;;
    draft6) exec $TM serve "$TARGET" --port $PORT --threads 2 --speculative draft --draft-model "$DRAFT" \
      --num-speculative-tokens 6 ;;
    ngram) exec $TM serve "$TARGET" --port $PORT --threads 2 --speculative ngram ;;
    plain-fp32) exec $TM serve "$TARGET" --port $PORT --threads 2 --dtype float32 ;;
    ngram-fp32) exec $TM serve "$TARGET" --port $PORT --threads 2 --dtype float32 --speculative ngram ;;
    plain-bf16) exec $TM serve "$TARGET" --port $PORT --threads 2 --dtype bfloat16 ;;
    ngram-bf16) exec $TM serve "$TARGET" --port $PORT --threads 2 --dtype bfloat16 --speculative ngram ;;
    suffix) exec $TM serve "$TARGET" --port $PORT --threads 2 --speculative suffix ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac > "$OUT/$1.log" 2>&1 &
  echo $!
}
for r in $(seq "$ROUNDS"); do
  for s in $SERVERS; do
    pid=$(start "$s")
    for _ in $(seq 180); do curl -sf 127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    B="$TM bench --url http://127.0.0.1:$PORT/v1"
    $B --workload baseline --num-requests 2 --output-len 32 --warmup 0 --seed 99 > /dev/null
    echo "round $r $s start: $(grep VmRSS "/proc/$pid/status")" >> "$OUT/rss.txt"
    $B --workload baseline --num-requests 4 --output-len 128 --ignore-eos --seed $((10 + r)) \
      --json "$OUT/$s-r$r-baseline.json" > /dev/null
    $B --workload rewrite --prompt-len 200 --output-len 300 --num-requests 4 --concurrency 1 --seed $((20 + r)) \
      --json "$OUT/$s-r$r-rewrite.json" > /dev/null
    $B --workload repeated --output-len 128 --num-requests 8 --concurrency 1 --seed $((40 + r)) \
      --json "$OUT/$s-r$r-repeated.json" > /dev/null
    $B --workload burst --num-requests 32 --concurrency 32 --output-len 128 --ignore-eos --seed $((30 + r)) \
      --json "$OUT/$s-r$r-burst32.json" > /dev/null
    curl -s 127.0.0.1:$PORT/metrics | grep -E "^tokenmill:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" \
      > "$OUT/$s-r$r-spec.txt"
    kill "$pid"; wait "$pid" 2> /dev/null; sleep 2
  done
done

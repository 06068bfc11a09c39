#!/usr/bin/env bash
# Serving speed of two checkouts, A and B, interleaved in one run (A, B, A, B, ...):
# `pdserve serve` (1 prefill + 1 decode, embedded model, local launcher) of each, then
# `pdserve bench serve` of B's checkout against it: single-stream ITL (8 prompts of
# 256/128 tokens, concurrency 1) and 32-concurrent throughput (64 prompts). Each
# checkout needs its own .venv (make install).
#   OLD=/path/to/a NEW=/path/to/b OUT=/tmp/ab ROUNDS=2 bash experiments/serving_speed_ab.sh
set -u
export RAY_USAGE_STATS_ENABLED=0 UCX_WARN_UNUSED_ENV_VARS=n
OLD=${OLD:?checkout A}
NEW=${NEW:?checkout B}
OUT=${OUT:-/tmp/serving-speed-ab}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
serve_and_bench() {  # name tree
  local name=$1 tree=$2 port=$3 round=$4
  cd "$tree"
  .venv/bin/pdserve serve --port "$port" --launcher local --threads-per-instance 1 > "$OUT/$name-$round-serve.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  "$NEW/.venv/bin/pdserve" bench serve --base-url "http://127.0.0.1:$port" --dataset-name random \
     --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 8 --max-concurrency 1 \
     --num-warmups 1 --seed $round --disable-tqdm --save-result --result-filename "$OUT/$name-$round-single.json" > "$OUT/$name-$round-single.log" 2>&1
  "$NEW/.venv/bin/pdserve" bench serve --base-url "http://127.0.0.1:$port" --dataset-name random \
     --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 64 --max-concurrency 32 \
     --num-warmups 2 --seed $round --disable-tqdm --save-result --result-filename "$OUT/$name-$round-c32.json" > "$OUT/$name-$round-c32.log" 2>&1
  kill -INT $pid; wait $pid
}
for round in $(seq 1 $ROUNDS); do
  serve_and_bench old "$OLD" 8101 $round
  serve_and_bench new "$NEW" 8102 $round
done
OUT="$OUT" python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
for kind, key in (("single", "median_itl_ms"), ("single", "mean_itl_ms"), ("c32", "output_throughput"), ("c32", "median_itl_ms")):
    vals = {}
    for name in ("old", "new"):
        vals[name] = [json.load(open(f))[key] for f in sorted(glob.glob(f"{out}/{name}-*-{kind}.json"))]
    med = {n: statistics.median(v) for n, v in vals.items()}
    print(f"{kind:6} {key:18} old {vals['old']} new {vals['new']} median new/old {med['new']/med['old']:.3f}")
PY

#!/usr/bin/env bash
# This session's GPU measurements in one call (the device is hard to get): 3-bit-key decode attention, the
# end-to-end step with oskvp_k3v2 now on the kernel, float16 on the random head-dim-128 model, the sampling paths.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=.
run() {  # name timeout_s command...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date -u +%T))" | tee -a "$OUT/driver.log"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? ($(date -u +%T))" | tee -a "$OUT/driver.log"
  tail -n 40 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/driver.log"
run key_bits3 240 python3 benchmarks/oskvp_key_bits3_decode.py --out="$OUT" --xla_max_gb=8
run e2e 150 python3 benchmarks/e2e_decode.py --cases=int4+oskvp:32768:32,int4+oskvp_k3v2:32768:32 --steps=8 \
  --full_depth_check=false --time_budget_s=120 --out="$OUT/e2e"
cp "$OUT"/e2e/*.md "$OUT"/e2e/*.json "$OUT"/ 2>/dev/null
run float16 90 python3 benchmarks/float16_decode_check.py --models=random --modes=oskvp,oskvp_k3v2 --out="$OUT/f16.json"
run sampling 60 python3 benchmarks/sampling_cost.py --out="$OUT" --batches=1,128

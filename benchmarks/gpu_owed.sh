#!/usr/bin/env bash
# The GPU measurements still owed, in one device call (starts are scarce; the machine releases after 30 s idle):
#   OUT=... bash benchmarks/gpu_owed.sh
# 1. oskvp_k3v2_sym's attention (four key plane types) beside oskvp_k3v2, oskvp, oskvp_sym and cuDNN;
# 2. the end-to-end step with oskvp_k3v2_sym beside oskvp and oskvp_k3v2;
# 3. float16 on the random head-dim-128 model with the 3-bit-key modes (the kernel's float16 path).
# Each step logs to $OUT/<name>.log; the bench writes its report after every row, so a step cut by its limit keeps
# what it measured. Filter allocator warnings out of what you read back: they can bury the tail.
# Used first on 2026-12-06 (then with the oskvp_k3v2 rows; results/*_h200_s36*).
# Run again on 2026-12-06 on an H100 in three calls (results/*_h100_s37*): step 1's 16k rows were cut by its limit,
# step 2 needs ~230 s for three cases (each first step compiles 25-55 s). The H200 rows of oskvp_k3v2_sym are owed.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=.
run() {  # name timeout_s command...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date -u +%T))" | tee -a "$OUT/driver.log"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? ($(date -u +%T))" | tee -a "$OUT/driver.log"
  grep -v -E "^[WI][0-9]{4} |Warning|warn\(" "$OUT/$name.log" | tail -n 30
}
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/driver.log"
run key_bits3 270 python3 benchmarks/oskvp_key_bits3_decode.py --out="$OUT" --contexts=65536,16384 --batches=8,32 \
  --xla_max_gb=0
CASES=int4+oskvp:32768:32,int4+oskvp_k3v2:32768:32,int4+oskvp_k3v2_sym:32768:32
run e2e 240 python3 benchmarks/e2e_decode.py --cases=$CASES --steps=8 --full_depth_check=false --time_budget_s=200 \
  --out="$OUT/e2e"
cp "$OUT"/e2e/*.md "$OUT"/e2e/*.json "$OUT"/ 2>/dev/null
run float16 150 python3 benchmarks/float16_decode_check.py --models=random --modes=oskvp_k3v2,oskvp_k3v2_sym \
  --out="$OUT/f16.json"

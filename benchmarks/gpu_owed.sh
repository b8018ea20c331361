#!/usr/bin/env bash
# The GPU measurements still owed, in a few device calls (starts are scarce; the machine releases after 30 s idle):
#   OUT=... bash benchmarks/gpu_owed.sh
# Owed after the thirty-eighth session (2026-12-06; the thirty-seventh and thirty-eighth ran this list on H100s:
# results/*_h100_s37*, *_h100_s38*; item 1 is paid on the H100, keep it for an H200)
# 1. the float16 check with --trace_routing on the random head-dim-128 model: are the GPU's single-step jumps
#    (0.23-0.28) routing flips, as every CPU jump was? Yes on the H100
#    (results/float16_decode_check_routing_trace_h100_s38.md);
# 2. the batched refit on the H200 (rule and chunk 1, B = 8 and 32) and its parts (the shared eigh at prefill);
# 3. oskvp_k3v2_sym's attention on the H200 beside oskvp_k3v2, oskvp and cuDNN (64k only: 16k was cut on the H100).
# 4. the refit across 48 layers (results/oskvp_refit_across_layers_*_h100_s38.md): the per-layer 3-row case (cut
#    on the H100) and B = 32; and where a 48-row fit's time goes besides eigh (19.8 ms, eigh 6.0: --batch=48 parts).
#    The last is paid on an H100 (results/oskvp_refit_parts_b48_kernels_onehot_h100_s39.md: the Lloyd scans, now a
#    Pallas kernel; with it the 48-row fit takes 9.1 ms, ..._b48_kernels_pallas_h100_s39.md), and B = 32 across
#    layers with the kernel too (..._across_layers_b32_pallas_h100_s39.md; the per-layer rows not re-run); these
#    steps are kept to re-time them on an H200.
# 5. (forty-first session) the warp-level OS-KVP core, now the wired path's default, has run on H100s only
#    (results/*_mma_h100_s41*): its checks and timing beside the wgmma core (mma_core), the wired path with both
#    cores against cuDNN (attention, now with --mosaic_core=wgmma,mma), and the 12-step model decode check through it
#    (decode_check). First thing on an H200: STEPS="mma_core decode_check", then STEPS="decode_check_wgmma
#    attention" (their limits sum to 500 and 570 s).
# 6. (forty-second session) mma_core and decode_check ran again on H100s after the masked value planes and the
#    epilogue's live rows (results/*_h100_s42*); all still owed on an H200. decode_check now runs the op sweep
#    first; decode_check_wgmma runs the same 12 steps through the wgmma core: the control for the mma core's
#    elevated steps 8-11 (1.1e-2 against <= 3.8e-3 in every wgmma run), which the H100 call could not fit.
# 7. (forty-third session) q U_k inside the Pallas prologue (`query_rotation="prologue"`, one XLA kernel fewer) has
#    not run on a GPU: qrot checks both forms and times them side by side with the mma core and cuDNN at 64k / 4k /
#    16k x 8 / 1 (the first 4k / 16k / batch-1 cells of the mma core too). The eleventh session's form took ~130 us
#    a call (notes_mgpu_oskvp.md §15; its one-hot dot spilled, this one does not, §26). If the prologue form is
#    faster, make it uniform_decode_attention's default; if it is slow again, dump and read its SASS. A failed check
#    of either form stops the step before any timing (decode_attention.py's rule): then rerun with
#    --mosaic_query_rotation=xla for the baseline cells.
# 8. (forty-fifth session) an H100 came again and ran qrot, mma_core, decode_check, decode_check_wgmma, attention,
#    experts, max_splits=8 at 64k / 128k x 8 and a timeline at 64k x 8 (results/*_h100_s45*, notes_mgpu_oskvp.md §27):
#    the rotating prologue is 0.7-4.0% slower by span in every cell (the default stays "xla"; no SASS reading needed: it is not the old
#    form's slowdown); steps 8-11 of the model check are the same through both cores (not the mma core's; likely the
#    120-token row's first flush with its refit: STEPS=decode_check_norefit, on any card, tests that; it was
#    tried at the end of the forty-fifth session and no machine came). Everything
#    above is still owed on an H200; first there: STEPS="mma_core decode_check", then STEPS="attention", then
#    STEPS=experts.
# 9. (forty-sixth session) U_vᵀ inside the epilogue (`output_rotation="epilogue"`, `rotating_epilogue`: one program
#    per row and kv head merges all 128 channels and rotates them; the XLA matmul and its fused cast go) has not run
#    on a GPU: orot checks it and times it beside the XLA rotation at 64k / 128k x 8 / 32, each with max_splits auto
#    and 8 (mma core, cuDNN in the same call); timeline_orot shows its kernel beside the old epilogue + matmul at
#    64k x 8; epilogue_bench times the two tails alone (and the rotating one at 8 warps) by CUPTI; orot_short the
#    short contexts. If it is faster by span, make it the default.
#    Paid on an H100 in the forty-sixth session (results/*_h100_s46*, notes §28): slower by span at batch 8 (+7.9% at
#    64k, +4.2% at 128k; its kernel 24 us in the chain against 8.9 + 3.9), 0.1-1.2% faster at batch 32 at equal splits; not the default.
#    decode_check_norefit paid there too (steps 8-11 <= 2.6e-3 without the refit, 1.15e-2 with it: the refit's).
#    orot_short and epilogue_bench at the real batch-32 splits paid on a second H100 start (slower at every short
#    context; alone 1.14-1.35x faster at batch 32). Kept for an H200: orot, epilogue_bench.
# 10. (forty-seventh session) splits: the mma core's splits rule (`wired_tiling`: the fewest splits that put 512
#    programs in flight, 8 at batch 8, 2 at batch 32) against the old base of 16, 4k-128k x 8 / 32, cuDNN beside.
#    Chosen from five H100 calls that timed 128 / 64 / 32 / 16 / 8 / 4 / 2 splits (results/decode_attention_splits*_h100_s47.md;
#    batch 1 takes 32, the raise's cap). Paid on an H100 (results/decode_attention_splits_h100_s47.md, notes §29);
#    kept for an H200. The rule runs 2 and 1 splits at batch 32 and 64, which no GPU check has covered (timed only,
#    and finite in the e2e step): decode_attention.py's checks now include batch 32 and 64 cases and run first in
#    every step that calls it, on any card.
# 11. (forty-seventh session) e2e_uniform: the decode step with the oskvp_uniform cache (the Mosaic GPU core) beside
#    oskvp (the Triton kernel) at 32k x 128 / 312 and 4k x 312, bf16 at 32k x 312; paid on an H100 without the bf16
#    row (84 GB; results/e2e_decode_uniform_h100_s47{,b}.md); on an H200 it fits.
# 12. (forty-eighth session) wide_epilogue: the Pallas epilogue's programs of 32, 64 and 128 output channels
#    (`epilogue_channels`: a program scores the residual window once for all its channels) and the rule chosen from
#    them on an H100 (the widest that leave 256 programs in flight: 32 at batch 8, 64 at 16, 128 from 32;
#    results/decode_attention_wide_epilogue_*_h100_s48.md, notes §30), alone (CUPTI, the bench's cases) and in the
#    wired path at 4k-64k x 8 / 32, cuDNN beside. Paid on an H100; kept for an H200.
# 13. (forty-eighth session) layout_probe: the core's TMA ring alone with the value codes and outliers in the cache's
#    token-contiguous layout ([H/4, S]: 40 rows of 128 bytes a block, S bytes apart) against a block-major one (a
#    block's rows contiguous), same bytes (`oskvp_stream_layout_probe.py`). If block-major streams faster, a
#    block-major value cache could take the core closer to the read-only bandwidth. Paid on an H100 in the
#    forty-ninth session (results/oskvp_stream_layout_h100_s49.md: block-major 2.4-3.0% less time in all six cases).
# 14. (forty-ninth session) value_layout: the cache now stores uniform values block-major (`OSKVPMode.
#    block_major_values`, `pallas_kernels/oskvp_value_layout.py`); the wired path with the mma core, block-major
#    against tokens contiguous, 4k-128k x 8 / 32, cuDNN beside (both layouts checked first). Then decode_check
#    (the 12-step model check now decodes a block-major cache) and e2e_uniform (the step's cache is block-major).
#    All three paid on H100s in the forty-ninth session (results/*_h100_s49*, notes §31: block-major 0.3-4.0% faster
#    by span, 64k x 8 at 4.89-5.01x cuDNN over three calls); value_layout again on an H100 in the fiftieth
#    (results/decode_attention_value_layout_h100_s50.md: 64k x 8 4.90x, block-major 2.4% less time); kept for an H200.
# 15. (fiftieth session) the first call on an H200, in one device call (the bf16 row of 32k x 312, 84 GB, needs the
#    H200's memory, so the call may ask for one): the issue's cells (64k / 128k x 8 / 32) with the mma core, both value
#    layouts and cuDNN, then the e2e step's three 32k x 312 rows: STEPS="h200_attention h200_e2e" (limits 480 s).
# 16. (fifty-second session) kernel_checks: Triton / Mosaic paths changed on the CPU only (the OS-KVP bit-plane value
#    outliers past plane 0 and a row with no visible token; int4 with AWQ scales and a float16 lhs; negative group
#    sizes / sizes past M), each against its reference (benchmarks/kernel_checks.py, < 2 min, any card). Paid on an
#    H100 in the fifty-second session (results/kernel_checks_h100_s52.md: 24 / 24) before the Mosaic grouped
#    matmuls' group-size cut (item 4 of the script); rerun for it, and after any Triton / Mosaic change.
# Each step logs to $OUT/<name>.log; benches write their reports as they go, so a step cut by its limit keeps what
# it measured. Filter allocator warnings out of what you read back: they can bury the tail. The limits sum to ~114 min.
# The steps sum to more than one call's 600 s: pass a subset, e.g. STEPS=prefill_fit, STEPS=attention,
# STEPS=experts (one call each, the fortieth session's), STEPS="float16_trace refit refit_b32", then
# STEPS="refit_parts key_bits3", then STEPS="across48 across48_b32 parts48" (default: all; unknown names refused).
set -u
OUT=${OUT:-/tmp/out}
ALL="h200_attention h200_e2e kernel_checks value_layout splits wide_epilogue layout_probe e2e_uniform orot timeline_orot epilogue_bench decode_check_norefit orot_short qrot mma_core decode_check decode_check_wgmma prefill_fit attention experts float16_trace refit refit_b32 refit_parts key_bits3 across48 across48_b32 parts48"
STEPS=${STEPS:-$ALL}
for s in $STEPS; do [[ " $ALL " == *" $s "* ]] || { echo "unknown step $s (steps: $ALL)" >&2; exit 2; }; done
export PYTHONPATH=.
run() {  # name timeout_s command...
  local name=$1 t=$2; shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  echo "=== $name ($(date -u +%T))" | tee -a "$OUT/driver.log"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? ($(date -u +%T))" | tee -a "$OUT/driver.log"
  grep -v -E "^[WI][0-9]{4} |Warning|warn\(" "$OUT/$name.log" | tail -n 30
}
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/driver.log"
# Added in the fortieth session: the batched prefill fits (new), and the two open issues' headline cells at the
# current code (#5: the wired Mosaic GPU path against cuDNN at 64k / 128k; #6: the WS int4 and vq2 kernels against
# both bf16 peers and the WS kernel's fused SwiGLU, the issue's grid), last timed on an H200 in the twenty-fourth session.
# prefill_fit, attention and (three row counts of) experts ran on an H100 in the fortieth (results/*_h100_s40.md,
# e.g. decode_attention_mosaic_h100_s40.md); kept for an H200.
run h200_attention 230 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span \
  --contexts=65536,131072 --batches=8,32 --mosaic_core=mma --mosaic_value_layout=blocks,tokens \
  --out="$OUT/h200_attention"
run kernel_checks 150 python3 benchmarks/kernel_checks.py --out="$OUT/kernel_checks"
run h200_e2e 250 python3 benchmarks/e2e_decode.py --steps=8 --full_depth_check=false --time_budget_s=170 \
  --cases=bf16+bf16:32768:312,int4+oskvp_uniform:32768:312,int4+oskvp:32768:312 --out="$OUT/h200_e2e"
run value_layout 420 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span \
  --contexts=4096,16384,65536,131072 --batches=8,32 --mosaic_core=mma --mosaic_value_layout=blocks,tokens \
  --out="$OUT/value_layout"
run splits 400 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span \
  --contexts=4096,16384,65536,131072 --batches=8,32 --mosaic_core=mma --mosaic_max_splits=auto,16 --out="$OUT/splits"
run wide_epilogue 560 bash -c 'python3 benchmarks/oskvp_epilogue_bench.py --out="$0/epi" \
  --forms=epilogue_c32+xla_rotation,epilogue_c64+xla_rotation,epilogue_c128+xla_rotation && python3 \
  benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span --contexts=4096,16384,65536 --batches=8,32 \
  --mosaic_core=mma --mosaic_epilogue_channels=32,64,128 --out="$0/wide_epilogue"' "$OUT"
run layout_probe 300 python3 benchmarks/oskvp_stream_layout_probe.py --out="$OUT/layout_probe"
run e2e_uniform 560 python3 benchmarks/e2e_decode.py --steps=8 --full_depth_check=false --time_budget_s=500 \
  --cases=int4+oskvp_uniform:32768:312,int4+oskvp:32768:312,bf16+bf16:32768:312,int4+oskvp_uniform:32768:128\
,int4+oskvp:32768:128,int4+oskvp_uniform:4096:312,int4+oskvp:4096:312 \
  --out="$OUT/e2e_uniform"
run orot 330 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span --contexts=65536,131072 \
  --batches=8,32 --mosaic_core=mma --mosaic_output_rotation=xla,epilogue --mosaic_max_splits=auto,8 --out="$OUT/orot"
run timeline_orot 150 python3 benchmarks/decode_timeline.py --cases=8x65536 --out="$OUT/timeline_orot" \
  --impls=oskvp_mosaic_uniform_mma,oskvp_mosaic_uniform_mma_orot_epilogue,cudnn_bf16
run epilogue_bench 120 python3 benchmarks/oskvp_epilogue_bench.py --out="$OUT/epilogue"
run orot_short 250 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span --contexts=4096,16384 \
  --batches=1,8 --mosaic_core=mma --mosaic_output_rotation=xla,epilogue --out="$OUT/orot_short"
run qrot 380 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span --contexts=65536,4096,16384 \
  --batches=8,1 --mosaic_core=mma --mosaic_query_rotation=xla,prologue --out="$OUT/qrot"
run mma_core 300 python3 benchmarks/oskvp_decode_core_mma_bench.py --out="$OUT/mma_core"
run decode_check 200 python3 benchmarks/oskvp_uniform_decode_check.py --op_sweep=16
run decode_check_wgmma 150 python3 benchmarks/oskvp_uniform_decode_check.py --core=wgmma
run decode_check_norefit 150 python3 benchmarks/oskvp_uniform_decode_check.py --refit_at_first_flush=0
run prefill_fit 500 python3 -m benchmarks.oskvp_prefill_fit --out="$OUT" --layers=48 --batches=1,8 --chunks=16,48 \
  --xla_chunks=16
run attention 420 python3 benchmarks/decode_attention.py --mosaic_grid --mosaic_only --span --contexts=65536,131072 \
  --batches=8,32 --mosaic_core=wgmma,mma --out="$OUT/attention"
run experts 420 python3 benchmarks/expert_matmul.py --formats=int4_mgpu_ws,vq2_mgpu_ws --out="$OUT/experts"
run float16_trace 170 python3 benchmarks/float16_decode_check.py --models=random --trace_routing \
  --modes=oskvp,oskvp_k3v2_sym,fp32 --out="$OUT/f16trace"
[[ -d "$OUT/f16trace" ]] && cp "$OUT"/f16trace/*.json "$OUT"/float16_decode_check_routing_trace.json
run refit 150 python3 -m benchmarks.oskvp_refit_cost --out="$OUT" --refit_chunks=1,8
run refit_b32 110 python3 -m benchmarks.oskvp_refit_cost --out="$OUT" --batch=32 --refit_chunks=8 --repeats=10 \
  --name=oskvp_refit_cost_b32
run refit_parts 80 python3 -m benchmarks.oskvp_refit_parts --out="$OUT"
run key_bits3 150 python3 benchmarks/oskvp_key_bits3_decode.py --out="$OUT" --contexts=65536 --batches=8,32 \
  --xla_max_gb=0
run across48 200 python3 -m benchmarks.oskvp_refit_cost --out="$OUT" --layers=48 --across=0,1 --rows=3 --only=refit \
  --repeats=10 --name=oskvp_refit_across_layers_3rows
run across48_b32 300 python3 -m benchmarks.oskvp_refit_cost --out="$OUT" --layers=48 --batch=32 --across=1,0 \
  --rows=1,32 --only=refit --repeats=5 --name=oskvp_refit_across_layers_b32
run parts48 100 python3 -m benchmarks.oskvp_refit_parts --out="$OUT/b48" --batch=48 --kernels
# At most 8 files come back from a device call: everything goes back as one archive (tar xzf owed.tgz).
(cd "$OUT" && tar czf /tmp/owed.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/owed.tgz "$OUT"/owed.tgz)

"""The Mosaic GPU vq2 kernel (`vq2_grouped_matmul_mgpu_ws`) at decode shapes, next to its peers, in one run.

  PYTHONPATH=$PWD python3 benchmarks/vq2_mgpu_decode.py --check_only --out=$OUT   # values first (small shapes)
  PYTHONPATH=$PWD python3 benchmarks/vq2_mgpu_decode.py --out=$OUT                # then the timings

  PYTHONPATH=$PWD python3 benchmarks/vq2_mgpu_decode.py --vq2_only --tag=_split --out=$OUT --variants='{"": {},
      "_no_lookup": {"ablate": "no_lookup"}, "_no_decode": {"ablate": "no_decode"},
      "_no_compute": {"ablate": "no_compute"}}'                                      # where the time goes
  PYTHONPATH=$PWD python3 benchmarks/vq2_mgpu_decode.py --vq2_only --tag=_index --out=$OUT --variants='{"": {},
      "_shift": {"index_extract": "shift"}}'                    # the index byte by shift + and against prmt

`--check_only` compares the kernel (per-expert and per-layer codebooks, the CHECK_CONFIGS: C = 2 / 3 / 4, block_k
256 / 512, 32-row tiles, the shift-and-and index extraction) with float32 dequantization on the GPU over awkward
group sizes (empty experts, one row, all rows in one expert), with 3 to 46 trailing rows of no expert that must come
back zero, and writes `vq2_mgpu_check.json` in --out; a timing run reads that file (running the check first when it
is absent) and refuses to time after a failed check. `--variants` (JSON) replaces the timed variants, `--rows` the
row counts, `--vq2_only` skips the Triton vq2 and WS int4 rows. Timing, at <= 16 rows per expert with every expert
active (balanced routing by default): XLA `ragged_dot` bf16, jax's Mosaic `ragged_dot_mgpu` bf16, the Triton int4
and vq2 kernels, the warp-specialized int4 kernel (defaults) and the vq2 kernel (defaults, per-expert codebooks;
then per-layer; then its memory side alone, `ablate="no_compute"`); CUPTI kernel time with L2 flushed before every
call, median (`expert_matmul.kernel_timer`). Writes `vq2_mgpu{tag}.json` / `.md`. Bytes read per active expert: the stored
2-bit indices and bf16 scales plus the replicated codebook (32 KB).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import expert_matmul as em  # noqa: E402
from benchmarks import int4_mgpu_decode as base  # noqa: E402
from pallas_kernels import int4_grouped_matmul_mgpu_ws as mws  # noqa: E402
from pallas_kernels import vq2_grouped_matmul as v2  # noqa: E402
from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vm  # noqa: E402

SHAPES = [(8, 4096, 14336, [16, 64, 128]), (64, 4096, 2048, [64, 512, 1024]), (128, 2048, 768, [128, 1024, 2048])]
CHECK_CONFIGS = {"default": {}, "c2_k512": dict(num_compute_wgs=2, block_k=512),
                 "c3_k256": dict(num_compute_wgs=3, block_k=256), "c4_k256": dict(num_compute_wgs=4, block_k=256),
                 "c4_k512": dict(num_compute_wgs=4, block_k=512), "r32": dict(block_r=32),
                 "shift_index": dict(index_extract="shift")}


# The vq2 kernel's timed variants: row suffix -> options: the weight's codebook ("expert" / "layer"), then the
# kernel's own (ablate="no_compute": the memory side alone, not checked). --variants replaces them. (The results
# before the nineteenth session's clean-up also name a "k_order" and a "lookup", options since removed.)
VARIANTS = {"": {}, "_layer": dict(codebook="layer"), "_no_compute": dict(ablate="no_compute")}


def layer_codebook(w: v2.VQ2Weights) -> v2.VQ2Weights:
  return w._replace(codebook=w.codebook[:1])


def check(res: dict):
  e, k, n = 6, 512, 256
  for sizes in ([0, 1, 37, 0, 16, 5], [0, 0, 64, 0, 0, 0], [1, 2, 3, 4, 5, 6]):
    gs = jnp.array(sizes, jnp.int32)
    m = 67  # at least 3 rows past the groups (must come back zero); one M for all: one compile per config
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    w = em.random_vq2(jax.random.key(2), e, k, n)
    for book, wb in (("expert", w), ("layer", layer_codebook(w))):
      wm = vm.to_mgpu_layout(wb)
      want = np.asarray(vm.vq2_grouped_matmul_mgpu_ws_reference(x, wm, gs))
      for name, cfg in CHECK_CONFIGS.items():
        tag = f"{sizes}_{book}_{name}"
        try:
          got = np.asarray(vm.vq2_grouped_matmul_mgpu_ws(x, wm, gs, **cfg))
          tail = int(gs.sum())
          res[tag] = {**em.error_stats(got[:tail], want[:tail]), "tail_max": float(np.abs(got[tail:]).max())}
        except Exception as ex:  # noqa: BLE001
          res[tag] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
        print(tag, res[tag], flush=True)


def passed(res: dict) -> bool:
  return bool(res) and all(r.get("max_rel_err", 1.0) < 1e-4 and r.get("nan", 1) == 0 and r.get("tail_max", 1.0) == 0
                           for r in res.values())


def markdown(meta: dict, rows: list) -> str:
  cells = {}
  for r in rows:
    cells.setdefault((r["experts"], r["k"], r["n"], r["rows"]), {})[r["impl"]] = r
  variants = meta["variants"]
  lines = [f"# vq2 Mosaic GPU kernel at decode shapes ({meta['device']}, jax {meta['jax']}, {meta['date']})", "",
           f"Timing: {meta['timing']}, L2 flushed, median of {meta['iters']}; routing {meta['routing']}; copy "
           f"{meta['copy']['f32_sum_read_only']['TB_per_s']:.2f} TB/s (read-only sum, as expert_matmul.md). Cells: "
           "ms (× best bf16 peer, % of copy on the bytes read).", "",
           "| E, K→N | rows | best bf16 peer | Triton vq2 | WS int4 | " + " | ".join(
               "vq2 Mosaic, " + (", ".join(f"{a}={b}" for a, b in v.items()) or "defaults") for v in variants.values())
           + " |",
           "|---|---|---|---|---|" + "---|" * len(variants)]
  copy = meta["copy"]["f32_sum_read_only"]["TB_per_s"]
  for (e, k, n, m), v in cells.items():
    peer = em.best_peer_ms(v)

    def cell(name):
      if name not in v:
        return "–"
      r = v[name]
      return f"{r['ms']:.4f} ({peer / r['ms']:.2f}×, {100 * r['tb_per_s'] / copy:.0f}%)"
    lines.append(f"| {e}, {k}→{n} | {m} | {peer:.4f} | {cell('pallas_vq2')} | {cell('pallas_int4_mgpu_ws')} | " +
                 " | ".join(cell(f"pallas_vq2_mgpu_ws{name}") for name in variants) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--check_only", action="store_true")
  ap.add_argument("--check_configs", default="", help="comma-separated subset of CHECK_CONFIGS")
  ap.add_argument("--tag", default="")
  ap.add_argument("--n", type=int, default=0, help="only the shapes with this N")
  ap.add_argument("--routing", default="balanced", choices=em.ROUTINGS)
  ap.add_argument("--variants", default="", help="JSON {suffix: options} replacing VARIANTS")
  ap.add_argument("--rows", default="", help="comma-separated row counts instead of each shape's own")
  ap.add_argument("--vq2_only", action="store_true", help="skip the Triton vq2 and the WS int4 kernels")
  ap.add_argument("--md_from", default="", help="only write the markdown of a results JSON (e.g. a timed-out run's)")
  args = ap.parse_args(argv)
  if args.md_from:
    with open(args.md_from) as fh:
      res = json.load(fh)
    with open(args.md_from[:-len(".json")] + ".md", "w") as fh:
      fh.write(markdown(res, res["rows"]))
    return 0
  os.makedirs(args.out, exist_ok=True)
  check_path = os.path.join(args.out, "vq2_mgpu_check.json")
  if args.check_configs:
    keep = em.subset(ap, "check_configs", args.check_configs, CHECK_CONFIGS)
    for name in list(CHECK_CONFIGS):
      if name not in keep:
        del CHECK_CONFIGS[name]
  if args.check_only or not os.path.exists(check_path):  # a timing run without an earlier check runs it first
    res = {}
    check(res)
    with open(check_path, "w") as fh:
      json.dump(res, fh, indent=1)
    if args.check_only:
      return 0 if passed(res) else 1
  with open(check_path) as fh:
    if not passed(json.load(fh)):
      raise SystemExit(f"{check_path} holds a failed check: not timing")
  variants = json.loads(args.variants) if args.variants else VARIANTS
  timer, timing = em.kernel_timer()
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "timing": timing, "iters": args.iters,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "routing": args.routing, "variants": variants, "copy": em.copy_bandwidth(timer)}
  rows_out, t0 = [], time.perf_counter()
  add = base.row_recorder(rows_out, t0)
  vq2_fn = jax.jit(v2.vq2_grouped_matmul)
  ws_fn = jax.jit(mws.int4_grouped_matmul_mgpu_ws)
  fns = {suffix: jax.jit(functools.partial(vm.vq2_grouped_matmul_mgpu_ws, **{
      a: b for a, b in v.items() if a != "codebook"})) for suffix, v in variants.items()}
  shapes = [s for s in SHAPES if not args.n or s[2] == args.n]
  if args.rows:
    shapes = [(e, k, n, em.positive_ints(ap, "rows", args.rows)) for e, k, n, _ in shapes]
  for e, k, n, rows_list in shapes:
    key, w_bf16, w_nk, _ = base.decode_weights(e, k, n)
    w_ws = mws.to_mgpu_layout(em.random_int4(key, e, k, n))
    w_v = em.random_vq2(jax.random.fold_in(key, 7), e, k, n)
    w_vm = {"expert": vm.to_mgpu_layout(w_v), "layer": vm.to_mgpu_layout(layer_codebook(w_v))}
    runs = {suffix: (fns[suffix], w_vm[v.get("codebook", "expert")]) for suffix, v in variants.items()}
    for rows in rows_list:
      x, gs, n_active = base.time_peers(add, timer, key, e, k, n, rows, w_bf16, w_nk, args.iters,
                                        routing=args.routing)
      if not args.vq2_only:
        add("pallas_vq2", rows, e, k, n, timer(vq2_fn, x, w_v, gs, iters=args.iters), "vq2", n_active)
        add("pallas_int4_mgpu_ws", rows, e, k, n, timer(ws_fn, x, w_ws, gs, iters=args.iters), "int4_mgpu_ws",
            n_active)
      vb = n_active * em.weight_bytes("vq2_mgpu_ws", k, n) + rows * k * 2 + rows * n * 4  # 32 KB codebook each
      for suffix, (f, w) in runs.items():
        err = {}
        if variants[suffix].get("ablate") != "no_compute":  # each timed weight's values, against its float32 dequantization
          err = em.error_stats(np.asarray(f(x, w, gs)), np.asarray(vm.vq2_grouped_matmul_mgpu_ws_reference(x, w, gs)))
        b = vb - (n_active - 1) * 32 * 1024 if variants[suffix].get("codebook") == "layer" else vb  # one codebook
        ms = timer(f, x, w, gs, iters=args.iters)
        rows_out.append({"impl": f"pallas_vq2_mgpu_ws{suffix}", "rows": rows, "experts": e, "k": k, "n": n,
                         "ms": ms, "bytes_read": b, "tb_per_s": b / ms / 1e9, **err})
        print(json.dumps(rows_out[-1]), flush=True)
      with open(os.path.join(args.out, f"vq2_mgpu{args.tag}.json"), "w") as fh:
        json.dump({**meta, "rows": rows_out}, fh, indent=1)
    del w_bf16, w_nk, w_ws
  with open(os.path.join(args.out, f"vq2_mgpu{args.tag}.md"), "w") as fh:
    fh.write(markdown(meta, rows_out))
  return 0


if __name__ == "__main__":
  sys.exit(main())

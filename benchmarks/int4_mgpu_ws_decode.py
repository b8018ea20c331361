"""Warp-specialized Mosaic GPU int4 grouped matmul at decode shapes, next to its peers, in one run.

  PYTHONPATH=$PWD python3 benchmarks/int4_mgpu_ws_decode.py --check_only --out=$OUT   # values first (small)
  PYTHONPATH=$PWD python3 benchmarks/int4_mgpu_ws_decode.py --out=$OUT                # then the timings

`--check_only` compares every warp-specialized config (and the one-warpgroup Mosaic kernel) with the XLA reference
on the GPU over awkward group sizes and writes `int4_mgpu_ws_check.json`; the timing run reads it back (if present)
and times only the configs that passed, so that a config that is wrong or hangs costs one short process. Timing: at
<= 16 rows per expert with every expert active, XLA `ragged_dot` bf16, jax's Mosaic `ragged_dot_mgpu` bf16, the
Triton int4 kernel (uint16 layout, default tile), the one-warpgroup Mosaic int4 kernel (default tile) and the
warp-specialized kernel over a few configs; CUPTI kernel time with L2 flushed, median (as `expert_matmul.py`).
Writes `int4_mgpu_ws.json` / `.md` under --out.

`--dump=E,K,N,ROWS` compiles and runs the WS configs of --ws (and, without --ws, the one-warpgroup kernel) once at
that shape, for Mosaic GPU's dumps: run it with MOSAIC_GPU_DUMP_TO=<dir> (PTX, ptxas -v output, MLIR passes per
kernel; one process per config keeps one kernel per folder). `--analyze_dump=<dir>[,<dir>...]` then runs without a
GPU: it compiles each dumped PTX with ptxas for sm_90a, disassembles it with nvdisasm (Triton's, as in
`triton_sass.py`) and counts the SASS of the loops that hold a wgmma.

A config's `nibble_order` ("shift": `to_mgpu_layout(nibble_order="shift")`) picks the weight layout it is given;
`--default_c_only` times each config only at the N where its compute warpgroups are the kernel's default C.
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

from benchmarks import expert_matmul as em
from benchmarks import int4_mgpu_decode as base
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws
from pallas_kernels import ws_pipeline as wp

SHAPES = [(64, 4096, 2048, [64, 512, 1024]), (128, 2048, 768, [128, 2048]), (8, 4096, 14336, [16, 128])]
# Warp-specialized configs: compute warpgroups (N tile 64·C), block_k; ring depth automatic (largest of 8/6/4/3/2
# dividing the K steps within 200 KB of shared memory). 4 compute warpgroups hung in the first H200 run (setmaxnreg
# asked for more registers than the CTA was launched with); the kernel's `register_split` now fits them.
WS = {
    # The configs before the sixth session's dequant forms name dequant_form="sub_mul" (the kernel's default became
    # "acc_scale" then), so that their labels keep meaning the kernel they timed.
    "c2_k128": dict(num_compute_wgs=2, block_k=128, dequant_form="sub_mul"),
    "c2_k256": dict(num_compute_wgs=2, block_k=256, dequant_form="sub_mul"),
    "c2_k512": dict(num_compute_wgs=2, block_k=512, dequant_form="sub_mul"),
    # 3 compute warpgroups (12 compute warps per SM, 152 registers each): N tile 192; where 192 does not divide N
    # (2048, 14336) the last tile starts at N - 192 and overlaps the one before it (added in the fifth session).
    "c3_k256": dict(num_compute_wgs=3, block_k=256, dequant_form="sub_mul"),
    "c3_k512": dict(num_compute_wgs=3, block_k=512, dequant_form="sub_mul"),
    # overlap_steps (fifth session): a step's last wgmma runs into the next step's first decode (wgmma_wait(1),
    # manual release of the previous ring slot).
    "c2_k512_ov": dict(num_compute_wgs=2, block_k=512, overlap_steps=True),
    "c2_k256_ov": dict(num_compute_wgs=2, block_k=256, overlap_steps=True),
    "c3_k256_ov": dict(num_compute_wgs=3, block_k=256, overlap_steps=True),
    # Dequant forms (sixth session, `dequant_form`): one bf16x2 fma per weight pair with the zero point and scale folded
    # (magic bias 128 or 16; they change the bf16 weight, see DEQUANT_FORMS), or the scale on float32 accumulators
    # per K group (exact). Checked against their own references (`int4_grouped_matmul_mgpu_ws_form_reference`); the
    # distance to the bf16 reference is recorded as max_rel_err_bf16_ref.
    "c2_k512_fma128": dict(num_compute_wgs=2, block_k=512, dequant_form="fma128"),
    "c2_k512_fma16": dict(num_compute_wgs=2, block_k=512, dequant_form="fma16"),
    "c2_k512_acc": dict(num_compute_wgs=2, block_k=512, dequant_form="acc_scale"),
    "c3_k256_acc": dict(num_compute_wgs=3, block_k=256, dequant_form="acc_scale"),
    # The kernel's defaults (acc_scale; C = 3 where 192 divides N, else 2; block_k 256 / 512) on the K_ORDER weights
    # of `int4_grouped_matmul_mgpu.to_mgpu_layout`, as timed in the sixth session; "default_shift": on the WS
    # module's default layout (`int4_grouped_matmul_mgpu_ws.to_mgpu_layout`: the shift order since the seventh).
    "default": dict(),
    "default_shift": dict(nibble_order="shift"),
    # Thirteenth session: 8-row tiles at 16 rows per expert (two tiles per expert and N tile, the weight tile read
    # twice, the second time mostly from L2) against the default 16-row tiles (x window 24 rows).
    "default_shift_r8": dict(nibble_order="shift", block_r=8),
    "default_shift_r16": dict(nibble_order="shift", block_r=16),
    # Aligned row tiles: windows of W = R rows instead of R + 8.
    "default_shift_al": dict(nibble_order="shift", aligned_tiles=True),
    "default_shift_al_r8": dict(nibble_order="shift", aligned_tiles=True, block_r=8),
    "default_shift_al_r16": dict(nibble_order="shift", aligned_tiles=True, block_r=16),
    # C = 3 and 4 at 8 x 4096->14336 with aligned tiles (timed in the fourteenth session: int4_mgpu_ws_al_c34*.md;
    # C = 3 became the default there with 16-row tiles).
    "al_c3": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=3, block_k=256),
    "al_c4": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=4, block_k=256),
    # Wider aligned tiles for uneven routing (experts with 17-32 rows in one tile; int4_mgpu_ws_al_r2432_random.md).
    "al_r24": dict(nibble_order="shift", aligned_tiles=True, block_r=24),
    "al_r32": dict(nibble_order="shift", aligned_tiles=True, block_r=32),
    # Fourteenth session: C = 3 with 128-wide K steps (a ring of 8 fits, twice the steps per item) where the default
    # C = 3 / block_k 256 reached only 64-69% of copy bandwidth (128 x 2048->768, 8 x 4096->14336 x 128 rows).
    "al_c3_k128": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=3, block_k=128),
    # Fifteenth session: C = 3 with 512-wide K steps (a ring of 2: 3 does not divide 8 steps), so that each step's
    # last decode has 3 wgmmas before it to hide behind instead of 1.
    "al_c3_k512": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=3, block_k=512),
    # ... and the same with `wgmma_depth=2`: a wait for group c - 2's wgmma before group c's decode, so that only two
    # groups' decoded A operands are live (block_k 256's register use); and C = 2 with 1024-wide K steps that way.
    "al_c3_k512_d2": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=3, block_k=512, wgmma_depth=2),
    "al_c2_k1024_d2": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=2, block_k=1024, wgmma_depth=2),
    # C = 2 with aligned tiles (the default at 8 x 4096->14336 with 8-row tiles; with 16-row tiles it is now C = 3).
    "al_c2": dict(nibble_order="shift", aligned_tiles=True, num_compute_wgs=2, block_k=512),
    # Seventh session: the shift nibble order (K_ORDER_SHIFT: a shift and a lop3 per weight pair, no prmt) and the
    # zero point on the accumulator too (acc_zero: A = 128 + q, the lop3's output; x summed per K group by XLA).
    "c2_k512_acc_shift": dict(num_compute_wgs=2, block_k=512, dequant_form="acc_scale", nibble_order="shift"),
    "c2_k512_acczero": dict(num_compute_wgs=2, block_k=512, dequant_form="acc_zero"),
    "c2_k512_acczero_shift": dict(num_compute_wgs=2, block_k=512, dequant_form="acc_zero", nibble_order="shift"),
    "c3_k256_acc_shift": dict(num_compute_wgs=3, block_k=256, dequant_form="acc_scale", nibble_order="shift"),
    "c3_k256_acczero_shift": dict(num_compute_wgs=3, block_k=256, dequant_form="acc_zero", nibble_order="shift"),
    # Twelfth session: 4 compute warpgroups (16 compute warps per SM, N tile 256) with the register split that fits
    # the 640-thread launch (`register_split`: 4 x 112 + 32 = 5 x 96; jax's own split deadlocked).
    "c4_k128_acc_shift": dict(num_compute_wgs=4, block_k=128, dequant_form="acc_scale", nibble_order="shift"),
    "c4_k256_acc_shift": dict(num_compute_wgs=4, block_k=256, dequant_form="acc_scale", nibble_order="shift"),
    "c4_k512_acc_shift": dict(num_compute_wgs=4, block_k=512, dequant_form="acc_scale", nibble_order="shift"),
    # Not here any more: c2_k1024 (8 K groups per step; fifth call, with a 220 KB ring budget): ptxas serializes its
    # wgmmas (C7511), 1.2-1.8x slower than c2_k512.
}


SMOKE = {"interpret": False}  # --smoke: CPU interpret mode, tiny shapes (checks the script only)


def _kw():
  return {"interpret": True} if SMOKE["interpret"] else {}


def _split(cfg):
  """A WS config -> (the kernel's keyword arguments, the nibble order of the weights it takes)."""
  cfg = dict(cfg)
  return cfg, cfg.pop("nibble_order", "prmt")


def _in_order(wq, w_mg, order):
  """The Mosaic-layout weight in `order` (w_mg, the prmt order, is converted from the same int4 weight wq)."""
  return w_mg if order == "prmt" else mg.to_mgpu_layout(wq, nibble_order=order)


def rel_errs(got, want_bf16, x, w, gs, cfg):
  """max |got - want| / max |want| against the config's own reference ("max_rel_err": the dequant form's, which is
  the bf16 reference for the default form) and, for the other forms, against the bf16 reference too."""
  rel = lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
  form = cfg.get("dequant_form") or ("sub_mul" if cfg.get("overlap_steps") else "acc_scale")  # the kernel's default
  if form == "sub_mul":
    return {"max_rel_err": rel(got, want_bf16)}
  want = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(x, w, gs, form))
  return {"max_rel_err": rel(got, want), "max_rel_err_bf16_ref": rel(got, want_bf16)}


def check(res, names=None):
  e, k, n = 6, 1024, 640  # 640: C = 3's last N tile starts at 448 (overlapping the tile before it)
  if SMOKE["interpret"]:
    k, n = 256, 320
  # The third case draws x >= 0 (as after an activation): a large per-group sum, the worst case of acc_zero's
  # cancellation of 128 · xsum.
  cases = (([0, 1, 37, 0, 16, 5], False), ([16] * 6, False), ([3, 16, 0, 9, 1, 16], True))
  # One row count for every case (so that a config compiles once, not once per case); the rows past each case's
  # sum(group_sizes), at least 3, are owned by no expert and must come back zero.
  m = max(sum(sizes) for sizes, _ in cases) + 3
  for sizes, positive in cases:
    gs = jnp.array(sizes, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    x = jnp.abs(x) if positive else x
    wq = em.random_int4(jax.random.key(2), e, k, n)
    want = np.asarray(i4.int4_grouped_matmul_reference(x, wq, gs))
    w_prmt = mg.to_mgpu_layout(wq)
    for name, cfg in WS.items():
      if (names is not None and name not in names) or k % cfg.get("block_k", 128):
        continue
      cfg, order = _split(cfg)
      w = _in_order(wq, w_prmt, order)
      f = functools.partial(ws.int4_grouped_matmul_mgpu_ws, **cfg, **_kw())
      name, tag = f"ws_{name}", f"n{n}_{sizes}{'_pos' if positive else ''}_{name}"
      try:
        got = np.asarray(jax.jit(f)(x, w, gs))
        res[tag] = {"impl": name, **rel_errs(got, want, x, w, gs, cfg), "nan": int(np.isnan(got).sum()),
                    "tail_max": float(np.abs(got[sum(sizes):]).max())}
      except Exception as ex:  # noqa: BLE001
        res[tag] = {"impl": name, "error": f"{type(ex).__name__}: {str(ex)[:600]}"}
      print(tag, res[tag], flush=True)


def dump(e, k, n, rows, with_mgpu=True):
  """Compiles and runs the one-warpgroup kernel and each WS config once at one shape (for MOSAIC_GPU_DUMP_TO)."""
  key = jax.random.key(e + k + n)  # base.decode_weights' weights, without its bf16 and Triton copies
  wq = em.random_int4(key, e, k, n)
  w_mg = mg.to_mgpu_layout(wq)
  gs = jnp.asarray(em.balanced_groups(rows, e))
  x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
  want = np.asarray(mg.int4_grouped_matmul_mgpu_reference(x, w_mg, gs))
  fns = {"mgpu": (mg.int4_grouped_matmul_mgpu, "prmt")} if with_mgpu else {}
  fns.update({f"ws_{name}": (functools.partial(ws.int4_grouped_matmul_mgpu_ws, **_split(cfg)[0]), _split(cfg)[1])
              for name, cfg in WS.items() if not k % cfg.get("block_k", 128)})
  for name, (f, order) in fns.items():
    t = time.perf_counter()
    try:
      w = _in_order(wq, w_mg, order)
      got = np.asarray(jax.jit(f)(x, w, gs))
      cfg = WS.get(name[3:], {}) if name.startswith("ws_") else {"dequant_form": "sub_mul"}
      print(name, rel_errs(got, want, x, w, gs, cfg), f"{time.perf_counter() - t:.1f} s", flush=True)
    except Exception as ex:  # noqa: BLE001
      print(name, "fail", type(ex).__name__, str(ex)[:600], flush=True)
  return 0


SASS_KINDS = {"all": ".", "HGMMA": "HGMMA", "WARPGROUP": "WARPGROUP", "LDS": "LDS", "PRMT": "PRMT", "LOP3": "LOP3",
              "HFMA2/HADD2/HMUL2": "HFMA2|HADD2|HMUL2", "SHF/SHR": "SHF|SHR", "MOV": "MOV", "SYNCS/BAR": "SYNCS|BAR",
              "LDL/STL": "LDL|STL", "BRA": "BRA", "DEPBAR/WAIT": "DEPBAR|WARPSYNC|WAIT"}


def analyze_dump(path, ptxas="ptxas", nvdisasm=None):
  """Per dumped kernel: ptxas's report (registers, spills, warnings) and, for each loop that holds a wgmma, its SASS
  instructions by kind (`triton_sass.analyze_ptx_dump`; a compute warpgroup's thread handles 64 · block_k / 128
  weights per step)."""
  from benchmarks import triton_sass  # pylint: disable=g-import-not-at-top
  return triton_sass.analyze_ptx_dump(path, SASS_KINDS, ptxas=ptxas, nvdisasm=nvdisasm)


def default_c(cfg: dict, rows: int, e: int, n: int) -> int:
  """The C the kernel picks itself for `cfg` at this shape (`ws.default_compute_wgs` with the config's tiles)."""
  block_r = cfg.get("block_r") or ws.default_block_r(rows, e, cfg.get("aligned_tiles", True))
  num_ctas = 4 if SMOKE["interpret"] else wp.num_sms()
  return ws.default_compute_wgs(rows, e, n, block_r, num_ctas)


def passed(check_res, name):
  rs = [r for r in check_res.values() if r["impl"] == f"ws_{name}"]
  return bool(rs) and all("error" not in r and r["max_rel_err"] < 1e-3 and not r["nan"] and r["tail_max"] == 0
                          for r in rs)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None, help="folder of the result files (default benchmarks/results; with --smoke a "
                  "fresh temporary folder)")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--check_only", action="store_true")
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes: checks the script only")
  ap.add_argument("--ws", default="", help="comma-separated subset of the WS configs")
  ap.add_argument("--n", type=int, default=0, help="only the shapes with this N")
  ap.add_argument("--rows", default="", help="comma-separated row counts instead of each shape's own")
  ap.add_argument("--shape", default="", help="E,K,N: time this shape instead of SHAPES (with --rows)")
  ap.add_argument("--tag", default="", help="suffix of the output files")
  ap.add_argument("--routing", default="balanced", choices=em.ROUTINGS, help="group sizes of the timed calls")
  ap.add_argument("--seeds", default="0", help="random routing: comma-separated draws (`em.routed_groups`' seed); "
                  "more than one writes a result file per draw, tagged _s<seed>")
  ap.add_argument("--dump", default="", help="E,K,N,ROWS: compile and run once (with MOSAIC_GPU_DUMP_TO set)")
  ap.add_argument("--analyze_dump", default="", help="MOSAIC_GPU_DUMP_TO folders (comma-separated): ptxas report "
                  "and SASS loops")
  ap.add_argument("--ablate", default="", help="also time each WS config with these `ablate`s, comma-separated "
                  "(no_compute: the memory side alone; no_decode: without the int4 loads and decode; wrong results, "
                  "not checked)")
  ap.add_argument("--default_c_only", action="store_true",
                  help="time each WS config only where its num_compute_wgs is the kernel's default C for that N")
  args = ap.parse_args(argv)
  args.out = em.out_dir(args.out, args.smoke, "int4_mgpu_ws")
  if args.ws:
    keep = em.subset(ap, "ws", args.ws, WS)
    for name in list(WS):
      if name not in keep:
        del WS[name]
  if args.dump:
    return dump(*map(int, args.dump.split(",")), with_mgpu=not args.ws)
  if args.analyze_dump:
    print(json.dumps({p: analyze_dump(p) for p in args.analyze_dump.split(",")}, indent=1))
    return 0
  shapes = [s for s in SHAPES if not args.n or s[2] == args.n]
  if args.shape:
    shapes = [(*em.positive_ints(ap, "shape", args.shape, 3), [16])]  # --rows below replaces the row counts
  if args.rows:
    shapes = [(e, k, n, em.positive_ints(ap, "rows", args.rows)) for e, k, n, _ in shapes]
  seeds = em.positive_ints(ap, "seeds", args.seeds, minimum=0)
  if len(set(seeds)) != len(seeds):
    ap.error(f"--seeds={args.seeds!r} must be distinct")
  if seeds != [0] and args.routing != "random":
    ap.error("--seeds draws random routing: pass --routing=random")
  tags = {seed: args.tag + (f"_s{seed}" if len(seeds) > 1 else "") for seed in seeds}
  if args.smoke:
    SMOKE["interpret"], shapes = True, [(4, 512, 256, [8, 64])]
    em.INTERPRET["on"] = True  # shared helpers (the copy probe's array size) follow it
  os.makedirs(args.out, exist_ok=True)
  check_path = os.path.join(args.out, f"int4_mgpu_ws{args.tag}_check.json")
  if args.check_only:
    res = {}
    check(res)
    with open(check_path, "w") as fh:
      json.dump(res, fh, indent=1)
    return 0
  timer, timing = em.kernel_timer()
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "timing": timing,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "group_size": em.G,
          "routing": args.routing, "l2_flush": "256 MiB write before every timed call", "ws_configs": WS}
  meta["correctness"] = {}
  if os.path.exists(check_path) and not args.smoke:  # from a --check_only run; configs it lacks are checked here
    with open(check_path) as fh:
      meta["correctness"] = json.load(fh)
  have = {r["impl"] for r in meta["correctness"].values()}
  check(meta["correctness"], [name for name in WS if f"ws_{name}" not in have])
  todo = {name: cfg for name, cfg in WS.items() if passed(meta["correctness"], name)}
  print("timing ws configs that passed the check:", list(todo), flush=True)
  meta["copy"] = em.copy_bandwidth(timer)
  t0 = time.perf_counter()
  rows_by_seed = {seed: [] for seed in seeds}
  adds = {seed: base.row_recorder(rows_by_seed[seed], t0) for seed in seeds}

  def save():
    for seed in seeds:
      with open(os.path.join(args.out, f"int4_mgpu_ws{tags[seed]}.json"), "w") as fh:
        json.dump({**meta, "seed": seed, "rows": rows_by_seed[seed]}, fh, indent=1)

  for e, k, n, rows_list in shapes:
    key, w_bf16, w_nk, w_mg = base.decode_weights(e, k, n)
    w_by_order = {"prmt": w_mg}
    if any(_split(cfg)[1] == "shift" for cfg in todo.values()):
      w_by_order["shift"] = mg.to_mgpu_layout(em.random_int4(key, e, k, n), nibble_order="shift")  # the same weight
    for rows, seed in ((r, s) for r in rows_list for s in seeds):
      add = adds[seed]
      x, gs, n_active = base.time_peers(add, timer, key, e, k, n, rows, w_bf16, w_nk, args.iters,
                                        routing=args.routing, seed=seed, **_kw())
      f = jax.jit(functools.partial(mg.int4_grouped_matmul_mgpu, **_kw()))
      add("pallas_int4_mgpu", rows, e, k, n, timer(f, x, w_mg, gs, iters=args.iters), "int4_mgpu", n_active)
      want = None
      for name, cfg in todo.items():
        if k % cfg.get("block_k", 128):
          continue
        if args.default_c_only and cfg.get("num_compute_wgs", 0) not in (0, default_c(cfg, rows, e, n)):
          continue
        try:
          kw, order = _split(cfg)
          w = w_by_order[order]
          f = jax.jit(functools.partial(ws.int4_grouped_matmul_mgpu_ws, **kw, **_kw()))
          got = np.asarray(f(x, w, gs))
          if want is None:
            want = np.asarray(mg.int4_grouped_matmul_mgpu_reference(x, w_mg, gs))
          add(f"pallas_int4_mgpu_ws[{name}]", rows, e, k, n, timer(f, x, w, gs, iters=args.iters), "int4_mgpu",
              n_active, {"config": cfg, **rel_errs(got, want, x, w, gs, kw)})
          for ablate in filter(None, args.ablate.split(",")):
            fa = jax.jit(functools.partial(ws.int4_grouped_matmul_mgpu_ws, **kw, ablate=ablate, **_kw()))
            add(f"pallas_int4_mgpu_ws[{name},{ablate}]", rows, e, k, n, timer(fa, x, w, gs, iters=args.iters),
                "int4_mgpu", n_active, {"config": {**cfg, "ablate": ablate}})
        except Exception as ex:  # noqa: BLE001
          print("ws fail", name, type(ex).__name__, str(ex)[:400], flush=True)
      save()
    del w_bf16, w_nk, w_mg, w_by_order
  save()
  for seed in seeds:
    md = em.sweep_markdown({**meta, "seed": seed, "rows": rows_by_seed[seed]})
    with open(os.path.join(args.out, f"int4_mgpu_ws{tags[seed]}.md"), "w") as fh:
      fh.write(md)
    print(md)
  print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  sys.exit(main())

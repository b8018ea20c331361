"""Does the value codes' layout cost the OS-KVP core memory bandwidth? The core's TMA ring alone, two layouts.

Run on the GPU:  PYTHONPATH=$PWD python3 benchmarks/oskvp_stream_layout_probe.py --out=$OUT
CPU check:       PYTHONPATH=$PWD python3 benchmarks/oskvp_stream_layout_probe.py --smoke --out=/tmp/probe

The wired core (`oskvp_decode_core_mma.py`) streams, per 128-token block of a row, the key codes [128, 32] and key
outliers [16, 64] as contiguous 4 KB and 1 KB, but the value codes [32, 128] and value outliers [8, 128] from
token-contiguous arrays [H/4, S] and [8, S]: 40 rows of 128 bytes, S bytes apart. At 64k × 8 on an H100 the core streams
its 335.5 MB (80 bytes a token and row) at ~91.5% of the span copy, and the ring alone (`ablate="no_compute"`, 118.8 µs)
at ~91% of the read-only sum by span (notes_mgpu_oskvp.md §25, §29, §30). This kernel is that ring with nothing else:
each program (a row, a split) pipes its blocks through shared memory (`plgpu.emit_pipeline`, the core's block specs and
swizzles) and computes nothing. Layouts: "strided" (the cache's until block-major values: [BK, H/4, S]) and
"block_major" (values [BK, S/128 · H/4, 128]: a block's value rows contiguous, 4 KB and 1 KB like the keys'). Same
bytes, same boxes in shared memory; only the global addresses differ. On an H100 block_major took 2.4–3.0% less time in
every case (results/oskvp_stream_layout_h100_s49.md), so uniform caches now store their values block-major
(`pallas_kernels/oskvp_value_layout.py`, notes_mgpu_oskvp.md §31).

Timing: CUPTI kernel time, median of --iters calls, beside an XLA read-only sum of a 1 GiB array timed the same way
(the bandwidth the ring is compared with). On the CPU (--smoke) it runs in Mosaic GPU's interpreter at tiny shapes
and checks that each program ran (its output row is its scale row copied through shared memory); no timing.
Writes oskvp_stream_layout_<device>.{md,json} under --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from benchmarks import report_files
from benchmarks.cupti import cupti_median_ms
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_value_layout as vl

BLOCK, Q, O, KO_TOKENS = 128, 32, 8, 8  # tokens a step; code bytes a token (H = 128); outlier channels; ko rows
LAYOUTS = ("strided", "block_major")
CASES = ((64, 65536, 8), (256, 65536, 2), (64, 131072, 8))  # (rows = batch × kv heads, S, splits): the wired tiling
SMOKE_CASES = ((2, 1024, 2),)


def stream_bytes(rows: int, s: int) -> int:
  """Bytes the ring reads: codes 2 × 32 and outliers 2 × 8 a token and row."""
  return rows * s * (2 * Q + 2 * O)


def _kernel(kc_ref, vc_ref, ko_ref, vo_ref, qs_ref, out_ref, *, qs_smem, bar, steps: int, layout: str,
            max_concurrent_steps: int):
  # kc_ref u8 [BK, S, 32]; ko_ref u8 [BK, S/8, 64]; strided: vc_ref [BK, 32, S], vo_ref [BK, 8, S]; block_major:
  # vc_ref [BK, S/128·32, 128], vo_ref [BK, S/128·8, 128]; qs_ref f32 [BK, 32] -> out_ref f32 [BK, splits, 32].
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  dc.copy_row_inputs(bk, bar, (qs_ref, qs_smem))
  tokens = pl.ds(sp * (steps * BLOCK), steps * BLOCK)
  rows = steps * BLOCK // KO_TOKENS
  specs = [plgpu.BlockSpec((BLOCK, Q), lambda i: (i, 0), transforms=ks.swizzled(Q)),
           plgpu.BlockSpec((BLOCK // KO_TOKENS, KO_TOKENS * O), lambda i: (i, 0))]
  srcs = [kc_ref.at[bk, tokens], ko_ref.at[bk, pl.ds(sp * rows, rows)]]
  for ref, x in ((vc_ref, Q), (vo_ref, O)):  # the cores' own value rings (`oskvp_value_layout.ring_source`)
    spec, src = vl.ring_source(ref, x, bk, sp, steps, BLOCK, lambda i: i, blocks=layout == "block_major")
    specs.append(spec)
    srcs.append(src)

  def body(idx, *tiles):  # the ring alone: nothing computed
    del idx, tiles

  plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs, max_concurrent_steps=max_concurrent_steps)(*srcs)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qs_smem, out_ref.at[bk, sp])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits", "layout", "max_concurrent_steps", "interpret"))
def stream(kc, vc, ko, vo, qs, *, splits: int, layout: str, max_concurrent_steps: int = 2,
           interpret: bool = False):
  """The ring over every row's blocks in `layout` -> f32 [BK, splits, 32] (each program's copy of its qs row)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  bk, s, _ = kc.shape
  kernel = plgpu.kernel(
      functools.partial(_kernel, steps=s // (splits * BLOCK), layout=layout,
                        max_concurrent_steps=max_concurrent_steps),
      out_type=jax.ShapeDtypeStruct((bk, splits, 32), jnp.float32), grid=(bk, splits), grid_names=("bk", "split"),
      scratch_types=dict(qs_smem=plgpu.SMEM((32,), jnp.float32), bar=plgpu.Barrier(num_arrivals=1, num_barriers=1)),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **ks.interpret_kwargs(interpret))
  return kernel(kc, vc, ko, vo, qs)


def inputs(key, rows: int, s: int, layout: str):
  """Random bytes in `layout` (the same values either way: block_major is the strided arrays' blocks laid end to
  end) and qs rows 0..rows-1."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  byte = lambda k, shape: jax.random.randint(k, shape, 0, 256, jnp.int32).astype(jnp.uint8)
  kc, ko = byte(k1, (rows, s, Q)), byte(k2, (rows, s // KO_TOKENS, KO_TOKENS * O))
  vc, vo = byte(k3, (rows, Q, s)), byte(k4, (rows, O, s))
  if layout == "block_major":  # as the cores take it: [BK, S/128 · X, 128]
    vc, vo = (vl.ring_operand(vl.block_major(x)) for x in (vc, vo))
  qs = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.float32)[:, None], (rows, 32))
  return kc, vc, ko, vo, qs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_stream_layout")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--rings", default="2,4", help="comma-separated max_concurrent_steps (the core runs 2)")
  ap.add_argument("--smoke", action="store_true", help="Mosaic GPU's interpreter on the CPU, tiny shapes, no timing")
  args = ap.parse_args(argv)
  gpu = jax.devices()[0].platform == "gpu" and not args.smoke
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=jax.devices()[0].device_kind, jax=jax.__version__,
              timing="CUPTI kernel time, median" if gpu else "none (interpreter check only)")
  md = [f"# The OS-KVP core's TMA ring alone, two value layouts: {meta['device']}, jax {meta['jax']}, {meta['date']}",
        "", f"Timing: {meta['timing']} of {args.iters} calls."]
  read_tbs = None
  if gpu:
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    ms = cupti_median_ms(functools.partial(jax.jit(jnp.sum), x), args.iters)[0]
    read_tbs = x.nbytes / (ms * 1e-3) / 1e12
    md += ["", f"Read-only sum of 1 GiB (XLA, same timing): {ms:.4f} ms, {read_tbs:.2f} TB/s."]
  md += ["", "| rows | S | splits | ring | layout | MB | µs | TB/s | of read-only | × strided |", "|" + "---|" * 10]
  rows_out = []
  for rows, s, splits in (CASES if gpu else SMOKE_CASES):
    for ring in [int(r) for r in args.rings.split(",")]:
      base = None
      for layout in LAYOUTS:
        a = inputs(jax.random.key(rows + s), rows, s, layout)
        fn = functools.partial(stream, *a, splits=splits, layout=layout, max_concurrent_steps=ring,
                               interpret=not gpu)
        got = np.asarray(fn())
        want = np.broadcast_to(np.arange(rows, dtype=np.float32)[:, None, None], (rows, splits, 32))
        if not np.array_equal(got, want):
          print(f"{layout} rows={rows} S={s}: a program's output row is wrong; stopping", flush=True)
          return 1
        nbytes = stream_bytes(rows, s)
        us = cupti_median_ms(fn, args.iters)[0] * 1e3 if gpu else float("nan")
        tbs = nbytes / (us * 1e-6) / 1e12 if gpu else float("nan")
        base = base or us
        rows_out.append(dict(rows=rows, s=s, splits=splits, ring=ring, layout=layout, bytes=nbytes, us=us,
                             tb_per_s=tbs))
        frac = f"{tbs / read_tbs:.1%}" if read_tbs else "-"
        md.append(f"| {rows} | {s} | {splits} | {ring} | {layout} | {nbytes / 1e6:.1f} | {us:.2f} | {tbs:.2f} | "
                  f"{frac} | {base / us:.3f}× |")
        print(md[-1], flush=True)
  report_files.write(args.out, "oskvp_stream_layout", dict(meta=meta, read_only_tb_per_s=read_tbs, rows=rows_out), md)
  return 0


if __name__ == "__main__":
  sys.exit(main())

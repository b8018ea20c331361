"""The wired Mosaic GPU path of `kv_cache="oskvp_uniform"` (`uniform_decode_attention`) as `decode_attention.py
--mosaic_grid` times it: its inputs in either value layout, its options and their row labels, and its check against
the XLA reference on the GPU. decode_timeline.py, oskvp_uniform_decode_check.py and oskvp_uniform_profile.py time and
check the same path through these."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_attention import WINDOW, oskvp_args, rel_l2
from pallas_kernels.oskvp_decode_attention import oskvp_decode_attention_reference
from moe_jax.kv_quant import oskvp_cache
from pallas_kernels.oskvp_random import uniform_codebooks

# --mosaic_value_layout -> the cache's name for it: block-major (the cache's where S % 128 == 0) or [X, S]
CACHE_LAYOUTS = {"blocks": "block_major", "tokens": "token_contiguous"}
VALUE_LAYOUTS = tuple(CACHE_LAYOUTS)


def uniform_args(key, b, s, value_layout: str = "blocks"):
  """The 15 arguments with uniform codebooks (c0 + d·c, outlier rows constant) and the values as an
  `OSKVPMode(uniform=True)` cache stores them: `uniform_decode_attention`'s inputs. value_layout "blocks":
  block-major [B, K, S/128, X, 128] (the cache's at these capacities), "tokens": tokens contiguous [B, K, X, S]."""
  if value_layout not in VALUE_LAYOUTS:
    raise ValueError(f"value_layout={value_layout!r} must be one of {VALUE_LAYOUTS}")
  a = list(oskvp_args(key, b, s))
  for i, kk in ((4, 1), (8, 2)):  # cb_k, cb_v
    a[i] = uniform_codebooks(jax.random.fold_in(key, kk), a[i].shape[:-1], outliers=8)
  # codes_v, outl_v: token-major [B, K, S, X] -> as the cache stores them (its own converter)
  a[5], a[6] = (oskvp_cache.stored_values(x, CACHE_LAYOUTS[value_layout]) for x in (a[5], a[6]))
  return tuple(a)


def value_layout_label(value_layout: str) -> str:
  """A timing row's suffix for the value layout: "" for block-major (the cache's), "_vtokens" for [X, S]."""
  return "" if value_layout == "blocks" else f"_v{value_layout}"


def mosaic_uniform(*a, glue: str = "auto", value_outliers: str = "fp8_stacked", max_splits: int | None = None,
                   core: str = "wgmma", query_rotation: str = "xla", output_rotation: str = "xla",
                   epilogue_channels: int | None = None):
  """The wired Mosaic GPU path of `kv_cache="oskvp_uniform"` (q rotation, digits, core, window, merge, U_vᵀ); glue,
  value_outliers, max_splits, core, query_rotation, output_rotation and epilogue_channels as in
  `uniform_decode_attention`
  ("mma:tokens": core="mma" with mma_key_rows="tokens"). The wgmma core unless named: see the label."""
  from moe_jax.kv_quant.oskvp_uniform_codes import uniform_decode_attention  # pylint: disable=g-import-not-at-top
  core, key_rows = mosaic_core_parts(core)
  return uniform_decode_attention(*a, glue=glue, value_outliers=value_outliers, max_splits=max_splits, core=core,
                                  mma_key_rows=key_rows, query_rotation=query_rotation,
                                  output_rotation=output_rotation, epilogue_channels=epilogue_channels)


def channels_arg(value: str) -> int | None:
  """--mosaic_epilogue_channels' entry -> `uniform_decode_attention`'s epilogue_channels ("auto": None)."""
  return None if value == "auto" else int(value)


def rotation_applies(glue: str, query_rotation: str, output_rotation: str = "xla") -> bool:
  """Whether --mosaic_grid runs these rotations under this glue: the XLA glue always rotates in XLA (a "prologue"
  or "epilogue" row there would be refused, `uniform_decode_attention`)."""
  return glue != "xla" or query_rotation == output_rotation == "xla"


def channels_apply(glue: str, output_rotation: str, channels: str) -> bool:
  """Whether --mosaic_grid runs these epilogue channels: only the Pallas glue's `epilogue` takes them (the XLA glue
  and the rotating epilogue would refuse them, `uniform_decode_attention`)."""
  return channels == "auto" or (glue != "xla" and output_rotation == "xla")


def rotation_label(query_rotation: str, output_rotation: str) -> str:
  """A timing row's suffix for the rotations: "" for both in XLA (the default)."""
  return (("" if query_rotation == "xla" else f"_qrot_{query_rotation}")
          + ("" if output_rotation == "xla" else f"_orot_{output_rotation}"))


def mosaic_core_parts(core: str) -> tuple[str, str]:
  """--mosaic_core's "wgmma", "mma" or "mma:heads|tokens" -> (core, the mma core's key rows, its default if unset)."""
  from pallas_kernels.oskvp_decode_core_mma import KEY_ROW_DEFAULT  # pylint: disable=g-import-not-at-top
  core, _, key_rows = core.partition(":")
  return core, key_rows or KEY_ROW_DEFAULT


def mosaic_core_label(core: str) -> str:
  """A timing row's suffix for a core: "" for the wgmma core, else "_mma_<key rows>" (always explicit)."""
  core, key_rows = mosaic_core_parts(core)
  return "" if core == "wgmma" else f"_{core}_{key_rows}"


def token_major(a):
  """uniform_args (either value layout) -> the same cache with token-major values (the XLA reference's and Triton
  kernel's layout)."""
  a = list(a)
  layout = CACHE_LAYOUTS["blocks" if a[5].ndim == 5 else "tokens"]
  a[5], a[6] = (oskvp_cache.token_major_values(x, layout) for x in (a[5], a[6]))
  return tuple(a)


def check_mosaic_uniform(log, glue: str = "auto", value_outliers: str = "fp8_stacked", core: str = "wgmma",
                         query_rotation: str = "xla", output_rotation: str = "xla", epilogue_channels: str = "auto",
                         value_layout: str = "blocks"):
  """The wired Mosaic path vs the XLA reference on the same uniform cache (ragged n_comp / n_res, G = 4). With
  core="mma" (`wired_tiling`) batch 2 and 3 run 32 and 16 splits, batch 32 and 64 (random lengths) 2 and 1; the wgmma
  core runs 16 or more at each."""
  out = []
  rng = np.random.default_rng(0)
  wide = [(b, s, (0, 1, s, *rng.integers(0, s + 1, b - 3).tolist()),  # edge rows first, then random lengths
           (1, 0, WINDOW, *rng.integers(0, WINDOW + 1, b - 3).tolist())) for b, s in ((32, 2048), (64, 1024))]
  for b, s, n_comp, n_res in ((2, 4096, (4096, 1000), (128, 7)), (3, 2048, (0, 129, 2048), (1, 128, 64)), *wide):
    a = list(uniform_args(jax.random.key(b * s), b, s, value_layout))
    a[13], a[14] = jnp.asarray(n_comp, jnp.int32), jnp.asarray(n_res, jnp.int32)
    case = (f"B={b} S={s} n_comp={n_comp} n_res={n_res}" if b <= 4 else
            f"B={b} S={s} n_comp in [{min(n_comp)}, {max(n_comp)}] n_res in [{min(n_res)}, {max(n_res)}]")
    config = (f"mosaic_uniform glue={glue} value_outliers={value_outliers} core={core} query_rotation={query_rotation}"
              f" output_rotation={output_rotation} epilogue_channels={epilogue_channels} value_layout={value_layout}")
    try:
      got = jax.jit(functools.partial(mosaic_uniform, glue=glue, value_outliers=value_outliers, core=core,
                                      query_rotation=query_rotation, output_rotation=output_rotation,
                                      epilogue_channels=channels_arg(epilogue_channels)))(*a)
      want = jax.jit(oskvp_decode_attention_reference)(*token_major(a))
      out.append(dict(case=case, config=config, rel_err=rel_l2(got, want), nan=bool(jnp.isnan(got).any())))
    except Exception as e:  # pylint: disable=broad-except
      out.append(dict(case=case, config=config, error=repr(e)[:600]))
    log(f"check mosaic_uniform {out[-1]}")
  return out

"""Compressed KV caches. Importing this package registers the modes with `moe_jax.kv_cache`:

| kv_cache= | storage | module |
|---|---|---|
| fp8 | float8 e4m3 + f32 scale per token and head | per_token |
| int8 | int8 + f32 scale per token and head | per_token |
| kivi2 | KIVI 2-bit: keys per channel, values per token, group 32, residual 128 | kivi |
| oskvp | OS-KVP 2-bit, per-sequence U and Lloyd-Max codebooks, 8% fp8 outlier subspace, residual 128 | oskvp_modes, oskvp_cache |
| oskvp3 | as oskvp with 3-bit codes | oskvp_cache |
| oskvp_k3v2 | as oskvp with 3-bit key codes, 2-bit value codes | oskvp_cache |
| oskvp_sym | as oskvp with codebooks symmetric about each channel's mean (a third less kernel work) | oskvp_cache |
| oskvp_k3v2_sym | as oskvp_k3v2 with symmetric codebooks (four key plane types in the kernel instead of seven) | oskvp_cache |
| oskvp_uniform | as oskvp with equally spaced codebooks (the codes are the tensor-core operand), values stored block-major for the core; decode attention through the Mosaic GPU core on the GPU | oskvp_cache |
| oskvp_static | OS-KVP 2-bit with per-(layer, head) calibration; `static.calibrate_model` + `static.install` first (the CLIs do it: `moe_jax.cli.setup_kv_cache`) | static |

The per-head quantizer API is `moe_jax.kv_quant.oskvp` (`calibrate`, `quantize`, `dequantize`, `storage_bytes`).
"""

from moe_jax.kv_cache import register_kv_cache_mode
from moe_jax.kv_quant import oskvp
from moe_jax.kv_quant.kivi import KIVILayerCache, KIVIMode
from moe_jax.kv_quant.oskvp_cache import OSKVPLayerCache
from moe_jax.kv_quant.oskvp_modes import OSKVPMode, StaticOSKVPMode
from moe_jax.kv_quant.per_token import PerTokenKV, PerTokenMode

register_kv_cache_mode("fp8", PerTokenMode("float8_e4m3fn"))
register_kv_cache_mode("int8", PerTokenMode("int8"))
register_kv_cache_mode("kivi2", KIVIMode(window=128))
register_kv_cache_mode("oskvp", OSKVPMode(bits=2))
register_kv_cache_mode("oskvp3", OSKVPMode(bits=3))
register_kv_cache_mode("oskvp_k3v2", OSKVPMode(bits=2, key_bits=3))
register_kv_cache_mode("oskvp_sym", OSKVPMode(bits=2, symmetric=True))
register_kv_cache_mode("oskvp_k3v2_sym", OSKVPMode(bits=2, key_bits=3, symmetric=True))
register_kv_cache_mode("oskvp_uniform", OSKVPMode(bits=2, uniform=True))
register_kv_cache_mode("oskvp_static", StaticOSKVPMode())

__all__ = ["KIVILayerCache", "KIVIMode", "OSKVPLayerCache", "OSKVPMode", "PerTokenKV", "PerTokenMode",
           "StaticOSKVPMode", "oskvp"]

"""Swapping a model's routed expert weights for quantized values, with calibration on real activations.

`quantize_experts(model, "int4" | "int4_awq" | "vq2" | "vq2_awq" | "int4_sp24" | "int4_awq_sp24" | "vq2_sp24")`
replaces the
values of every MoE layer's `w_gate`, `w_up` ([E, D, F]) and `w_down` ([E, F, D]) Variables by `QuantizedExperts`.
The MoE layer reads them unchanged (`v[...]`) and hands them to its grouped matmul: "xla" dequantizes then runs
`ragged_dot`; "pallas" / "pallas_fused" (`moe_jax.quant.kernels`) read them compressed.

Calibration (AWQ scales, vq2_awq's channel weights, 2:4 saliency): the model's own expert inputs on `calib` tokens (default: windows of the
training split, never validation), collected by running the unquantized model: gate/up see the normalised hidden
states routed to each expert, down sees silu(gate)·up of those rows.
"""

from __future__ import annotations

import ast
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import dispatch, routing
from moe_jax.experts import GROUPED_MATMULS, FusedIntoGate, grouped_matmul
from moe_jax.moe import MoE
from moe_jax.quant.formats import QuantizedExperts
from moe_jax.quant.kernels import TRITON_KINDS
from moe_jax.quant.int4 import quantize_int4
from moe_jax.quant.vq2 import quantize_vq2


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """What `quantize_experts` does.

  Attributes:
    fmt: "int4" or "vq2".
    awq: activation-aware: int4 scales and clipping; vq2 k-means and scale refit weighted by E[x^2] per input
      channel (dense only).
    sparsity: None or "2:4".
    group_size: G along K (shrunk to a power of two >= K for small K, within the format's minimum).
    codebook: vq2 codebook per "expert" or per "layer".
    kmeans_iters: vq2's k-means iterations (Lloyd steps from the initial codebook).
  """
  fmt: str
  awq: bool = False
  sparsity: str | None = None
  group_size: int = 128
  codebook: str = "expert"
  kmeans_iters: int = 20

  def __post_init__(self):
    if self.fmt not in ("int4", "vq2"):
      raise ValueError(f"fmt={self.fmt!r} must be 'int4' or 'vq2'")
    if self.awq and self.fmt == "vq2" and self.sparsity is not None:
      raise ValueError("awq=True with fmt='vq2' is implemented for dense weights only (sparsity=None)")
    if self.sparsity not in (None, "2:4"):
      raise ValueError(f"sparsity={self.sparsity!r} must be None or '2:4'")
    if self.group_size not in (32, 64, 128, 256, 512):
      raise ValueError(f"group_size={self.group_size} must be a power of two in [32, 512]")
    lo = 128 if self.sparsity else (64 if self.fmt == "vq2" else 32)  # the formats' smallest groups (`group_for`)
    if self.group_size < lo:
      raise ValueError(f"group_size={self.group_size} must be >= {lo} for fmt={self.fmt!r}"
                       f"{' with 2:4 sparsity' if self.sparsity else ''}")
    if self.codebook not in ("expert", "layer"):
      raise ValueError(f"codebook={self.codebook!r} must be 'expert' or 'layer'")
    if not isinstance(self.kmeans_iters, int) or self.kmeans_iters < 1:
      raise ValueError(f"kmeans_iters={self.kmeans_iters!r} must be a positive int")

  @property
  def needs_calibration(self) -> bool:
    return self.awq or self.sparsity is not None

  def group_for(self, k: int) -> int:
    lo = 128 if self.sparsity else (64 if self.fmt == "vq2" else 32)
    g = self.group_size
    while g > lo and g // 2 >= k:
      g //= 2
    return max(g, lo)


MODES = {
    "int4": QuantSpec("int4"),
    "int4_awq": QuantSpec("int4", awq=True),
    "vq2": QuantSpec("vq2"),
    "vq2_awq": QuantSpec("vq2", awq=True),
    "int4_sp24": QuantSpec("int4", sparsity="2:4"),
    "int4_awq_sp24": QuantSpec("int4", awq=True, sparsity="2:4"),
    "vq2_sp24": QuantSpec("vq2", sparsity="2:4"),
}


def spec_for(mode: str, sparsity: str | None = None) -> QuantSpec:
  """A mode name (a key of MODES) plus an optional sparsity override -> QuantSpec."""
  if mode not in MODES:
    raise ValueError(f"expert_quant={mode!r} is not a mode; choose one of {sorted(MODES)}")
  spec = MODES[mode]
  return dataclasses.replace(spec, sparsity=sparsity) if sparsity else spec


def moe_layers(model) -> list[MoE | None]:
  return [b.ffn if isinstance(b.ffn, MoE) else None for b in model.blocks]


def default_calibration_tokens(n_windows: int = 16, seq_len: int = 256) -> np.ndarray:
  """int32 [n_windows, seq_len] windows of the training split (`moe_jax.data`), evenly spaced."""
  from moe_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  train = data_lib.load_corpus()["train"].tokens
  return data_lib.eval_windows(train, n_windows=n_windows, seq_len=seq_len - 1)


def _pad_rows(x_sorted: np.ndarray, group_sizes: np.ndarray, max_rows: int) -> np.ndarray:
  """[M, K] sorted rows -> [E, R, K] (R = min(max_rows, max group), zero rows for padding)."""
  e, r = group_sizes.shape[0], max(1, min(max_rows, int(group_sizes.max())))
  out = np.zeros((e, r, x_sorted.shape[1]), np.float32)
  start = 0
  for i, g in enumerate(group_sizes):
    take = min(int(g), r)
    # Evenly spaced rows of the expert's share, so a long calibration set is subsampled, not truncated.
    pick = start + np.linspace(0, int(g) - 1, take).astype(np.int64) if take else np.zeros((0,), np.int64)
    out[i, :take] = x_sorted[pick]
    start += int(g)
  return out


@jax.jit
def _routed_inputs(model, tokens):
  """Per block: (x_sorted [M, D], group_sizes [E], silu(gate)·up [M, F]) of the unquantized experts, or None."""
  out = []
  for block, h in zip(model.blocks, model.ffn_inputs(tokens)):
    if not isinstance(block.ffn, MoE):
      out.append(None)
      continue
    moe = block.ffn
    flat = h.reshape(-1, h.shape[-1])
    logits = routing.router_logits(flat, moe.w_router[...])
    _, ids = routing.select_experts(logits, k=moe.k, router=moe.router, norm_topk_prob=moe.norm_topk_prob,
                                    selection_bias=moe.router_bias[...])
    xs, gs, _ = dispatch.permute(flat, ids, moe.n_experts)
    g = grouped_matmul(xs, moe.w_gate[...], gs)
    u = grouped_matmul(xs, moe.w_up[...], gs)
    out.append((xs, gs, (jax.nn.silu(g) * u).astype(xs.dtype)))
  return out


def collect_expert_inputs(model, tokens, *, max_rows: int = 512) -> list[dict[str, np.ndarray] | None]:
  """Per block: {"gate_up": [E, R, D], "down": [E, R, F]} expert inputs on `tokens` (None for dense blocks)."""
  out = []
  for item in _routed_inputs(model, jnp.asarray(tokens, jnp.int32)):
    if item is None:
      out.append(None)
      continue
    xs, gs, hd = (np.asarray(a, np.float32) for a in item)
    gs = gs.astype(np.int64)
    out.append({"gate_up": _pad_rows(xs, gs, max_rows), "down": _pad_rows(hd, gs, max_rows)})
  return out


@functools.partial(jax.jit, static_argnums=(1,))
def quantize_weight(w: jax.Array, spec: QuantSpec, calib_x: jax.Array | None = None) -> QuantizedExperts:
  """One [E, K, N] expert weight under `spec` (calib_x [E, R, K] for AWQ / 2:4 saliency); jitted."""
  g = spec.group_for(w.shape[1])
  if spec.fmt == "int4":
    return quantize_int4(w, group_size=g, sparsity=spec.sparsity, calib_x=calib_x, awq=spec.awq)
  return quantize_vq2(w, group_size=g, codebook=spec.codebook, sparsity=spec.sparsity, calib_x=calib_x, awq=spec.awq,
                      iters=spec.kmeans_iters)


def check_kernel_shape(where: str, implementation: str, kind: str, n: int) -> None:
  """Refuses a Pallas route for a quantized weight of N its Triton kernel cannot tile (`ragged_tiles.pick_block_n`:
  N a multiple of 16), naming the weight; before this the first forward failed inside the kernel's call."""
  if implementation in ("pallas", "pallas_fused") and kind in TRITON_KINDS and n % 16:
    raise ValueError(f"{where}: implementation={implementation!r} runs {kind} experts through a Pallas kernel that "
                     f"needs N (the weight's output size) a multiple of 16, got N={n}; keep implementation='xla' "
                     "for this model")


def quantize_experts(model, mode: str | QuantSpec, *, sparsity: str | None = None, calib=None,
                     implementation: str | None = None):
  """Replaces the routed experts' weights of `model` (in place) by quantized values and returns it.

  Args:
    model: a `moe_jax.model.Transformer` (use `nnx.clone` first to keep the original).
    mode: a key of MODES or a QuantSpec.
    sparsity: "2:4" to add micro-sparsity to the mode.
    calib: int tokens [B, T] for calibration; None: `default_calibration_tokens()` when the mode needs it.
      "structure": zeros stand in for activations (for `jax.eval_shape` of the quantized structure).
    implementation: also switch the MoE layers' grouped matmul (e.g. "pallas").
  """
  spec = mode if isinstance(mode, QuantSpec) else spec_for(mode, sparsity)
  layers = moe_layers(model)
  for moe in layers:
    for name in ("w_gate", "w_up", "w_down"):
      w = None if moe is None else getattr(moe, name)[...]
      if w is not None and not isinstance(w, jax.Array):
        raise ValueError(f"{name} of a MoE layer is already quantized ({getattr(w, 'kind', type(w).__name__)}): "
                         "quantize the unquantized checkpoint (e.g. no --expert_quant on a quant.convert directory)")
  kind = spec.fmt + ("_sp24" if spec.sparsity else "")
  for i, moe in enumerate(layers):
    for name in ("w_gate", "w_up", "w_down") if moe is not None else ():
      check_kernel_shape(f"blocks.{i}.ffn.{name}", implementation or moe.implementation, kind,
                         getattr(moe, name)[...].shape[2])
  acts: list = [None] * len(layers)
  if spec.needs_calibration and not (isinstance(calib, str) and calib == "structure"):
    from moe_jax import decode  # pylint: disable=g-import-not-at-top

    tokens = default_calibration_tokens() if calib is None else calib
    try:
      decode.check_logits_tokens(model.config, np.asarray(tokens))
    except ValueError as e:
      default = " (the default, stdlib bytes: pass calib= tokens of this model)" if calib is None else ""
      raise ValueError(f"calib{default}: {e}") from e
    acts = collect_expert_inputs(model, tokens)
  for moe, act in zip(layers, acts):
    if moe is None:
      continue
    for name, key in (("w_gate", "gate_up"), ("w_up", "gate_up"), ("w_down", "down")):
      var = getattr(moe, name)
      w = var[...]
      cx = None
      if act is not None:
        cx = jnp.asarray(act[key])
      elif spec.needs_calibration:
        cx = jnp.zeros((w.shape[0], 1, w.shape[1]), jnp.float32)
      var.set_value(quantize_weight(w, spec, cx))
    if implementation is not None:
      moe.implementation = implementation
  return model


def check_mgpu_options(options: dict, where: str, kp: int, n: int,
                       fmt: str = "int4") -> tuple[tuple[str, object], ...]:
  """The options as sorted (name, value) pairs, or a ValueError naming the weight and the field: the kernel's own
  check (`int4_grouped_matmul_mgpu_ws.check_options`) against the weight's padded K and N, so that a bad value fails
  at conversion and not inside the kernel's trace. fmt "vq2": the Mosaic GPU vq2 kernel's options (the same checks,
  no `aligned_tiles`: its tiles are always aligned)."""
  from pallas_kernels import int4_grouped_matmul_mgpu_ws as mws  # pylint: disable=g-import-not-at-top
  from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vmws  # pylint: disable=g-import-not-at-top
  allowed = vmws.OPTIONS if fmt == "vq2" else mws.OPTIONS
  for name, value in options.items():
    if name not in allowed:
      raise ValueError(f"{where}: {name}={value!r} is not an option of the Mosaic GPU {fmt} kernel (one of "
                       f"{allowed})")
  try:
    mws.check_options(kp, n, **options)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  return tuple(sorted(options.items()))


def parse_kernel_options(items: list[str], flag: str = "kernel options") -> dict:
  """["block_r=32", "table_impl='xla'", ...] (name=value, values Python literals) -> {"block_r": 32, ...}, for
  command lines that pass `to_mgpu_layout` options; a malformed item raises a ValueError naming `flag`."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    try:
      if not sep or not name.strip():
        raise ValueError
      out[name.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      raise ValueError(f"{flag}: {item!r} is not name=value with a Python literal value") from None
  return out


def to_mgpu_layout(model, *, fuse_gate_up: bool = False, **kernel_options):
  """Re-lays every routed expert weight of kind "int4" (dense RTN int4, G = 128) as kind "int4_mgpu", and of kind
  "vq2" (G = 128) as kind "vq2_mgpu" (in place).

  "int4_mgpu" is the layout of the warp-specialized Mosaic GPU kernel (`pallas_kernels/int4_grouped_matmul_mgpu_ws.py`,
  the fastest int4 kernel on the H200 at decode sizes: benchmarks/results/expert_matmul.md); the "pallas" grouped
  matmul then runs that kernel (lhs rounded to bf16, its contract) instead of the Triton one. The same values: the
  dequantized weight is unchanged. Other kinds, AWQ weights (activation scales) and weights whose N is not a multiple
  of 64 are refused with the weight's name. Checkpoints store "int4": convert after `load_quantized`.

  "vq2_mgpu" is the layout of the Mosaic GPU vq2 kernel (`pallas_kernels/vq2_grouped_matmul_mgpu_ws.py`: 2.7-3.6x
  the best bf16 peer on the H200 at <= 16 rows per expert, balanced routing, benchmarks/results/vq2_mgpu_index.md;
  the Triton vq2 kernel is 0.4-0.5x, vq2_mgpu_grid.md); the same values, the same rules (no activation scales,
  G = 128, N a multiple of 64), its options (`vq2_grouped_matmul_mgpu_ws.OPTIONS`). fuse_gate_up takes int4 weights
  only.

  fuse_gate_up: store each layer's gate and up once, interleaved (`int4_gate_up_mgpu.interleave_gate_up`), as one
  "int4_mgpu_gate_up" weight [E, D, 2F] in `w_gate`, and `experts.FusedIntoGate` in `w_up`; "pallas" and
  "pallas_fused" then compute silu(x W_gate) · (x W_up) in one `swiglu=True` call of the kernel (3-11% faster than two
  calls on the H200; in the decode step 3.5-35% less expert-kernel time at 1-128 slots), "xla" from the
  de-interleaved weights (the unfused model's values). F need only be a multiple of 32; gate and up must have the
  same shape.

  kernel_options: keyword arguments of the kernel (`int4_grouped_matmul_mgpu_ws.OPTIONS`) stored with every weight
  and passed on each call, e.g. `block_r=32` where the routing is known to be uneven at ~16 rows per expert (19-24%
  faster than the default there on the H200 for int4, 9-24% for vq2; slower under balanced routing: see the int4
  kernel's docstring). Checked here against each weight's shape (the fused weight's N is 2F); a bad one raises a
  ValueError naming the weight and the field.
  """
  from pallas_kernels import int4_gate_up_mgpu as gu  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_grouped_matmul_mgpu_ws as mws  # pylint: disable=g-import-not-at-top
  from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vmws  # pylint: disable=g-import-not-at-top
  for i, moe in enumerate(moe_layers(model)):
    if moe is None:
      continue
    relaid = {}
    for name in ("w_gate", "w_up", "w_down"):
      q = getattr(moe, name)[...]
      where = f"blocks.{i}.ffn.{name}"
      if not isinstance(q, QuantizedExperts) or q.kind not in ("int4", "vq2"):
        raise ValueError(f"{where}: to_mgpu_layout takes int4 or vq2 weights, got "
                         f"{q.kind if isinstance(q, QuantizedExperts) else type(q).__name__}")
      if q.kind == "vq2":
        if fuse_gate_up:
          raise ValueError(f"{where}: fuse_gate_up takes int4 weights, not vq2")
        if q.data.in_scale is not None or q.group_size != 128 or q.shape[2] % 64:
          raise ValueError(f"{where}: the Mosaic GPU vq2 kernel takes vq2 with group 128, N a multiple of 64 and no "
                           f"activation scales (group {q.group_size}, N {q.shape[2]}, activation scales: "
                           f"{q.data.in_scale is not None})")
        relaid[name] = q
        continue
      n_multiple = gu.SWIGLU_BLOCK if fuse_gate_up and name != "w_down" else 64  # the fused weight's N is 2F
      if q.data.in_scale is not None or q.data.meta is not None or q.group_size != 128 or q.shape[2] % n_multiple:
        raise ValueError(f"{where}: the Mosaic GPU int4 kernel takes dense RTN int4 with group 128 and N a multiple "
                         f"of {n_multiple} (group {q.group_size}, N {q.shape[2]}, AWQ scales: "
                         f"{q.data.in_scale is not None})")
      relaid[name] = q
    if fuse_gate_up and relaid["w_gate"].shape != relaid["w_up"].shape:
      raise ValueError(f"blocks.{i}.ffn.w_up: fuse_gate_up needs gate and up of one shape, got w_gate "
                       f"{relaid['w_gate'].shape} and w_up {relaid['w_up'].shape}")
    for name, q in relaid.items():
      where, fused = f"blocks.{i}.ffn.{name}", fuse_gate_up and name != "w_down"
      fmt = q.kind
      options = check_mgpu_options(kernel_options, where, q.kp, q.shape[2] * (2 if fused else 1), fmt)  # kernel's N
      data = vmws.to_mgpu_layout(q.data) if fmt == "vq2" else mws.to_mgpu_layout(q.data)
      relaid[name] = QuantizedExperts(data, kind=f"{fmt}_mgpu", k=q.k, group_size=q.group_size, options=options)
    if fuse_gate_up:
      gate, up = relaid["w_gate"], relaid["w_up"]
      relaid["w_gate"] = gate.replace(data=gu.interleave_gate_up(gate.data, up.data), kind="int4_mgpu_gate_up")
      relaid["w_up"] = FusedIntoGate(up.shape)
    for name, value in relaid.items():
      getattr(moe, name).set_value(value)
  return model


def set_implementation(model, implementation: str):
  """Switches every MoE layer's grouped matmul implementation (in place); refuses a kernel route whose kernel cannot
  take a layer's quantized weight shape (named by layer and weight)."""
  if implementation not in GROUPED_MATMULS:
    raise ValueError(f"implementation={implementation!r} is not a grouped matmul; choose one of "
                     f"{sorted(GROUPED_MATMULS)}")
  for where, w in expert_weights(model).items():
    if isinstance(w, QuantizedExperts):
      check_kernel_shape(where, implementation, w.kind, w.shape[2])
  for moe in moe_layers(model):
    if moe is not None:
      moe.implementation = implementation
  return model


def expert_weights(model) -> dict[str, jax.Array | QuantizedExperts | FusedIntoGate]:
  """{"blocks.{i}.ffn.{w_gate|w_up|w_down}": value} of every MoE layer, as stored (after `to_mgpu_layout(model,
  fuse_gate_up=True)` w_gate holds gate and up and w_up is `FusedIntoGate`)."""
  out = {}
  for i, moe in enumerate(moe_layers(model)):
    if moe is not None:
      for name in ("w_gate", "w_up", "w_down"):
        out[f"blocks.{i}.ffn.{name}"] = getattr(moe, name)[...]
  return out


def expert_bytes(model) -> int:
  """Bytes of all routed expert weights as stored (quantized or not; a w_up fused into w_gate counts 0)."""
  return sum(int(v.nbytes) for v in expert_weights(model).values())

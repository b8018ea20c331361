"""The checks of `sharding.experiments`' flags, importable without that script's XLA_FLAGS side effect (it asks
for 8 CPU devices at import, which would leak into a test process)."""

from __future__ import annotations

from sharding import expert_parallel, meshes


def check_expert_nodes(f, layouts: list[tuple[int, int]], n_experts: int) -> None:
  """Refuses, naming --layouts, a layout whose node count does not divide the model's experts."""
  for n, _ in layouts:
    if n_experts % n:
      raise ValueError(f"layouts={f.layouts!r}: {n} nodes do not divide the model's {n_experts} experts")


def check_model_limits(f, max_seq_len: int) -> None:
  """Refuses, by name, --context and --prompt_len / --steps past the model's max_seq_len (the quality windows ran
  past it silently under jit; every timed row failed and the run still exited 0)."""
  if f.context > max_seq_len:
    raise ValueError(f"context={f.context} exceeds the model's max_seq_len={max_seq_len}")
  if f.prompt_len + f.steps + 2 > max_seq_len:  # the timed decode's cache (`decode_benchmark`)
    raise ValueError(f"prompt_len={f.prompt_len} + steps={f.steps} + 2 exceeds the model's max_seq_len={max_seq_len}")


def check_flags(f, n_devices: int | None = None, n_experts: int | None = None) -> list[tuple[int, int]]:
  """The flags' layouts [(nodes, local)], after refusing, by name, settings that would fail (or time nothing) in
  every row of the sweep instead of before it; with `n_devices` / `n_experts`, also layouts larger than the devices
  present or whose node count does not divide the experts."""
  layouts = [meshes.parse_layout(s) for s in f.layouts.split(",")]
  for n, l in layouts:
    if n_devices is not None and n * l > n_devices:
      raise ValueError(f"layouts={f.layouts!r}: {n}x{l} needs {n * l} devices, {n_devices} present")
  if n_experts is not None:
    check_expert_nodes(f, layouts, n_experts)
  bad = [t for t in f.transports.split(",") if t not in expert_parallel.TRANSPORTS]
  if bad:
    raise ValueError(f"transports={f.transports!r}: {bad} not among {expert_parallel.TRANSPORTS}")
  for name in ("batch", "prompt_len", "steps", "windows", "context"):
    if getattr(f, name) < 1:
      raise ValueError(f"{name}={getattr(f, name)} must be >= 1")
  if not 1 <= f.prefix <= f.context:  # the quality windows prefill `prefix` tokens, then decode to `context`
    raise ValueError(f"prefix={f.prefix} must be in [1, context={f.context}]")
  for n, l in layouts:
    if f.batch % (n * l):
      raise ValueError(f"batch={f.batch} must be divisible by the {n * l} devices of layout {n}x{l}")
  for name, kind in (("lambdas", float), ("ranks", int)):
    try:
      [kind(v) for v in getattr(f, name).split(",")]
    except ValueError:
      raise ValueError(f"{name}={getattr(f, name)!r} must be comma-separated {kind.__name__}s") from None
  if f.rank < 1:  # the layout rows' LCVC serves remote experts by surrogates (the sweep's ranks may be 0: exact)
    raise ValueError(f"rank={f.rank} must be >= 1 (the layout rows decode remote experts by rank-`rank` surrogates)")
  if any(int(v) < 0 for v in f.ranks.split(",")):
    raise ValueError(f"ranks={f.ranks!r} must be >= 0")
  if not all(0 <= float(v) < float("inf") for v in f.lambdas.split(",")):  # before: the sweep died after the rows
    raise ValueError(f"lambdas={f.lambdas!r} must be finite and >= 0")
  return layouts

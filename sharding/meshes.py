"""Device meshes with an explicit across-node axis and a within-node axis: ("node", "local").

A node is a set of devices joined by the fast fabric (NVLink within a host); across nodes traffic is slower. The
mesh is built from the real process topology (one node per process: devices grouped by `process_index`) or from a
simulated grouping of one host's devices (`n_nodes=N`, e.g. 8 simulated CPU devices as 2 nodes × 4).
Device ids of a mesh are laid out node-major, so flattening ("node", "local") gives node · n_local + local.
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

NODE, LOCAL = "node", "local"
AXES = (NODE, LOCAL)


def parse_layout(layout: str) -> tuple[int, int]:
  """"2x4" -> (n_nodes=2, n_local=4)."""
  try:
    n, l = (int(v) for v in layout.lower().split("x"))
  except ValueError as e:
    raise ValueError(f"layout={layout!r} must look like 'NxL' (nodes x devices per node), e.g. '2x4'") from e
  if n < 1 or l < 1:
    raise ValueError(f"layout={layout!r} must have positive sizes")
  return n, l


def process_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """One node per process: devices grouped by `process_index`, each group sorted by device id."""
  devices = list(devices if devices is not None else jax.devices())
  groups = collections.defaultdict(list)
  for d in devices:
    groups[d.process_index].append(d)
  sizes = {p: len(g) for p, g in groups.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"processes hold different numbers of devices {sizes}; a (node, local) mesh needs equal nodes")
  grid = [sorted(groups[p], key=lambda d: d.id) for p in sorted(groups)]
  return Mesh(np.array(grid, dtype=object), AXES)


def simulated_mesh(n_nodes: int, n_local: int | None = None,
                   devices: Sequence[jax.Device] | None = None) -> Mesh:
  """`n_nodes` × `n_local` devices of this host (default all of them) grouped into simulated nodes."""
  devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
  for name, value in (("n_nodes", n_nodes), ("n_local", n_local)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{name}={value!r} must be a positive int")
  if n_local is None:
    if len(devices) % n_nodes:
      raise ValueError(f"n_nodes={n_nodes} must divide the {len(devices)} devices")
    n_local = len(devices) // n_nodes
  if n_nodes * n_local > len(devices):
    raise ValueError(f"a {n_nodes}x{n_local} mesh needs {n_nodes * n_local} devices, only {len(devices)} present "
                     f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)")
  grid = np.array(devices[: n_nodes * n_local], dtype=object).reshape(n_nodes, n_local)
  return Mesh(grid, AXES)


def make_mesh(nodes: int | None = None, layout: str | None = None) -> Mesh:
  """The mesh of a command line: `layout="NxL"`, or `nodes=N` simulated over all devices, or the process topology."""
  if layout is not None:
    return simulated_mesh(*parse_layout(layout))
  if nodes is not None:
    return simulated_mesh(nodes)
  return process_mesh()


def layout_name(mesh: Mesh) -> str:
  return f"{mesh.shape[NODE]}x{mesh.shape[LOCAL]}"


def device_nodes(mesh: Mesh) -> np.ndarray:
  """int [n_devices]: the node of each mesh position (partition id), node-major."""
  return np.repeat(np.arange(mesh.shape[NODE]), mesh.shape[LOCAL])

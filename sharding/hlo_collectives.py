"""Collectives of a compiled HLO module, their device groups, and the bytes they move across the node axis.

Reads `compiled.as_text()`. Replica groups appear in several spellings, all handled:
  explicit `{{0,1},{2,3}}`; iota `[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`; mesh
  `mesh['node'=2,'local'=4] {'local'}` (the axes listed vary within a group); empty `{}` (all devices);
  `source_target_pairs={{0,1},...}` for collective-permute.

Bytes across nodes, per step, summed over all devices (a direct exchange model, independent of the algorithm):
  all-to-all / ragged-all-to-all: a device sends S/g to each peer (S its buffer, g the group size);
  all-gather: a device receives its peers' S_out/g shards; reduce-scatter: it sends S_in/g to each peer;
  all-reduce: reduce-scatter + all-gather, 2·S/g per peer; collective-permute: S when the pair spans nodes.
Only peers on another node count. Ragged collectives count their full buffers (an upper bound).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

OPS = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
       "collective-broadcast")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "c64": 8, "c128": 16}
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str
  groups: tuple[tuple[int, ...], ...]  # device (partition) ids per group; permute: (source, target) pairs
  bytes_out: int  # bytes of the op's result on one device
  line: str


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return total


def _tuple_elements(shape: str) -> list[str] | None:
  """The top-level elements of a tuple shape "(a, (b, c), d)", or None when `shape` is not a tuple."""
  shape = shape.strip()
  if not shape.startswith("("):
    return None
  out, depth, begin = [], 0, 1
  for i, ch in enumerate(shape):
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
    if (ch == "," and depth == 1) or depth == 0:
      out.append(shape[begin:i].strip())
      begin = i + 1
      if depth == 0:
        break
  return out


def result_shape(shape: str, op: str, start: bool) -> str:
  """The result part of a collective's HLO shape. An async `-start` op's shape also holds its operands: a wrapped
  async op (all-to-all, ragged-all-to-all, reduce-scatter on GPU) is `((operands), result, context...)`, and
  all-gather-start / collective-permute-start are `(operand(s), result(s), ...)`; all-reduce-start is its result.
  Counting the whole tuple (as before) doubled the GPU's cross-node bytes."""
  parts = _tuple_elements(shape) if start else None
  if parts and len(parts) > 1 and (parts[0].startswith("(") or op in ("all-gather", "collective-permute")):
    return parts[1]
  return shape


def _braced(text: str, start: int) -> str:
  """The balanced {...} starting at text[start] == '{'."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start: i + 1]
  raise ValueError(f"unbalanced braces in {text[start:start + 80]!r}")


def parse_groups(line: str, n_devices: int) -> tuple[tuple[int, ...], ...]:
  """Device groups of one collective's HLO line."""
  m = re.search(r"source_target_pairs=", line)
  if m:
    body = _braced(line, m.end())
    return tuple(tuple(int(v) for v in g.split(",")) for g in re.findall(r"\{(\d+,\d+)\}", body))
  m = re.search(r"replica_groups=", line)
  if not m:
    return (tuple(range(n_devices)),)
  rest = line[m.end():]
  mm = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if mm:
    axes = [(a.split("=")[0].strip().strip("'\""), int(a.split("=")[1])) for a in mm.group(1).split(",")]
    inside = [a.strip().strip("'\"") for a in mm.group(2).split(",") if a.strip()]
    names = [a for a, _ in axes]
    ids = np.arange(n_devices).reshape([s for _, s in axes])
    varying = [names.index(a) for a in inside]
    fixed = [i for i in range(len(names)) if i not in varying]
    ids = ids.transpose(fixed + varying).reshape(-1, int(np.prod([axes[i][1] for i in varying])) if varying else 1)
    return tuple(tuple(int(v) for v in row) for row in ids)
  mi = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", rest)
  if mi:
    out_shape = [int(v) for v in mi.group(1).split(",")]
    ids = np.arange(int(np.prod([int(v) for v in mi.group(2).split(",")]))).reshape(
        [int(v) for v in mi.group(2).split(",")])
    if mi.group(3):
      ids = ids.transpose([int(v) for v in mi.group(3).split(",")])
    ids = ids.reshape(out_shape[0], -1)
    return tuple(tuple(int(v) for v in row) for row in ids)
  body = _braced(rest, 0)
  groups = tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([0-9,\s]*)\}", body[1:-1]))
  groups = tuple(g for g in groups if g)
  return groups or (tuple(range(n_devices)),)


def collectives(hlo_text: str, n_devices: int) -> list[Collective]:
  """Every collective of a compiled module (async `-start` forms included, `-done` halves skipped)."""
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m:
      continue
    out.append(Collective(op=m.group("op"), groups=parse_groups(line, n_devices),
                          bytes_out=_shape_bytes(result_shape(m.group("shape"), m.group("op"), bool(m.group("start")))),
                          line=line.strip()))
  return out


def spans_nodes(c: Collective, node_of: np.ndarray) -> bool:
  return any(len({int(node_of[d]) for d in g}) > 1 for g in c.groups)


def cross_node_bytes(c: Collective, node_of: np.ndarray) -> float:
  """Bytes this collective moves between devices of different nodes, summed over all devices."""
  if c.op == "collective-permute":
    return float(sum(c.bytes_out for s, t in c.groups if node_of[s] != node_of[t]))
  total = 0.0
  for g in c.groups:
    size = len(g)
    if size < 2:
      continue
    for d in g:
      remote_peers = sum(node_of[p] != node_of[d] for p in g)
      if c.op in ("all-to-all", "ragged-all-to-all", "all-gather"):
        per_peer = c.bytes_out / size
      elif c.op == "reduce-scatter":
        per_peer = c.bytes_out  # input = g · output; S_in / g = output bytes
      elif c.op == "all-reduce":
        per_peer = 2 * c.bytes_out / size
      else:  # collective-broadcast
        per_peer = c.bytes_out / size
      total += remote_peers * per_peer
  return total


def summarize(hlo_text: str, node_of: np.ndarray) -> dict:
  """{n_collectives, n_cross_node, cross_node_bytes, total_bytes, ops} of a compiled module."""
  cs = collectives(hlo_text, len(node_of))
  return {
      "n_collectives": len(cs),
      "n_cross_node": sum(spans_nodes(c, node_of) for c in cs),
      "cross_node_bytes": sum(cross_node_bytes(c, node_of) for c in cs),
      "total_bytes": sum(cross_node_bytes(c, np.arange(len(node_of))) for c in cs),  # every device its own node
      "ops": sorted({c.op for c in cs}),
  }

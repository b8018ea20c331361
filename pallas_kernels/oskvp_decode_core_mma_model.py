"""The CPU model of the warp-level OS-KVP core's GPU route (`oskvp_decode_core_mma.py`), in numpy.

The kernel is inline Mosaic and PTX, which Mosaic GPU's CPU interpreter does not run. `emulate` runs the kernel's
own index functions (`key_code_source`, `value_code_source`, the outlier sources, `key_token`; `rg.Ints`) on the
PTX fragment layouts of the three mma.sync shapes, so that a wrong index shows up on the CPU against the XLA model
(`decode_core_mma_reference`). Not modelled (the GPU checks cover them): the shared-memory swizzle of the loads, the
bit-level packing of p, the tokens orientation's softmax state in its own layout (its scores are carried to the
heads' layout by the modelled movmatrix and run there), and the in-kernel merge of the warps (here `merge_splits`
over every warp's partial).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels.oskvp_decode_core_mma import (BLOCK_S, KEY_ROW_DEFAULT, KO_TOKENS, MASKED, N, OUTLIERS,
                                                  P_LEVELS, PLANES, Q, WARPS, key_code_source, key_outlier_source,
                                                  key_token, value_code_source, value_outlier_source,
                                                  value_plane, VALUE_PLANE_SCALE)


def _frag_rows(kind: str):
  """PTX fragment layouts of mma.sync m16n8k{32 s8, 8 f16, 16 f16} per lane (g, t) = (lane // 4, lane % 4):
  A registers -> [(row, first k)] (elements k, k + 1, ... in the register), B registers -> [first k]."""
  if kind == "k32":
    return [(0, 0), (8, 0), (0, 16), (8, 16)], [0, 16], 4
  if kind == "k8":
    return [(0, 0), (8, 0)], [0], 2
  return [(0, 0), (8, 0), (0, 8), (8, 8)], [0, 8], 2


def mma_emulate(kind: str, a, b, c):
  """numpy mma.sync of one warp: a [32 lanes, nA, e], b [32, nB, e], c [32, 4] -> d [32, 4] (float64; PTX layouts:
  element i of A register j of lane (g, t) is A[g + rows_j, k_j + e·t + i], of B register j B[k_j + e·t + i, g];
  C register j is C[g + 8·(j // 2), 2t + j % 2])."""
  a_regs, b_regs, e = _frag_rows(kind)
  kk = {"k32": 32, "k8": 8, "k16": 16}[kind]
  am, bm = np.zeros((16, kk)), np.zeros((kk, 8))
  for lane in range(32):
    g, t = lane // 4, lane % 4
    for j, (r0, k0) in enumerate(a_regs):
      am[g + r0, k0 + e * t:k0 + e * t + e] = a[lane, j]
    for j, k0 in enumerate(b_regs):
      bm[k0 + e * t:k0 + e * t + e, g] = b[lane, j]
  d = am @ bm
  out = np.array(c, dtype=np.float64)
  for lane in range(32):
    g, t = lane // 4, lane % 4
    for j in range(4):
      out[lane, j] += d[g + 8 * (j // 2), 2 * t + j % 2]
  return out


def _words(b: np.ndarray) -> np.ndarray:
  """bytes [..., 4] (byte 0 first) -> little-endian uint32 words [...]: what a 4-byte load gives a thread."""
  return (b.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(-1).astype(np.uint32)


def _bytes(word: np.ndarray) -> np.ndarray:
  """uint32 words [...] -> their 4 bytes [..., 4] (byte 0 first), as int64."""
  return ((word[..., None] >> (8 * np.arange(4))) & 0xFF).astype(np.int64)


def emulate_program(kc, vc, qd, qs, n_valid, ko=None, vo=None, qo=None, key_rows: str = KEY_ROW_DEFAULT):
  """The GPU route of one program in numpy: kc uint8 [L, Q], vc uint8 [Q, L] (the program's split of L tokens),
  qd int8 [8, H], qs f32 [8], n_valid (tokens of the split stored: the kernel compares each token with the row's
  length), ko fp8 [L, 8], vo fp8 [8, L], qo f16 [8, 8] -> (acc [4, H, 8], ml [4, 32], acco [4, 8, 8]) as the
  kernel stores them. Uses `key_code_source`, `value_code_source`, the outlier sources and the packing of the kernel,
  so a wrong index in any of them shows up against `decode_core_mma_reference`. With key_rows="tokens" the key
  scores run in that orientation and reach the heads' layout through the emulated movmatrix transposes (applied to
  the scores: the kernel transposes p8, the same permutation)."""
  ops = rg.Ints
  lanes = np.arange(32)
  g, t = lanes // 4, lanes % 4
  length = kc.shape[0]
  acc_out, ml_out, acco_out = np.zeros((WARPS, 4 * Q, N)), np.zeros((WARPS, 32)), np.zeros((WARPS, N, OUTLIERS))
  kw = _words(kc.view(np.uint8).reshape(length, Q // 4, 4))  # [L, Q/4]
  plane = lambda w, p: (w >> np.uint32(2 * p)) & np.uint32(0x03030303)
  qa = np.zeros((32, PLANES, 4, 4), np.int64)  # lane, k-step, register, byte
  for p in range(PLANES):
    for lane in lanes:
      qa[lane, p, 0] = qd[g[lane], p * Q + 8 * t[lane]:p * Q + 8 * t[lane] + 4]
      qa[lane, p, 2] = qd[g[lane], p * Q + 8 * t[lane] + 4:p * Q + 8 * t[lane] + 8]
  for w in range(WARPS):
    acc_i, acc_f = np.zeros((32, 32)), np.zeros((32, 32))
    m, l_f, l_i, acc_o = np.full(32, MASKED), np.zeros(32), np.zeros(32), np.zeros((32, 2))
    for base in range(0, length, BLOCK_S):
      words, pairs = [], []  # per n-tile: each lane's code words [32, 2] and key-outlier pair [32, 2]
      for nt in range(4):
        src = [key_code_source(ops, nt, w, int(g[x]), int(t[x])) for x in lanes]
        words.append(np.array([kw[base + r, c // 4:c // 4 + 2] for r, c in src]))
        if ko is not None:
          pair = np.zeros((32, 2))
          for x in lanes:
            r, col = key_outlier_source(ops, nt, w, int(g[x]), int(t[x]))
            pair[x] = ko[base + KO_TOKENS * r + col // 8, col % 8:col % 8 + 2]
          pairs.append(pair)
      qo_a = None if ko is None else qo[g[:, None], 2 * t[:, None] + np.arange(2)]  # [32, 2]
      if key_rows == "tokens":  # S [16 tokens, 8 heads] per m-tile, then each 8 × 8 block transposed (movmatrix)
        scores = [None] * 4
        for mt in range(2):
          lo, hi = words[2 * mt], words[2 * mt + 1]
          c = np.zeros((32, 4))
          for p in range(PLANES):
            a = np.stack([_bytes(plane(lo[:, 0], p)), _bytes(plane(hi[:, 0], p)), _bytes(plane(lo[:, 1], p)),
                          _bytes(plane(hi[:, 1], p))], 1)
            c = mma_emulate("k32", a, np.stack([qa[:, p, 0], qa[:, p, 2]], 1), c)
          c = c * qs[np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], 1)]
          if ko is not None:
            c = mma_emulate("k8", np.stack([pairs[2 * mt], pairs[2 * mt + 1]], 1), qo_a[:, None], c)
          for h in range(2):
            tok = base + 32 * w + np.array([key_token(ops, 2 * mt + h, int(gg)) for gg in g])
            block = np.where((tok < n_valid)[:, None], c[:, 2 * h:2 * h + 2], MASKED)  # lane (g, t): row g, 2t..
            # movmatrix: lane (g, t) receives row g, columns 2t, 2t + 1 of the transpose = element g % 2 of lanes
            # (2t, g // 2) and (2t + 1, g // 2)
            src = lambda e: 4 * (2 * t + e) + g // 2
            scores[2 * mt + h] = np.stack([block[src(0), g % 2], block[src(1), g % 2]], 1)
      else:  # S^T [16 (8 heads), 8 tokens] per n-tile
        scores = []
        for nt in range(4):
          c = np.zeros((32, 4))
          for p in range(PLANES):
            c = mma_emulate("k32", qa[:, p], _bytes(plane(words[nt], p)), c)
          sc_nt = c[:, :2] * qs[g][:, None]
          if ko is not None:
            sc_nt = mma_emulate("k8", np.stack([qo_a, np.zeros((32, 2))], 1), pairs[nt][:, None],
                                np.concatenate([sc_nt, np.zeros((32, 2))], 1))[:, :2]
          tok = base + 32 * w + np.array([[key_token(ops, nt, 2 * int(tt) + e) for e in range(2)] for tt in t])
          scores.append(np.where(tok < n_valid, sc_nt, MASKED))
      sc = np.stack(scores, 1)  # [32, 4 n-tiles, 2]
      bmax = sc.reshape(32, 8).max(1)
      bmax = np.maximum(bmax, bmax[lanes ^ 1])
      bmax = np.maximum(bmax, bmax[lanes ^ 2])
      if (bmax > m).any():
        m_new = np.maximum(m, bmax)
        alpha = np.exp2(m - m_new)
        cols = np.stack([alpha[8 * t], alpha[8 * t + 4]], 1)  # heads 2t, 2t + 1
        acc_f = (acc_f + acc_i) * np.tile(cols, 16)
        acc_o = acc_o * cols
        l_f = (l_f + l_i) * alpha
        acc_i, l_i, m = np.zeros_like(acc_i), np.zeros_like(l_i), m_new
      m_p = np.where(m > 0.5 * MASKED, m, np.inf)
      p8 = np.floor(np.exp2(sc - m_p[:, None, None]) * P_LEVELS + 0.5)  # [32, 4, 2]
      packed = np.stack([p8[:, 0:2].reshape(32, 4), p8[:, 2:4].reshape(32, 4)], 1)  # [32, 2 regs, 4 bytes]
      l_i = l_i + packed.sum((1, 2))
      for half in range(2):
        words = {}
        for hr in range(2):
          for ht in range(2):
            src = [value_code_source(ops, half, hr, ht, w, int(g[x]), int(t[x])) for x in lanes]
            words[hr, ht] = _words(np.array([vc[r, base + col:base + col + 4] for r, col in src]))
        for p in range(PLANES):
          a = np.stack([_bytes(value_plane(ops, words[hr, ht], p)) for ht in range(2) for hr in range(2)], 1)
          mt = 2 * p + half  # u8 bytes code · 4^p: the sums 4^p too large until the merge
          acc_i[:, 4 * mt:4 * mt + 4] = mma_emulate("k32", a, packed, acc_i[:, 4 * mt:4 * mt + 4])
      if vo is not None:
        c = np.concatenate([acc_o, np.zeros((32, 2))], 1)
        for st in range(2):
          src = [value_outlier_source(ops, st, w, int(g[x]), int(t[x])) for x in lanes]
          quad = np.array([vo[r, base + col:base + col + 4] for r, col in src])  # [32, 4]
          a = np.zeros((32, 4, 2))
          a[:, 0], a[:, 2] = quad[:, 0:2], quad[:, 2:4]
          b = np.stack([p8[:, 2 * st], p8[:, 2 * st + 1]], 1)  # [32, 2 regs, 2]
          c = mma_emulate("k16", a, b, c)
        acc_o = c[:, :2]
    total = (acc_f + acc_i) * np.repeat(VALUE_PLANE_SCALE, 8)  # register i holds plane i // 8
    l = l_f + l_i
    l = l + l[lanes ^ 1]
    l = l + l[lanes ^ 2]
    for lane in lanes:
      for p in range(PLANES):
        for half in range(2):
          mt = 2 * p + half
          for hr in range(2):
            ch = p * Q + 16 * half + 8 * hr + g[lane]
            acc_out[w, ch, 2 * t[lane]:2 * t[lane] + 2] = total[lane, 4 * mt + 2 * hr:4 * mt + 2 * hr + 2]
      if t[lane] == 0:
        ml_out[w, g[lane]], ml_out[w, N + g[lane]] = m[lane], l[lane]
      for e in range(2):
        acco_out[w, 2 * t[lane] + e, g[lane]] = acc_o[lane, e]
  return acc_out, ml_out, acco_out


def emulate(kcodes, vcodes, qd, qs, lengths=None, kout=None, vout=None, qo=None, *, splits: int,
            key_rows: str = KEY_ROW_DEFAULT):
  """`decode_core_mma` through `emulate_program` (numpy, every program), merged as the wrapper merges."""
  kc, vc, qd, qs = (np.asarray(x) for x in (kcodes, vcodes, qd, qs))
  bk, s, _ = kc.shape
  span = s // splits
  f32 = lambda x: None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32))
  ko, vo, qo = f32(kout), f32(vout), f32(qo)
  outs = [[], [], []]
  for b in range(bk):
    for sp in range(splits):
      n_valid = (s if lengths is None else int(lengths[b])) - sp * span
      part = slice(sp * span, (sp + 1) * span)
      res = emulate_program(kc[b, part], vc[b, :, part], qd[b].astype(np.int64), qs[b], n_valid,
                            None if ko is None else ko[b, part], None if vo is None else vo[b, :, part],
                            None if qo is None else qo[b], key_rows)
      for lst, r in zip(outs, res):
        lst.append(r)
  acc = jnp.asarray(np.stack(outs[0]).reshape(bk, splits * WARPS, 4 * Q, N), jnp.float32)
  ml = jnp.asarray(np.stack(outs[1]).reshape(bk, splits * WARPS, 32), jnp.float32)
  acco = jnp.asarray(np.stack(outs[2]).reshape(bk, splits * WARPS, N, OUTLIERS), jnp.float32)
  mean, mean_o, _ = dc.merge_splits(acc, ml, acco if kout is not None else None)
  return mean if kout is None else (mean, mean_o)

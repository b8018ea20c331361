"""Continuous batching: a fixed set of decode slots over one KV cache, a bounded request queue, and a scheduler that
interleaves bucketed prefill with one compiled decode step over all slots.

    engine = Engine(model, EngineConfig(num_slots=512, cache_len=4096))
    engine.warmup()                      # compiles every shape once; nothing compiles afterwards
    h = engine.submit(prompt_ids, max_tokens=64, sampling={"temperature": 0.7}, stop_tokens=[eos])
    for token in h: ...                  # streams; or on_token=callback; or h.result()

The caller either steps the engine (`step()`, `run_until_idle()`; iterating a handle steps it too) or runs it on a
background thread (`start()` / `stop()`).

One `step()`:
  1. ends cancelled requests and frees their slots;
  2. admits up to `max_prefill_rows` queued requests into free slots: groups them by prefill bucket (the shortest
     `prefill_lengths` entry that holds the prompt), pads each group to a `prefill_batches` size, prefills it,
     extends prompts longer than the largest bucket chunk by chunk (dense caches only), samples the first token and
     inserts the rows into their slots with one tree_map;
  3. runs the decode step over all B slots (inactive slots masked: they compute but keep their length), streams each
     active slot's token, and ends requests on a stop token, at max_tokens, on cancellation, or on non-finite logits.

Failures stay with the requests they concern: a client callback that raises ends its own request (`CallbackFailed`);
an exception in a prefill ends that group's requests and one in the decode step the running requests (`RequestFailed`,
logged), and the engine goes on with the rest of the queue. `step()` holds a lock, so threads that step a
caller-driven engine take turns.

Compiled shapes: prefill [P, T] for P in prefill_batches and T in prefill_lengths, extend [P, max T], insert and
first-token sampling per P, and one decode step [B]. `warmup()` compiles them all.

Shapes: B slots, P rows of a prefill group, T bucket length, S cache length.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np
from absl import logging

from moe_jax.kv_cache import DenseMode, get_kv_cache_mode
from moe_jax.serving import steps
from moe_jax.serving.request import (CANCELLED, FAILED, FINISHED, RUNNING, CallbackFailed, InvalidRequest,
                                     NonFiniteLogits, QueueFull, RequestFailed, RequestHandle, validate_request)
from moe_jax.tokenizer import PAD_ID


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and policies of the engine.

  Attributes:
    num_slots: B, sequences decoded together by the one compiled step.
    cache_len: S, positions per slot (the prompt and every generated token but the last must fit).
    kv_cache: cache mode name ("bf16", "fp32", or a compressed mode).
    prefill_lengths: bucket lengths T prompts are padded to (each <= cache_len).
    prefill_batches: bucket sizes P a prefill group is padded to.
    max_queue: pending requests before `submit` raises `QueueFull`.
    max_prefill_rows: requests admitted per step at most (bounds the pause prefill puts on running streams);
      0 means max(prefill_batches).
    chunked_prefill: prompts longer than the largest bucket are prefilled chunk by chunk. None: on for dense cache
      modes, off for compressed modes (whose `extend` appends every token it is given, padding included), where the
      longest prompt is then the largest bucket; True with a compressed mode is refused.
    seed: sampling PRNG seed.
  """

  num_slots: int = 512
  cache_len: int = 2048
  kv_cache: str = "bf16"
  prefill_lengths: tuple[int, ...] = (32, 128, 512)
  prefill_batches: tuple[int, ...] = (1, 4, 16)
  max_queue: int = 4096
  max_prefill_rows: int = 0
  chunked_prefill: bool | None = None
  seed: int = 0

  def __post_init__(self):
    for field in ("num_slots", "cache_len", "max_queue"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field}={value!r} must be a positive int")
    for field in ("prefill_lengths", "prefill_batches"):
      value = getattr(self, field)
      if not isinstance(value, tuple) or not value or any(not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"{field}={value!r} must be a non-empty tuple of positive ints")
      if list(value) != sorted(set(value)):
        raise ValueError(f"{field}={value!r} must be strictly increasing")
    if self.prefill_lengths[-1] > self.cache_len:
      raise ValueError(f"prefill_lengths={self.prefill_lengths} must all be <= cache_len={self.cache_len}")
    if not isinstance(self.max_prefill_rows, int) or self.max_prefill_rows < 0:
      raise ValueError(f"max_prefill_rows={self.max_prefill_rows!r} must be an int >= 0")
    mode = get_kv_cache_mode(self.kv_cache)  # Clear error for an unknown mode.
    if self.chunked_prefill and not isinstance(mode, DenseMode):  # their extend appends padding as tokens
      raise ValueError(f"chunked_prefill=True needs a dense kv_cache (bf16, fp32), not kv_cache={self.kv_cache!r}: "
                       "a compressed cache is prefilled in one shot, up to the largest of prefill_lengths")

  @property
  def chunked(self) -> bool:
    if self.chunked_prefill is not None:
      return self.chunked_prefill
    return isinstance(get_kv_cache_mode(self.kv_cache), DenseMode)

  @property
  def max_prompt_len(self) -> int:
    return self.cache_len if self.chunked else self.prefill_lengths[-1]

  @property
  def admit_per_step(self) -> int:
    return self.max_prefill_rows or self.prefill_batches[-1]


@dataclasses.dataclass
class EngineStats:
  """Counters for metrics: per decode step, the active slots and the cached positions of active slots."""

  decode_steps: int = 0
  prefill_calls: int = 0
  active_per_step: list = dataclasses.field(default_factory=list)
  positions_per_step: list = dataclasses.field(default_factory=list)
  step_seconds: list = dataclasses.field(default_factory=list)
  finished: int = 0
  failed: int = 0
  cancelled: int = 0


class Engine:
  """Continuous-batching decode over `config.num_slots` slots of one KV cache (see the module docstring)."""

  def __init__(self, model, config: EngineConfig = EngineConfig()):
    self.model = model
    self._flat = steps.FlatModel.of(model)  # snapshot of the weights, cheap to pass to every compiled step
    self.config = config
    self.vocab_size = model.config.vocab_size
    if config.cache_len > model.config.max_seq_len:
      raise ValueError(f"cache_len={config.cache_len} exceeds the model's max_seq_len={model.config.max_seq_len}")
    b = config.num_slots
    self._key = jax.random.key(config.seed)
    self._step_counter = 0
    # The initial cache: one real prefilled row copied into every slot (real values, so compressed modes hold no
    # degenerate zeros); all slots start free.
    self.cache = self._initial_cache()
    self.kv_bytes_total = self.cache.nbytes()
    self._bytes_per_position = self.kv_bytes_total / (b * config.cache_len)
    # Host-side slot state.
    self._slot_handle: list[RequestHandle | None] = [None] * b
    self._free = collections.deque(range(b))
    self._tokens = np.zeros((b,), np.int32)
    self._active = np.zeros((b,), bool)
    self._temperature = np.zeros((b,), np.float32)
    self._top_k = np.zeros((b,), np.int32)
    self._top_p = np.ones((b,), np.float32)
    self._lengths = np.zeros((b,), np.int64)  # host mirror of cached positions of active slots
    self._queue: collections.deque[RequestHandle] = collections.deque()
    self._cv = threading.Condition()
    self._ids: set = set()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._step_lock = threading.RLock()
    self._stepping: int | None = None  # the thread inside `step`, whose callbacks must not step or wait
    self._cancel_pending = False  # set by RequestHandle.cancel: the next step scans the queue for cancelled requests
    self.stats = EngineStats()

  def _initial_cache(self):
    c = self.config
    p0, t0 = c.prefill_batches[0], c.prefill_lengths[0]
    _, rows = steps.prefill(self._flat, np.full((p0, t0), PAD_ID % self.vocab_size, np.int32),
                            np.ones((p0,), np.int32), kv_cache=c.kv_cache, cache_len=c.cache_len)
    return steps.tile(rows, num_slots=c.num_slots)

  # ---------------------------------------------------------------- client side

  def submit(self, prompt: Sequence[int], *, max_tokens: int = 16, sampling=None, stop_tokens: Sequence[int] = (),
             request_id=None, on_token: Callable[[int], None] | None = None,
             on_finish: Callable[[RequestHandle], None] | None = None, block: bool = False,
             timeout: float | None = None) -> RequestHandle:
    """Queues a request.

    Args:
      prompt: token ids (1 <= len <= the engine's longest prompt; len + max_tokens - 1 <= cache_len).
      max_tokens: new tokens at most.
      sampling: `SamplingParams`, a dict of its fields, or None for greedy.
      stop_tokens: ids that end the request (emitted, then the request finishes with reason "stop").
      request_id: unique id (default: an engine-assigned int).
      on_token: called with each token as it is produced (on the engine's thread).
      on_finish: called with the handle when the request ends.
      block, timeout: when the queue is full, wait for room (up to `timeout` s) instead of raising at once; a
        caller-driven engine (not `running`) is stepped meanwhile.

    Returns:
      the request's `RequestHandle`.

    Raises:
      InvalidRequest: bad prompt, lengths, ids or sampling parameters (nothing is queued).
      QueueFull: `max_queue` requests are pending (and no room appeared within `timeout` when blocking).
    """
    c = self.config
    req = validate_request(prompt, max_tokens=max_tokens, sampling=sampling, stop_tokens=stop_tokens,
                           vocab_size=self.vocab_size, cache_len=c.cache_len, max_prompt_len=c.max_prompt_len,
                           request_id=request_id)
    handle = RequestHandle(req, self, on_token=on_token, on_finish=on_finish)
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
      with self._cv:
        if req.request_id in self._ids:
          raise InvalidRequest(f"request_id={req.request_id!r} is already in use")
        if len(self._queue) < c.max_queue:
          self._ids.add(req.request_id)
          handle.submit_time = time.perf_counter()
          self._queue.append(handle)
          self._cv.notify_all()
          return handle
        left = None if deadline is None else deadline - time.perf_counter()
        if not block or (left is not None and left <= 0):
          raise QueueFull(f"{len(self._queue)} requests pending (max_queue={c.max_queue}); retry later")
        self.check_not_in_callback()  # inside a step, waiting would wait on the thread that must make room
        if self.running:  # the engine's thread makes room; re-checked often, so a stop() meanwhile is noticed
          self._cv.wait_for(lambda: len(self._queue) < c.max_queue or not self.running,
                            timeout=0.05 if left is None else min(left, 0.05))
          continue
      self.step()  # a caller-driven engine: make room by stepping it, as `RequestHandle.wait` does

  @property
  def running(self) -> bool:
    """Whether a background thread steps the engine."""
    return self._thread is not None and self._thread.is_alive()

  @property
  def num_active(self) -> int:
    return int(self._active.sum())

  @property
  def num_queued(self) -> int:
    return len(self._queue)

  def kv_bytes_in_use(self) -> float:
    """Bytes of cache holding active sequences' positions (total bytes × used / allocated positions)."""
    return float(self._lengths[self._active].sum()) * self._bytes_per_position

  def has_work(self) -> bool:
    return bool(self._queue) or bool(self._active.any())

  # ---------------------------------------------------------------- driving

  def step(self) -> bool:
    """One scheduler iteration (cancel, admit + prefill, one decode step). Returns whether work remains.

    Raises:
      RuntimeError: called from an `on_token` / `on_finish` callback, i.e. from inside a step (directly, or through a
        handle's `wait`, `result` or iteration).
    """
    self.check_not_in_callback()
    with self._step_lock:
      self._stepping = threading.get_ident()
      try:
        self._reap_cancelled()
        self._admit()
        if self._active.any():
          try:
            self._decode()
          except Exception as e:  # pylint: disable=broad-exception-caught
            self._fail_running(e)
        return self.has_work()
      finally:
        self._stepping = None

  def check_not_in_callback(self) -> None:
    """Raises RuntimeError on the thread inside `step` (a request's callback): stepping there would run a step inside
    a step, and waiting there would wait on the thread that must produce the tokens."""
    if self._stepping == threading.get_ident():
      raise RuntimeError("an on_token / on_finish callback may not step the engine or wait for a request (it runs "
                         "inside the engine's step); hand the work to another thread")

  def run_until_idle(self, max_steps: int | None = None) -> int:
    """Steps until no request is queued or running; returns the steps taken."""
    n = 0
    while self.has_work() and (max_steps is None or n < max_steps):
      self.step()
      n += 1
    return n

  def start(self) -> None:
    """Runs the scheduler on a background thread until `stop()`."""
    if self.running:
      return
    self._stop.clear()
    self._thread = threading.Thread(target=self._loop, name="moe-jax-engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    with self._cv:
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join()
    self._thread = None

  def _loop(self) -> None:
    while not self._stop.is_set():
      if not self.step():
        with self._cv:
          self._cv.wait_for(lambda: self._queue or self._stop.is_set(), timeout=0.1)

  def warmup(self) -> int:
    """Compiles every shape the scheduler uses, on dummy data. Returns the number of traces it caused. Needs an idle
    engine (RuntimeError otherwise): its decode step runs every slot as inactive, which keeps their lengths but not
    a compressed cache's state (a request in flight on a kivi2 or OS-KVP cache decoded differently after it)."""
    with self._step_lock:
      if self.has_work():
        raise RuntimeError(f"warmup() needs an idle engine ({self.num_queued} queued, {self.num_active} active): "
                           "call it before submitting, or after run_until_idle()")
      return self._warmup()

  def _warmup(self) -> int:
    c, b = self.config, self.config.num_slots
    before = steps.total_traces()
    drop = lambda p: np.full((p,), b, np.int32)  # noqa: E731  out-of-range slots: insert drops every row
    for p in c.prefill_batches:
      ones = np.ones((p,), np.int32)
      for t in c.prefill_lengths:
        last, rows = steps.prefill(self._flat, np.zeros((p, t), np.int32), ones, kv_cache=c.kv_cache,
                                   cache_len=c.cache_len)
      if c.chunked:
        last, rows = steps.extend(self._flat, rows, np.zeros((p, c.prefill_lengths[-1]), np.int32), ones, last)
      steps.sample_rows(last, self._key, np.zeros((2,), np.uint32), *self._params(p))
      self.cache = steps.insert(self.cache, rows, drop(p))
    out = steps.decode_slots(self._flat, self.cache, self._tokens, np.zeros((b,), bool), self._key,
                             np.zeros((2,), np.uint32), self._temperature, self._top_k, self._top_p)
    self.cache = out[2]
    jax.block_until_ready(self.cache)
    return steps.total_traces() - before

  # ---------------------------------------------------------------- scheduler internals

  @staticmethod
  def _params(p: int):
    return np.zeros((p,), np.float32), np.zeros((p,), np.int32), np.ones((p,), np.float32)

  def _next_key_step(self) -> np.ndarray:
    """uint32 [2], the step count's low and high words (an int32 count overflowed after 2³¹ steps, ~87 days at
    3.5 ms a step, and failed every request from then on)."""
    self._step_counter += 1
    return np.array([self._step_counter & 0xFFFFFFFF, self._step_counter >> 32], np.uint32)

  def _end(self, handle: RequestHandle, status: str, reason: str, error=None) -> None:
    with self._cv:
      self._ids.discard(handle.request_id)
    if status == FINISHED:
      self.stats.finished += 1
    elif status == FAILED:
      self.stats.failed += 1
    else:
      self.stats.cancelled += 1
    try:
      handle._end(status, reason, error)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-exception-caught
      logging.exception("request %r: its on_finish callback raised (the request ended %s)", handle.request_id, status)

  def _deliver(self, handle: RequestHandle, token: int, now: float) -> bool:
    """Streams `token` to `handle`; if its on_token callback raises, ends that request alone. Returns whether it is
    still running."""
    try:
      handle._emit(token, now)  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-exception-caught
      error = CallbackFailed(f"request {handle.request_id!r}: its on_token callback raised {e!r}; request stopped")
      error.__cause__ = e
      self._end(handle, FAILED, "error", error)
      return False
    return True

  def _free_slot(self, slot: int) -> None:
    self._active[slot] = False
    self._slot_handle[slot] = None
    self._temperature[slot], self._top_k[slot], self._top_p[slot] = 0, 0, 1  # greedy steps skip the sort
    self._free.append(slot)

  def _fail_running(self, e: Exception, what: str = "the decode step") -> None:
    """Ends every running request with `e` (`what` raised) and frees the slots; rebuilds the slot cache if the failed
    call had consumed it (the steps donate it: an error inside the compiled call leaves its buffers deleted)."""
    logging.exception("%s raised; failing the %d running requests", what, int(self._active.sum()))
    for slot in np.flatnonzero(self._active):
      h = self._slot_handle[slot]
      self._free_slot(slot)
      error = RequestFailed(f"request {h.request_id!r}: {what} raised {e!r}")
      error.__cause__ = e
      self._end(h, FAILED, "error", error)
    if self._cache_lost():
      self.cache = self._initial_cache()

  def _cache_lost(self) -> bool:
    return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.cache))

  def _reap_cancelled(self) -> None:
    """Ends the cancelled requests, running or queued (a queued one leaves the queue at once, free slots or not)."""
    for slot in np.flatnonzero(self._active):
      h = self._slot_handle[slot]
      if h.cancelled:
        self._free_slot(slot)
        self._end(h, CANCELLED, "cancelled")
    if not self._cancel_pending:  # the queue is scanned only after some handle's cancel()
      return
    self._cancel_pending = False
    with self._cv:
      gone = [h for h in self._queue if h.cancelled]
      if gone:
        self._queue = collections.deque(h for h in self._queue if not h.cancelled)
        self._cv.notify_all()  # room in the queue for blocked submitters
    for h in gone:
      self._end(h, CANCELLED, "cancelled")

  def _take(self) -> list[RequestHandle]:
    """Pops up to min(free slots, admit_per_step) live requests from the queue."""
    taken = []
    with self._cv:
      while self._queue and len(taken) < min(len(self._free), self.config.admit_per_step):
        h = self._queue.popleft()
        if h.cancelled:
          self._end(h, CANCELLED, "cancelled")
        else:
          taken.append(h)
      self._cv.notify_all()  # room in the queue for blocked submitters
    return taken

  def _admit(self) -> None:
    taken = self._take()
    if not taken:
      return
    lengths = self.config.prefill_lengths
    groups: dict[int, list[RequestHandle]] = collections.defaultdict(list)
    for h in taken:
      n = h.request.prompt.size
      groups[next((t for t in lengths if t >= n), lengths[-1])].append(h)
    max_p = self.config.prefill_batches[-1]
    for t, hs in sorted(groups.items()):
      for i in range(0, len(hs), max_p):
        self._prefill_group(hs[i:i + max_p], t)

  def _prefill_group(self, hs: list[RequestHandle], t: int) -> None:
    """Prefills `hs` (prompts of at most bucket `t`, or chunked beyond the largest) into free slots and streams each
    request's first token; if the device work raises, the group's requests fail and their slots are returned."""
    slots = [self._free.popleft() for _ in hs]
    try:
      tok, finite, n, (temp, top_k, top_p) = self._prefill_rows(hs, t, slots)
    except Exception as e:  # pylint: disable=broad-exception-caught
      logging.exception("a prefill of %d requests raised; failing them", len(hs))
      self._free.extend(slots)
      for h in hs:
        error = RequestFailed(f"request {h.request_id!r}: its prefill raised {e!r}")
        error.__cause__ = e
        self._end(h, FAILED, "error", error)
      if self._cache_lost():  # the insert had consumed the slot cache: the running rows are gone with it
        self._fail_running(e, "a prefill's insert into the slot cache")
      return
    now = time.perf_counter()
    for i, (h, slot) in enumerate(zip(hs, slots)):
      if not finite[i]:
        self._free.append(slot)
        self._end(h, FAILED, "error", NonFiniteLogits(
            f"request {h.request_id!r}: non-finite logits after the prompt; no token was sampled"))
        continue
      h.status, h.slot = RUNNING, slot
      if not self._deliver(h, int(tok[i]), now) or self._finished(h, int(tok[i])):
        self._free.append(slot)
        continue
      self._slot_handle[slot] = h
      self._active[slot] = True
      self._tokens[slot] = tok[i]
      self._lengths[slot] = n[i]
      self._temperature[slot], self._top_k[slot], self._top_p[slot] = temp[i], top_k[i], top_p[i]

  def _prefill_rows(self, hs: list[RequestHandle], t: int, slots: list[int]):
    """The device side of `_prefill_group`: prefill (+ extend), first-token sampling and the insert into `slots`.

    Returns:
      (first tokens int32 [P], finite bool [P], prompt lengths int32 [P], per-row sampling arrays of the group).
    """
    c = self.config
    p = next(q for q in c.prefill_batches if q >= len(hs))
    n = np.ones((p,), np.int32)  # padding rows: one token, dropped at insert
    n[:len(hs)] = [h.request.prompt.size for h in hs]
    prompts = np.full((p, int(n.max())), PAD_ID % self.vocab_size, np.int32)
    for i, h in enumerate(hs):
      prompts[i, :n[i]] = h.request.prompt
    rows_slots = np.full((p,), c.num_slots, np.int32)
    rows_slots[:len(hs)] = slots
    first = np.minimum(n, t)
    chunk0 = np.full((p, t), PAD_ID % self.vocab_size, np.int32)
    chunk0[:, :min(t, prompts.shape[1])] = prompts[:, :t]
    last, rows = steps.prefill(self._flat, chunk0, first, kv_cache=c.kv_cache, cache_len=c.cache_len)
    self.stats.prefill_calls += 1
    for start in range(t, int(n.max()), t):  # chunks of prompts longer than the largest bucket (dense modes)
      chunk = np.full((p, t), PAD_ID % self.vocab_size, np.int32)
      piece = prompts[:, start:start + t]
      chunk[:, :piece.shape[1]] = piece
      valid = np.clip(n - start, 0, t).astype(np.int32)
      last, rows = steps.extend(self._flat, rows, chunk, valid, last)
      self.stats.prefill_calls += 1
    temp, top_k, top_p = self._params(p)
    for i, h in enumerate(hs):
      s = h.request.sampling
      temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
    tok, finite = steps.sample_rows(last, self._key, self._next_key_step(), temp, top_k, top_p)
    self.cache = steps.insert(self.cache, rows, rows_slots)
    return np.asarray(tok), np.asarray(finite), n, (temp, top_k, top_p)

  def _finished(self, h: RequestHandle, token: int) -> bool:
    """Ends `h` if `token` stops it or it reached max_tokens."""
    if token in h.request.stop_tokens:
      self._end(h, FINISHED, "stop")
      return True
    if len(h.tokens) >= h.request.max_tokens:
      self._end(h, FINISHED, "length")
      return True
    return False

  def _decode(self) -> None:
    t0 = time.perf_counter()
    active = self._active.copy()
    self.stats.active_per_step.append(int(active.sum()))
    self.stats.positions_per_step.append(int(self._lengths[active].sum()))
    nxt, finite, self.cache = steps.decode_slots(self._flat, self.cache, self._tokens, active, self._key,
                                                 self._next_key_step(), self._temperature, self._top_k, self._top_p)
    nxt, finite = np.asarray(nxt), np.asarray(finite)
    now = time.perf_counter()
    self.stats.decode_steps += 1
    self.stats.step_seconds.append(now - t0)
    for slot in np.flatnonzero(active):
      h = self._slot_handle[slot]
      self._lengths[slot] += 1
      if h.cancelled:
        self._free_slot(slot)
        self._end(h, CANCELLED, "cancelled")
      elif not finite[slot]:
        self._free_slot(slot)
        self._end(h, FAILED, "error", NonFiniteLogits(
            f"request {h.request_id!r}: non-finite logits at generated token {len(h.tokens)}; request stopped"))
      else:
        tok = int(nxt[slot])
        if not self._deliver(h, tok, now) or self._finished(h, tok):
          self._free_slot(slot)
        else:
          self._tokens[slot] = tok

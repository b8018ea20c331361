"""One request's life in the serving engine: validation at the boundary, its handle, and the errors it can end with.

A request is validated on the host when it is submitted (`validate_request`), so bad input raises a clear
`InvalidRequest` for that request alone and never reaches the compiled step. The engine then streams tokens into the
request's `RequestHandle`, which the client reads as an iterator (`for token in handle`), through an `on_token`
callback, or all at once (`handle.result()`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np

from moe_jax.sampling import SamplingParams


class ServingError(Exception):
  """Base of the engine's errors."""


class InvalidRequest(ServingError, ValueError):
  """The request was rejected at `submit` (bad prompt, token ids, lengths or sampling parameters)."""


class QueueFull(ServingError):
  """Back-pressure: the engine's pending queue is at `max_queue`; retry later or submit with a timeout."""


class RequestFailed(ServingError):
  """The request was admitted but could not finish (e.g. non-finite logits); `handle.error` holds the reason."""


class NonFiniteLogits(RequestFailed):
  """The model produced NaN/inf logits for this request; no token was sampled from them."""


class CallbackFailed(RequestFailed):
  """The request's `on_token` callback raised; the request was stopped (other requests are unaffected)."""


@dataclasses.dataclass(frozen=True, repr=False)
class AutoId:
  """An engine-assigned request id: never equal to an id a caller chooses (an int, a string, ...)."""

  n: int

  def __repr__(self) -> str:
    return f"auto-{self.n}"


_ids = itertools.count()

# Statuses and finish reasons.
QUEUED, RUNNING, FINISHED, FAILED, CANCELLED = "queued", "running", "finished", "failed", "cancelled"
_END = object()  # end-of-stream marker in a handle's token queue


@dataclasses.dataclass(frozen=True)
class Request:
  """A validated request.

  Attributes:
    prompt: int32 [T] prompt token ids (1 <= T).
    max_tokens: tokens to generate at most (>= 1).
    sampling: per-request sampling settings.
    stop_tokens: generation stops after emitting any of these (the stop token is returned).
    request_id: the caller's id (unique per engine), or an engine-assigned `AutoId`.
  """

  prompt: np.ndarray
  max_tokens: int
  sampling: SamplingParams
  stop_tokens: frozenset[int]
  request_id: object


def _first_boolean(prompt) -> str | None:
  """The first boolean in a list prompt, described (numpy would take it as token 0 or 1), or None."""
  if isinstance(prompt, (list, tuple)):
    for i, t in enumerate(prompt):
      if isinstance(t, (bool, np.bool_)):
        return f"the boolean {t!r} at prompt[{i}]"
  return None


def validate_request(prompt, *, max_tokens: int, sampling, stop_tokens: Sequence[int], vocab_size: int,
                     cache_len: int, max_prompt_len: int, request_id=None) -> Request:
  """Checks one request against the engine's limits; raises `InvalidRequest` with a message naming the field.

  Args:
    prompt: sequence of int token ids.
    max_tokens: new tokens at most.
    sampling: `SamplingParams` or a dict of its fields.
    stop_tokens: ids that end the request.
    vocab_size: V of the model.
    cache_len: positions one slot holds; prompt + max_tokens - 1 must fit (the last new token is never fed back).
    max_prompt_len: longest prompt the engine's prefill accepts.
  """
  try:
    arr = np.asarray(prompt)
  except Exception as e:  # ragged nested lists and the like.
    raise InvalidRequest(f"prompt must be a flat list of token ids: {e}") from e
  if arr.ndim != 1:
    raise InvalidRequest(f"prompt must be a flat list of token ids, got shape {arr.shape}")
  if arr.size == 0:
    raise InvalidRequest("empty prompt: a request needs at least one prompt token")
  boolean = _first_boolean(prompt)
  if boolean is not None or not np.issubdtype(arr.dtype, np.integer):
    raise InvalidRequest(f"prompt token ids must be integers, got {boolean or f'dtype {arr.dtype}'}")
  bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
  if bad.size:
    raise InvalidRequest(f"token id {int(arr[bad[0]])} at prompt[{int(bad[0])}] is outside the vocabulary "
                         f"[0, vocab_size={vocab_size})")
  if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < 1:
    raise InvalidRequest(f"max_tokens={max_tokens!r} must be an int >= 1")
  if arr.size > max_prompt_len:
    raise InvalidRequest(f"prompt too long: {arr.size} tokens > the engine's longest prompt {max_prompt_len}")
  if arr.size + int(max_tokens) - 1 > cache_len:  # every new token but the last is fed back
    raise InvalidRequest(f"prompt too long for the context: prompt {arr.size} + max_tokens {int(max_tokens)} - 1 "
                         f"> cache_len={cache_len}")
  if isinstance(sampling, dict):
    try:
      sampling = SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
      raise InvalidRequest(f"invalid sampling parameters: {e}") from e
  elif sampling is None:
    sampling = SamplingParams()
  elif not isinstance(sampling, SamplingParams):
    raise InvalidRequest(f"sampling must be a SamplingParams or a dict, got {type(sampling).__name__}")
  if stop_tokens is not None and (isinstance(stop_tokens, (str, bytes, int, np.integer))
                                  or not isinstance(stop_tokens, collections.abc.Iterable)):
    raise InvalidRequest(f"stop_tokens={stop_tokens!r} must be a list of token ids")
  stops = []
  for s in stop_tokens or ():
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or not 0 <= s < vocab_size:
      raise InvalidRequest(f"stop token {s!r} must be an int in [0, vocab_size={vocab_size})")
    stops.append(int(s))
  try:
    hash(request_id)
  except TypeError:
    raise InvalidRequest(f"request_id={request_id!r} must be hashable (a str or an int)") from None
  return Request(prompt=arr.astype(np.int32), max_tokens=int(max_tokens), sampling=sampling,
                 stop_tokens=frozenset(stops), request_id=AutoId(next(_ids)) if request_id is None else request_id)


class RequestHandle:
  """What `Engine.submit` returns: the request's status, its tokens as they stream in, and timing for metrics.

  Iterating yields token ids as the engine produces them and ends when the request ends; it raises the request's
  error if it failed. With an engine that is stepped by the caller (no background thread), iteration steps it.

  Attributes:
    request: the validated `Request`.
    tokens: int token ids generated so far.
    status: "queued", "running", "finished", "failed" or "cancelled".
    finish_reason: "stop", "length", "cancelled" or "error" once ended.
    error: the exception of a failed request.
    submit_time, first_token_time, token_times: `time.perf_counter()` stamps.
  """

  def __init__(self, request: Request, engine, on_token: Callable[[int], None] | None = None,
               on_finish: Callable[["RequestHandle"], None] | None = None):
    self.request = request
    self.tokens: list[int] = []
    self.status = QUEUED
    self.finish_reason: str | None = None
    self.error: BaseException | None = None
    self.submit_time = time.perf_counter()
    self.first_token_time: float | None = None
    self.token_times: list[float] = []
    self.slot: int | None = None
    self._engine = engine
    self._on_token = on_token
    self._on_finish = on_finish
    self._cancel = threading.Event()
    self._done = threading.Event()
    self._stream: queue.SimpleQueue = queue.SimpleQueue()

  @property
  def request_id(self):
    return self.request.request_id

  @property
  def done(self) -> bool:
    return self._done.is_set()

  @property
  def cancelled(self) -> bool:
    return self._cancel.is_set()

  def cancel(self) -> None:
    """Asks the engine to stop this request; it ends with status "cancelled" at the engine's next step."""
    self._cancel.set()
    if self._engine is not None:
      self._engine._cancel_pending = True  # pylint: disable=protected-access

  # Called by the engine only.
  def _emit(self, token: int, now: float) -> None:
    if self.first_token_time is None:
      self.first_token_time = now
    self.tokens.append(token)
    self.token_times.append(now)
    self._stream.put(token)
    if self._on_token is not None:
      self._on_token(token)

  def _end(self, status: str, reason: str, error: BaseException | None = None) -> None:
    if self._done.is_set():
      raise RuntimeError(f"request {self.request_id!r} ended twice")  # The load test relies on this check.
    self.status, self.finish_reason, self.error = status, reason, error
    self._done.set()
    self._stream.put(_END)
    if self._on_finish is not None:
      self._on_finish(self)

  def wait(self, timeout: float | None = None) -> bool:
    """Blocks until the request ends (stepping a caller-driven engine); returns whether it ended."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    if not self._done.is_set() and self._engine is not None:
      self._engine.check_not_in_callback()
    while not self._done.is_set():
      if self._engine is not None and not self._engine.running:
        if not self._engine.step() and not self._done.is_set():
          raise RuntimeError("engine is idle but the request has not ended")
      else:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
          return False
        self._done.wait(0.05 if left is None else min(left, 0.05))
      if deadline is not None and time.perf_counter() > deadline:
        return self._done.is_set()
    return True

  def result(self, timeout: float | None = None) -> list[int]:
    """All generated tokens; raises the request's error if it failed (`RequestFailed`)."""
    if not self.wait(timeout):
      raise TimeoutError(f"request {self.request_id!r} did not end within {timeout} s")
    if self.error is not None:
      raise self.error
    return list(self.tokens)

  def __iter__(self):
    if not self._done.is_set() and self._engine is not None:
      self._engine.check_not_in_callback()
    while True:
      if self._stream.empty() and not self._done.is_set() and self._engine is not None \
          and not self._engine.running:  # caller-driven (or stopped mid-request): this caller steps it
        if not self._engine.step() and self._stream.empty() and not self._done.is_set():
          raise RuntimeError("engine is idle but the request has not ended")
        continue
      try:  # a background engine: re-check every 50 ms that it still runs
        item = self._stream.get(timeout=0.05)
      except queue.Empty:
        continue
      if item is _END:
        if self.error is not None:
          raise self.error
        return
      yield item

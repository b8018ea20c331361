"""The serving engine under load and under bad input, on the tiny model in float32 on CPU.

Every engine here has the same shapes (312 slots, cache_len 32, prefill buckets 8/16 × 8/64 rows), so the module-level
jitted steps compile once, in the fixture's warm-up, and every later test checks that nothing compiles again.
References are "each request alone": greedy prefill + decode through `moe_jax.decode` on a ragged batch (rows are
independent, so a ragged batch equals per-request runs), run in fixed-size chunks so they compile once too.
"""

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import decode, generate
from moe_jax.serving import (AutoId, CallbackFailed, Engine, EngineConfig, InvalidRequest, NonFiniteLogits, QueueFull,
                             RequestFailed, steps)

CACHE_LEN = 32
MAX_NEW = 8
# The module's engine is warmed once, and later tests assert that new engines trace nothing new: jax's caches must
# not be cleared between them (tests/map_budget.py).
pytestmark = pytest.mark.keep_jax_caches
MAX_PROMPT = 24
REF_ROWS = 128
CONFIG = EngineConfig(num_slots=312, cache_len=CACHE_LEN, kv_cache="fp32", prefill_lengths=(8, 16),
                      prefill_batches=(8, 64), max_queue=1000, max_prefill_rows=312)


class CompileEvents:
  """Counts XLA backend compiles (jax.monitoring) while active."""

  def __init__(self):
    self.count, self.on = 0, False
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event, duration, **kwargs):
    del duration, kwargs
    if self.on and event == "/jax/core/compile/backend_compile_duration":
      self.count += 1


@pytest.fixture(scope="module")
def compiles():
  return CompileEvents()


@pytest.fixture(scope="module")
def engine(tiny_model):
  eng = Engine(tiny_model, CONFIG)
  assert eng.warmup() > 0
  return eng


@pytest.fixture(scope="module")
def good_reference(tiny_model):
  good = [[5, 6, 7], list(range(20, 40))]
  return good, reference(tiny_model, good)


def reference(model, prompts, max_new=MAX_NEW):
  """Greedy continuation of each prompt alone: int [len(prompts), max_new]."""
  out = []
  for i in range(0, len(prompts), REF_ROWS):
    chunk = [list(p) for p in prompts[i:i + REF_ROWS]]
    chunk += [[0]] * (REF_ROWS - len(chunk))
    tokens, lengths = generate.pad_batch(chunk)
    tokens = np.pad(tokens, ((0, 0), (0, MAX_PROMPT - tokens.shape[1])))
    logits, cache = decode.prefill(model, tokens, lengths, kv_cache="fp32", cache_len=CACHE_LEN)
    last = generate.last_logits(logits, jnp.asarray(lengths))
    tok = np.asarray(jnp.argmax(last, -1))
    rows = [tok]
    for _ in range(max_new - 1):
      lg, cache = decode.decode_step(model, cache, tok.astype(np.int32))
      tok = np.asarray(jnp.argmax(lg, -1))
      rows.append(tok)
    out.append(np.stack(rows, 1)[:len(prompts[i:i + REF_ROWS])])
  return np.concatenate(out)


def expected(ref_row, max_tokens, stops=()):
  out = []
  for t in ref_row[:max_tokens]:
    out.append(int(t))
    if t in stops:
      break
  return out


def test_1000_requests_at_concurrency_312_complete_once_and_match_alone(engine, tiny_model, compiles):
  rng = np.random.default_rng(1)
  n = 1000
  prompts = [rng.integers(0, 256, rng.integers(1, MAX_PROMPT + 1)).tolist() for _ in range(n)]
  max_tokens = rng.integers(1, MAX_NEW + 1, n)
  ref = reference(tiny_model, prompts)
  stops = [tuple(int(t) for t in rng.choice(ref[i], 1)) if i % 4 == 0 else () for i in range(n)]
  sampled = set(range(5, n, 10))  # every 10th request samples (per-row params in the same step as greedy rows)
  finished, tokens_cb = [], {i: [] for i in range(n)}
  before, compiles.on = steps.total_traces(), True
  handles = []
  for i in range(n):
    sampling = {"temperature": 0.8, "top_k": 5} if i in sampled else None
    handles.append(engine.submit(prompts[i], max_tokens=int(max_tokens[i]), stop_tokens=stops[i], request_id=i,
                                 sampling=sampling, on_token=tokens_cb[i].append, on_finish=finished.append))
  engine.run_until_idle()
  compiles.on = False
  assert steps.total_traces() == before, f"recompiled after warm-up: {dict(steps.TRACES)}"
  assert compiles.count == 0
  assert sorted(h.request_id for h in finished) == list(range(n))  # each exactly once (a second end raises)
  # The load really ran ~312 streams at once (requests that end on their first token leave at prefill).
  assert max(engine.stats.active_per_step) >= 0.9 * CONFIG.num_slots
  for i, h in enumerate(handles):
    assert h.status == "finished", (i, h.status, h.error)
    assert tokens_cb[i] == h.tokens
    if i in sampled:
      assert 1 <= len(h.tokens) <= max_tokens[i] and all(0 <= t < 264 for t in h.tokens)
    else:
      assert h.tokens == expected(ref[i], max_tokens[i], stops[i]), i
      assert h.finish_reason == ("stop" if h.tokens[-1] in stops[i] else "length")
  assert engine.num_active == 0 and engine.num_queued == 0


def test_requests_that_fill_the_cache_exactly_run_and_match_generate(engine, tiny_model):
  """The last new token is never fed back, so a request needs prompt + max_tokens - 1 positions, as `generate` does
  (before, the engine asked one more: a 32-token prompt could not get a token from a 32-position slot)."""
  rng = np.random.default_rng(7)
  for n, max_tokens in [(CACHE_LEN, 1), (CACHE_LEN - 3, 4), (9, CACHE_LEN - 8)]:
    prompt = rng.integers(0, 256, n).tolist()
    assert n + max_tokens - 1 == CACHE_LEN
    h = engine.submit(prompt, max_tokens=max_tokens)
    engine.run_until_idle()
    ref = generate.generate(tiny_model, np.array([prompt], np.int32), np.array([n], np.int32), key=jax.random.key(0),
                            max_new_tokens=max_tokens, kv_cache="fp32", cache_len=CACHE_LEN)
    assert h.status == "finished" and h.finish_reason == "length", (n, h.status, h.error)
    assert h.tokens == np.asarray(ref.tokens)[0].tolist(), n
  with pytest.raises(InvalidRequest, match=r"prompt 30 \+ max_tokens 4 - 1 > cache_len=32"):
    engine.submit([1] * 30, max_tokens=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[], max_tokens=2), "empty prompt"),
    (dict(prompt=[1] * 40, max_tokens=2), "prompt too long"),
    (dict(prompt=[1] * 30, max_tokens=4), "prompt too long for the context"),
    (dict(prompt=[1, 300, 2], max_tokens=2), "token id 300 at prompt[1]"),
    (dict(prompt=[1, -1], max_tokens=2), "token id -1"),
    (dict(prompt=[1.5, 2.0], max_tokens=2), "must be integers"),
    (dict(prompt=[[1, 2], [3, 4]], max_tokens=2), "flat list"),
    (dict(prompt=[1, 2], max_tokens=0), "max_tokens=0"),
    (dict(prompt=[1, 2], max_tokens=2, sampling={"temperature": -1.0}), "temperature=-1.0"),
    (dict(prompt=[1, 2], max_tokens=2, sampling={"top_p": 0.0}), "top_p=0.0"),
    (dict(prompt=[1, 2], max_tokens=2, sampling={"top_k": 2.5}), "top_k=2.5"),
    (dict(prompt=[1, 2], max_tokens=2, sampling={"top_k": 2**31}), "top_k=2147483648"),  # before: the engine crashed
    (dict(prompt=[1, 2], max_tokens=2, sampling={"temperature": 1e39}), "temperature=1e"),  # before: inf in float32
    (dict(prompt=[1, 2], max_tokens=2, sampling={"beam": 4}), "invalid sampling parameters"),
    (dict(prompt=[1, 2], max_tokens=2, stop_tokens=[999]), "stop token 999"),
    (dict(prompt=[1, 2], max_tokens=2, stop_tokens=5), "stop_tokens=5 must be a list"),  # before: a bare TypeError
    (dict(prompt=[1, 2], max_tokens=2, request_id=["a"]), "request_id=['a'] must be hashable"),  # before: TypeError
])
def test_bad_request_is_rejected_and_others_continue(engine, good_reference, kwargs, message):
  good, ref = good_reference
  before = engine.submit(good[0], max_tokens=MAX_NEW)
  with pytest.raises(InvalidRequest, match=message.replace("[", r"\[")):
    engine.submit(**kwargs)
  after = engine.submit(good[1], max_tokens=MAX_NEW)
  engine.run_until_idle()
  assert before.result() == ref[0].tolist() and after.result() == ref[1].tolist()


def test_duplicate_request_id_is_rejected(engine):
  h = engine.submit([1, 2], max_tokens=1, request_id="dup")
  with pytest.raises(InvalidRequest, match="already in use"):
    engine.submit([1, 2], max_tokens=1, request_id="dup")
  engine.run_until_idle()
  assert h.status == "finished"
  engine.submit([1, 2], max_tokens=1, request_id="dup").result()  # free again once it ended


def test_engine_assigned_ids_never_clash_with_the_callers(engine):
  mine = engine.submit([1, 2], max_tokens=1, request_id=1)
  auto = [engine.submit([1, 2], max_tokens=1) for _ in range(3)]  # before: one got the int 1 and was refused
  assert all(isinstance(h.request_id, AutoId) for h in auto) and len({h.request_id for h in auto}) == 3
  engine.run_until_idle()
  assert all(h.status == "finished" for h in [mine, *auto])


def test_a_raising_callback_fails_its_own_request_only(engine, tiny_model):
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, rng.integers(1, MAX_PROMPT + 1)).tolist() for _ in range(12)]
  ref = reference(tiny_model, prompts)

  def third_token_raises(token, seen=[]):  # noqa: B006  pylint: disable=dangerous-default-value
    seen.append(token)
    if len(seen) == 3:
      raise KeyError("client bug")

  def on_finish_raises(handle):
    raise RuntimeError(f"client bug at the end of {handle.request_id}")

  bad = engine.submit(prompts[0], max_tokens=MAX_NEW, on_token=third_token_raises)
  bad_end = engine.submit(prompts[1], max_tokens=MAX_NEW, on_finish=on_finish_raises)
  others = [engine.submit(p, max_tokens=MAX_NEW) for p in prompts[2:]]
  engine.run_until_idle()  # before: the step raised part-way, and the other slots were fed stale tokens
  assert bad.status == "failed" and isinstance(bad.error, CallbackFailed) and bad.tokens == ref[0, :3].tolist()
  assert isinstance(bad.error.__cause__, KeyError)
  assert bad_end.status == "finished" and bad_end.tokens == ref[1].tolist()  # on_finish raising is only logged
  assert [h.result() for h in others] == ref[2:].tolist()
  assert engine.num_active == 0 and len(engine._free) == CONFIG.num_slots  # pylint: disable=protected-access


def test_a_raising_device_step_fails_its_requests_and_the_engine_goes_on(engine, tiny_model, monkeypatch):
  ref = reference(tiny_model, [[5, 6, 7], [8, 9]])
  real = {"prefill": steps.prefill, "decode_slots": steps.decode_slots}
  fail = {"prefill": 0, "decode_slots": 0}

  def flaky(name):
    def call(*args, **kwargs):
      if fail[name]:
        fail[name] -= 1
        raise RuntimeError(f"injected {name} failure")
      return real[name](*args, **kwargs)
    return call

  for name in real:
    monkeypatch.setattr(steps, name, flaky(name))
  fail["prefill"] = 1
  lost = engine.submit([5, 6, 7], max_tokens=MAX_NEW)
  engine.run_until_idle()
  assert lost.status == "failed" and isinstance(lost.error, RequestFailed) and "prefill raised" in str(lost.error)
  running = engine.submit([5, 6, 7], max_tokens=MAX_NEW)
  engine.step()  # prefill (the first token) and one decode step
  fail["decode_slots"] = 1
  engine.run_until_idle()
  assert running.status == "failed" and "decode step raised" in str(running.error)
  assert running.tokens == ref[0, :2].tolist()
  assert len(engine._free) == CONFIG.num_slots  # pylint: disable=protected-access
  after = [engine.submit(p, max_tokens=MAX_NEW) for p in ([5, 6, 7], [8, 9])]
  engine.run_until_idle()
  assert [h.result() for h in after] == ref.tolist()


def test_a_device_error_after_donation_rebuilds_the_slot_cache(engine, tiny_model, monkeypatch):
  """An error raised inside the compiled decode step (here a host callback, as an asynchronous device error would
  surface) comes after the step consumed the donated slot cache; before, every later request then failed with
  "Array has been deleted"."""
  ref = reference(tiny_model, [[5, 6, 7], [8, 9]])
  fail = {"n": 0}

  def boom(x):
    if fail["n"]:
      fail["n"] -= 1
      raise RuntimeError("injected device failure")
    return x

  inner = steps.decode_slots.__wrapped__

  @functools.partial(jax.jit, donate_argnums=(1,))
  def flaky_decode(model, cache, *args):
    nxt, finite, new = inner(model, cache, *args)
    return jax.pure_callback(boom, jax.ShapeDtypeStruct(nxt.shape, nxt.dtype), nxt), finite, new

  monkeypatch.setattr(steps, "decode_slots", flaky_decode)
  running = engine.submit([5, 6, 7], max_tokens=MAX_NEW)
  engine.step()
  fail["n"] = 1
  engine.run_until_idle()
  assert running.status == "failed" and "decode step raised" in str(running.error)
  after = [engine.submit(p, max_tokens=MAX_NEW) for p in ([5, 6, 7], [8, 9])]
  engine.run_until_idle()
  assert [h.result() for h in after] == ref.tolist()
  assert len(engine._free) == CONFIG.num_slots  # pylint: disable=protected-access


def test_callbacks_may_not_step_or_wait(engine, tiny_model):
  """A callback runs inside the step: stepping there (directly, or through another request's `result()`) re-entered
  `step` and fed the other slots stale tokens; it now raises, which fails or is logged like any raising callback."""
  ref = reference(tiny_model, [[9, 8, 7], [1, 2, 3]])
  waited = []

  def on_finish(_):
    follow = engine.submit([4, 4, 4], max_tokens=3)
    try:
      follow.result()
    except RuntimeError as e:
      waited.append(e)

  def on_token(_):
    engine.step()

  a = engine.submit([1, 2, 3], max_tokens=2, on_finish=on_finish)
  b = engine.submit([9, 8, 7], max_tokens=MAX_NEW)
  c = engine.submit([1, 2, 3], max_tokens=MAX_NEW, on_token=on_token)
  engine.run_until_idle()
  assert b.result() == ref[0].tolist() and a.result() == ref[1, :2].tolist()
  assert len(waited) == 1 and "may not step the engine or wait" in str(waited[0])
  assert c.status == "failed" and isinstance(c.error.__cause__, RuntimeError) and c.tokens == ref[1, :1].tolist()


def test_a_cancelled_queued_request_leaves_at_the_next_step_with_every_slot_busy(tiny_model):
  eng = Engine(tiny_model, dataclasses.replace(CONFIG, num_slots=1, max_queue=1))
  busy = eng.submit([1, 2, 3], max_tokens=MAX_NEW)
  eng.step()
  queued = eng.submit([4, 5], max_tokens=2)
  queued.cancel()
  eng.step()  # before: it stayed queued (and held the queue's one place) until the slot came free
  assert queued.status == "cancelled" and queued.done
  late = eng.submit([4, 5], max_tokens=2)  # before: QueueFull
  eng.run_until_idle()
  assert busy.status == "finished" and late.status == "finished"


def test_iterating_a_request_survives_stopping_the_engine(tiny_model):
  """After `stop()` the engine is caller-driven: `result()` stepped it, but an iterator blocked forever."""
  eng = Engine(tiny_model, dataclasses.replace(CONFIG, num_slots=2, cache_len=64))
  eng.start()
  h = eng.submit([1, 2, 3], max_tokens=40)
  got, done = [], threading.Event()

  def reader():
    got.extend(h)
    done.set()

  threading.Thread(target=reader, daemon=True).start()
  deadline = time.monotonic() + 60
  while len(h.tokens) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
  eng.stop()
  assert done.wait(60), "the iterator hung after stop()"
  assert h.status == "finished" and got == h.tokens and len(got) == 40


def test_a_freed_slot_forgets_its_sampling_parameters(engine):
  h = engine.submit([1, 2, 3], max_tokens=3, sampling={"temperature": 0.9, "top_k": 5, "top_p": 0.5})
  engine.run_until_idle()
  assert h.status == "finished"
  # pylint: disable=protected-access
  assert not engine._temperature.any() and not engine._top_k.any() and (engine._top_p == 1).all()


def test_the_step_count_goes_past_int32(engine, good_reference):
  """Before: the key's step count was an int32; at 2³¹ steps (~87 days at 3.5 ms) np.int32 overflowed and every
  request failed from then on. Greedy requests still match the reference past 2³¹ and 2³²."""
  good, ref = good_reference
  for start in (2**31 - 3, 2**32 - 2):
    engine._step_counter = start  # pylint: disable=protected-access
    handles = [engine.submit(p, max_tokens=MAX_NEW) for p in good]
    handles.append(engine.submit([3, 4], max_tokens=4, sampling={"temperature": 1.0}))
    engine.run_until_idle()
    assert all(h.status == "finished" for h in handles), [(h.status, h.error) for h in handles]
    assert [h.tokens for h in handles[:2]] == [expected(r, MAX_NEW) for r in ref]
    assert engine._step_counter > start + 4  # pylint: disable=protected-access


def test_full_queue_gives_back_pressure(tiny_model):
  eng = Engine(tiny_model, dataclasses.replace(CONFIG, max_queue=3))
  handles = [eng.submit([1, 2, 3], max_tokens=2) for _ in range(3)]
  with pytest.raises(QueueFull, match="max_queue=3"):
    eng.submit([1, 2, 3], max_tokens=2)
  with pytest.raises(QueueFull, match="max_queue=3"):
    eng.submit([1, 2, 3], max_tokens=2, block=True, timeout=0)
  eng.step()  # admits the queued requests into slots: room again
  handles.append(eng.submit([1, 2, 3], max_tokens=2))
  handles += [eng.submit([1, 2, 3], max_tokens=2) for _ in range(2)]  # the queue is full again
  # Blocking on a caller-driven engine (no thread steps it) steps it, as a handle's wait does: before, it waited
  # forever for room that only a step could make.
  handles.append(eng.submit([1, 2, 3], max_tokens=2, block=True))
  assert eng.num_queued <= 3
  eng.run_until_idle()
  assert all(h.status == "finished" and len(h.tokens) == 2 for h in handles)
  # A blocked submitter gets in once a background engine drains the queue.
  blocked = [eng.submit([4, 5], max_tokens=2) for _ in range(3)]
  eng.start()
  try:
    late = eng.submit([4, 5], max_tokens=2, block=True, timeout=30)
    assert late.result(timeout=30) == blocked[0].result(timeout=30)
  finally:
    eng.stop()


def test_nan_logits_fail_that_request_only(tiny_model, engine):
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 256, rng.integers(2, MAX_PROMPT + 1)).tolist() for _ in range(40)]
  ref = reference(tiny_model, prompts)
  poison = int(ref[0, 0])  # request 0's first token: it fails at the decode step that feeds it back
  clean = [i for i in range(1, 40) if poison not in prompts[i] and poison not in ref[i]]
  assert len(clean) >= 10
  model = nnx.clone(tiny_model)
  model.embedding.set_value(model.embedding.get_value().at[poison].set(jnp.nan))  # any path through it gives NaN
  eng = Engine(model, CONFIG)
  before = steps.total_traces()
  first = eng.submit(prompts[0], max_tokens=MAX_NEW)
  in_prompt = eng.submit(prompts[1][:3] + [poison], max_tokens=MAX_NEW)
  others = {i: eng.submit(prompts[i], max_tokens=MAX_NEW) for i in clean}
  eng.run_until_idle()
  assert first.status == "failed" and isinstance(first.error, NonFiniteLogits) and first.tokens == [poison]
  assert in_prompt.status == "failed" and isinstance(in_prompt.error, NonFiniteLogits) and in_prompt.tokens == []
  with pytest.raises(NonFiniteLogits, match="non-finite logits"):
    in_prompt.result()
  for i, h in others.items():
    assert h.result() == ref[i].tolist(), i
  # Slots that held NaN are reused cleanly.
  again = {i: eng.submit(prompts[i], max_tokens=MAX_NEW) for i in clean}
  eng.run_until_idle()
  assert all(h.result() == ref[i].tolist() for i, h in again.items())
  assert steps.total_traces() == before


def test_cancellation_running_and_queued(engine, tiny_model):
  running = engine.submit([9, 8, 7], max_tokens=20)
  queued = engine.submit([1, 2, 3], max_tokens=20)
  other = engine.submit([4, 5, 6], max_tokens=MAX_NEW)
  queued.cancel()
  engine.step()
  engine.step()
  running.cancel()
  engine.run_until_idle()
  assert running.status == "cancelled" and 1 <= len(running.tokens) < 20
  assert queued.status == "cancelled" and queued.tokens == []
  assert other.result() == reference(tiny_model, [[4, 5, 6]])[0].tolist()


def test_streaming_iterator_callback_and_background_thread(engine, tiny_model):
  ref = reference(tiny_model, [[3, 1, 4, 1, 5]])[0].tolist()
  seen = []
  h = engine.submit([3, 1, 4, 1, 5], max_tokens=MAX_NEW, on_token=seen.append)
  assert list(h) == ref == seen  # iterating a caller-driven engine steps it
  engine.start()
  try:
    assert engine.running
    handles = [engine.submit([3, 1, 4, 1, 5], max_tokens=MAX_NEW) for _ in range(5)]
    outs = []
    threads = [threading.Thread(target=lambda h=h: outs.append(list(h))) for h in handles]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
    assert outs == [ref] * 5
  finally:
    engine.stop()
  assert not engine.running


@pytest.mark.parametrize("change, message", [
    (dict(num_slots=0), "num_slots=0"),
    (dict(prefill_lengths=(16, 8)), "strictly increasing"),
    (dict(prefill_lengths=(8, 64)), "must all be <= cache_len=32"),
    (dict(kv_cache="nope"), "kv_cache='nope'"),
    (dict(max_prefill_rows=-1), "max_prefill_rows=-1"),
    (dict(kv_cache="oskvp", chunked_prefill=True), "chunked_prefill=True needs a dense kv_cache"),  # before: padding
    (dict(kv_cache="kivi2", chunked_prefill=True), "not kv_cache='kivi2'"),  # stored as tokens, wrong outputs
])
def test_engine_config_errors_name_the_field(change, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, **change)


def test_long_prompt_is_prefilled_in_chunks(engine, tiny_model):
  prompt = list(range(100, 123))  # 23 tokens > the largest bucket (16): one bucket + one chunk
  calls = engine.stats.prefill_calls
  h = engine.submit(prompt, max_tokens=MAX_NEW)
  engine.run_until_idle()
  assert engine.stats.prefill_calls == calls + 2
  assert h.result() == reference(tiny_model, [prompt])[0].tolist()


def test_compressed_cache_mode_matches_alone(tiny_model):
  """The engine over an int8 per-token cache (chunking off: compressed modes prefill in one shot) equals each
  request decoded alone in the same mode."""
  config = EngineConfig(num_slots=4, cache_len=CACHE_LEN, kv_cache="int8", prefill_lengths=(16,),
                        prefill_batches=(4,), max_queue=16)
  assert not config.chunked and config.max_prompt_len == 16
  eng = Engine(tiny_model, config)
  eng.warmup()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, rng.integers(1, 17)).tolist() for _ in range(4)]
  max_tokens = [8, 3, 6, 1]
  before = steps.total_traces()
  handles = [eng.submit(p, max_tokens=m) for p, m in zip(prompts * 2, max_tokens * 2)]  # 8 requests, 4 slots
  eng.run_until_idle()
  assert steps.total_traces() == before
  tokens, lengths = generate.pad_batch(prompts)
  logits, cache = decode.prefill(tiny_model, tokens, lengths, kv_cache="int8", cache_len=CACHE_LEN)
  last = generate.last_logits(logits, jnp.asarray(lengths))
  tok = np.asarray(jnp.argmax(last, -1))
  ref = [tok]
  for _ in range(MAX_NEW - 1):
    lg, cache = decode.decode_step(tiny_model, cache, tok.astype(np.int32))
    tok = np.asarray(jnp.argmax(lg, -1))
    ref.append(tok)
  ref = np.stack(ref, 1)
  for i, h in enumerate(handles):
    assert h.result() == ref[i % 4, :max_tokens[i % 4]].tolist(), i
  with pytest.raises(InvalidRequest, match="longest prompt 16"):
    eng.submit(list(range(17)), max_tokens=2)


def test_oskvp_short_prompts_refit_in_their_slot_and_free_slots_never_do(tiny_model):
  """OS-KVP with a window of 8 (`refit_at_first_flush`): every slot of the initial cache is a copy of a 1-token
  prefill, flagged to refit, and a decode step clears the flags of free slots (warm-up's, every slot free, clears
  them all; before, the free slots all refitted at one step on idle tokens, 35-500 ms against ~1 ms); a request with
  a 3-token prompt keeps its flag until its window is first full, is refitted then and only then, and its tokens
  equal the same request decoded alone."""
  from moe_jax.kv_cache import KV_CACHE_MODES, register_kv_cache_mode  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_quant import OSKVPMode  # pylint: disable=g-import-not-at-top
  if "oskvp_window8" not in KV_CACHE_MODES:
    register_kv_cache_mode("oskvp_window8", OSKVPMode(window=8, implementation="xla"))
  eng = Engine(tiny_model, EngineConfig(num_slots=4, cache_len=CACHE_LEN, kv_cache="oskvp_window8",
                                        prefill_lengths=(16,), prefill_batches=(1,), max_queue=4))
  eng.warmup()
  assert not np.asarray(eng.cache.layers[0].refit).any()
  prompt, max_tokens = [5, 17, 42], 12
  before = steps.total_traces()
  h = eng.submit(prompt, max_tokens=max_tokens)
  eng.step()
  slot = int(np.flatnonzero(eng._active)[0])  # pylint: disable=protected-access
  free = [s for s in range(4) if s != slot]
  layer = eng.cache.layers[0]
  np.testing.assert_array_equal(np.asarray(layer.refit), np.arange(4) == slot)
  u_free = np.asarray(layer.u_k)[free]
  flags = []
  while not h.done:
    eng.step()
    flags.append(bool(eng.cache.layers[0].refit[slot]))
  assert steps.total_traces() == before
  # 3 + 1 tokens after the first step; the window is full after 4 more and flushed (refitted) at the step after
  assert flags[:4] == [True] * 4 and not any(flags[5:]), flags
  layer = eng.cache.layers[0]
  np.testing.assert_array_equal(np.asarray(layer.u_k)[free], u_free)  # no idle refit
  assert not np.allclose(np.asarray(layer.u_k)[slot], np.eye(layer.u_k.shape[-1]))  # the request's was fitted
  logits, cache = decode.prefill(tiny_model, np.asarray([prompt]), np.asarray([3]), kv_cache="oskvp_window8",
                                 cache_len=CACHE_LEN, last_only=True)
  ref = [int(jnp.argmax(logits[0]))]
  for _ in range(max_tokens - 1):
    lg, cache = decode.decode_step(tiny_model, cache, np.asarray([ref[-1]], np.int32))
    ref.append(int(jnp.argmax(lg[0])))
  assert h.result() == ref


def test_warmup_refuses_a_busy_engine(tiny_model):
  """warmup's decode step runs every slot as inactive: it kept their lengths but moved a compressed cache's state
  on (kivi2 / OS-KVP requests in flight decoded differently after it), so it now needs an idle engine."""
  eng = Engine(tiny_model, CONFIG)
  h = eng.submit([1, 2, 3], max_tokens=4)
  with pytest.raises(RuntimeError, match=r"warmup\(\) needs an idle engine \(1 queued, 0 active\)"):
    eng.warmup()
  eng.step()
  with pytest.raises(RuntimeError, match=r"needs an idle engine \(0 queued, 1 active\)"):
    eng.warmup()
  eng.run_until_idle()
  assert h.status == "finished" and eng.warmup() >= 0


def test_a_blocking_submit_in_a_callback_is_refused_and_one_blocked_over_a_stop_gets_in(tiny_model):
  """On a started engine: a blocking submit inside on_finish (the engine's own thread) waited for room only that
  thread could make, and the engine hung; a submit blocked when stop() came never noticed the engine had become
  caller-driven, and hung."""
  eng = Engine(tiny_model, dataclasses.replace(CONFIG, num_slots=1, max_queue=1))
  errors = []

  def follow_up(handle):
    try:
      eng.submit([4, 5], max_tokens=2, block=True)
    except RuntimeError as e:
      errors.append(str(e))

  eng.start()
  try:
    first = eng.submit([1, 2, 3], max_tokens=20, on_finish=follow_up)
    while eng.num_active == 0:  # admitted: the slot is busy
      time.sleep(0.005)
    other = eng.submit([6, 7], max_tokens=4)  # the queue is full until the step after `first` finishes
    assert first.wait(120) and other.wait(120), "the engine hung"
  finally:
    eng.stop()
  assert errors and "may not step the engine or wait" in errors[0], errors

  eng.start()
  eng.submit([1, 2, 3], max_tokens=25)
  while True:
    try:
      eng.submit([6, 7], max_tokens=2)
    except QueueFull:
      break
  done = threading.Event()
  threading.Thread(target=lambda: (eng.submit([8, 9], max_tokens=2, block=True), done.set()), daemon=True).start()
  time.sleep(0.2)
  eng.stop()
  assert done.wait(60), "the blocked submit did not return after stop()"
  eng.run_until_idle()

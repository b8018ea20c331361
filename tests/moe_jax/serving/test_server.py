"""The OpenAI-shaped HTTP endpoint on 127.0.0.1: completion, streaming, stop strings, errors, back-pressure."""

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_jax.serving import Engine, EngineConfig
from moe_jax.serving.server import TextStream, read_until_stop, serve
from moe_jax.tokenizer import ByteTokenizer

CONFIG = EngineConfig(num_slots=4, cache_len=32, kv_cache="fp32", prefill_lengths=(16,), prefill_batches=(1, 4),
                      max_queue=8, chunked_prefill=False)


@pytest.fixture(scope="module")
def server(tiny_model):
  engine = Engine(tiny_model, CONFIG)
  engine.warmup()
  srv = serve(engine, ByteTokenizer(), port=0, model_name="tiny")
  yield engine, f"http://127.0.0.1:{srv.server_address[1]}"
  srv.shutdown()
  engine.stop()


def post(url, body, raw=False):
  req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      data = r.read().decode()
      return r.status, (data if raw else json.loads(data))
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read().decode())


def test_completion_matches_the_engine_and_streams_the_same_text(server, tiny_model):
  engine, url = server
  status, body = post(url, {"prompt": "def add(a, b):", "max_tokens": 8})
  assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
  tok = ByteTokenizer()
  direct = engine.submit(tok.encode("def add(a, b):"), max_tokens=8, stop_tokens=[tok.eos_id]).result(timeout=60)
  choice = body["choices"][0]
  assert choice["text"] == tok.decode(direct)
  assert choice["finish_reason"] == ("length" if len(direct) == 8 else "stop")
  assert body["usage"] == {"prompt_tokens": 15, "completion_tokens": len(direct), "total_tokens": 15 + len(direct)}
  status, raw = post(url, {"prompt": "def add(a, b):", "max_tokens": 8, "stream": True}, raw=True)
  events = [e[len("data: "):] for e in raw.split("\n\n") if e]
  assert status == 200 and events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
  assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
  assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_token_id_prompt_and_models_route(server):
  _, url = server
  status, body = post(url, {"prompt": [257, 100, 101, 102], "max_tokens": 3})
  assert status == 200 and body["usage"]["prompt_tokens"] == 4
  with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
    assert json.loads(r.read())["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("body, message", [
    ({"prompt": "", "max_tokens": 2}, None),  # BOS only: valid
    ({"prompt": [], "max_tokens": 2}, "empty prompt"),
    ({"prompt": "x" * 40}, "prompt too long"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": [1, 999]}, "outside the vocabulary"),
    ({"prompt": 5}, "must be a string or a list"),
    ({"prompt": "hi", "stop": 3}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "\"stream\" must be true or false"),
    ({"prompt": "hi", "n": 3}, "one completion per request"),
    ({"prompt": "hi", "max_tokens": 2, "n": 1, "stream": False}, None),
    # Fields the server does not implement, refused unless off (before: dropped, a 200 as if absent), and typos.
    ({"prompt": "hi", "logprobs": 5}, "\"logprobs\"=5 is not supported"),
    ({"prompt": "hi", "echo": True}, "\"echo\"=True is not supported"),
    ({"prompt": "hi", "seed": 7}, "\"seed\"=7 is not supported"),
    ({"prompt": "hi", "logit_bias": {"104": -100}}, "\"logit_bias\""),
    ({"prompt": "hi", "presence_penalty": 2.0}, "\"presence_penalty\"=2.0 is not supported"),
    ({"prompt": "hi", "max_token": 4}, "unrecognized request field(s): 'max_token'"),
    ({"prompt": "hi", "max_tokens": 2, "model": "tiny", "user": "u", "echo": False, "logprobs": None,
      "frequency_penalty": 0.0, "logit_bias": {}}, None),
    ({"prompt": [104, True, 105]}, "the boolean True at prompt[1]"),  # before: taken as token 1
])
def test_bad_requests_get_400(server, body, message):
  _, url = server
  status, out = post(url, body)
  if message is None:
    assert status == 200
  else:
    assert status == 400 and message in out["error"]["message"], out


def test_a_keep_alive_connection_survives_error_responses(server):
  _, url = server
  conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=60)
  body = json.dumps({"prompt": "hi", "max_tokens": 2})
  conn.request("POST", "/v1/chat/completions", body=body)  # 404: its body must still be read
  r = conn.getresponse()
  assert r.status == 404 and "no route" in json.loads(r.read())["error"]["message"]
  conn.request("POST", "/v1/completions", body="[" * 100_000 + "]" * 100_000)  # before: RecursionError, no reply
  r = conn.getresponse()
  assert r.status == 400 and "nested too deeply" in json.loads(r.read())["error"]["message"]
  conn.request("POST", "/v1/completions", body=body)  # before: 400, the 404's body read as a request line
  r = conn.getresponse()
  assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1
  conn.close()
  conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=60)
  conn.putrequest("POST", "/v1/completions")
  conn.putheader("Content-Length", "lots")
  conn.endheaders()
  r = conn.getresponse()
  assert r.status == 400 and "Content-Length='lots'" in json.loads(r.read())["error"]["message"]
  conn.close()


def test_text_stream_holds_partial_utf8_and_cuts_at_stop():
  tok = ByteTokenizer()
  ids = list("é!".encode())  # é is two bytes
  ts = TextStream(tok, stops=[])
  assert ts.delta(ids[:1], final=False) == ("", False)
  assert ts.delta(ids[:2], final=False) == ("é", False)
  ts = TextStream(tok, stops=["\n\n"])
  assert ts.delta(list(b"ab\n"), final=False) == ("ab", False)  # "\n" may start the stop string
  assert ts.delta(list(b"ab\n\ncd"), final=False) == ("", True)
  ts = TextStream(tok, stops=["\n\n"])
  assert ts.delta(list(b"ab\n"), final=False) == ("ab", False)
  assert ts.delta(list(b"ab\nc"), final=True) == ("\nc", False)


def test_stop_string_ends_a_streamed_completion(server):
  _, url = server
  status, full = post(url, {"prompt": "def add(a, b):", "max_tokens": 8})
  text = full["choices"][0]["text"]
  stop = text[2:4]
  assert status == 200 and len(text) >= 4 and stop
  for stream in (False, True):
    status, out = post(url, {"prompt": "def add(a, b):", "max_tokens": 8, "stop": [stop], "stream": stream},
                       raw=stream)
    if stream:
      chunks = [json.loads(e[len("data: "):]) for e in out.split("\n\n") if e and e != "data: [DONE]"]
      got, finish = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
    else:
      got, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert got == text[:text.find(stop)] and finish == "stop", (stream, got, text, stop)


def _early_stop(tokens, max_tokens):
  """A two-character printable ASCII stop string from the text `tokens` decode to (not at its very start, so the
  cut text is not empty) and n, the number of tokens after which it first occurs; n is well below max_tokens."""
  tok = ByteTokenizer()
  text = tok.decode(tokens)
  i = next((i for i in range(1, len(text) - 1) if all(c.isascii() and c.isprintable() for c in text[i:i + 2])), None)
  assert i is not None, f"no printable ASCII pair in {text!r}: choose another prompt"
  stop = text[i:i + 2]
  n = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))
  assert n <= max_tokens // 2, (text, stop, n)  # an early stop: the test below cannot pass by running to the end
  return text, stop, n


def test_stop_string_ends_a_non_streamed_request_at_the_completing_token(server):
  engine, url = server
  prompt, max_tokens, tok = "print(", 24, ByteTokenizer()
  status, full = post(url, {"prompt": prompt, "max_tokens": max_tokens})
  direct = engine.submit(tok.encode(prompt), max_tokens=max_tokens, stop_tokens=[tok.eos_id]).result(timeout=60)
  assert status == 200 and full["choices"][0]["text"] == tok.decode(direct)
  assert full["usage"]["completion_tokens"] == len(direct) == max_tokens  # without a stop string: to max_tokens
  text, stop, n = _early_stop(direct, max_tokens)
  status, out = post(url, {"prompt": prompt, "max_tokens": max_tokens, "stop": ["\x00never", stop]})
  assert status == 200, out
  choice = out["choices"][0]
  assert choice["text"] == text[:text.find(stop)] and stop not in choice["text"], (choice, text, stop)
  assert choice["finish_reason"] == "stop"
  n_prompt = len(tok.encode(prompt))
  assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
  deadline = time.monotonic() + 30  # the cancelled request leaves its slot at the engine's next step
  while (engine.num_active or engine.num_queued) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert engine.num_active == 0 and engine.num_queued == 0


def test_read_until_stop_cancels_the_request_at_the_completing_token(tiny_model):
  engine, tok, max_tokens = Engine(tiny_model, CONFIG), ByteTokenizer(), 24  # stepped by the handle: no run-ahead
  prompt = tok.encode("print(")
  direct = engine.submit(prompt, max_tokens=max_tokens, stop_tokens=[tok.eos_id]).result()
  text, stop, n = _early_stop(direct, max_tokens)
  steps_before = engine.stats.decode_steps
  handle = engine.submit(prompt, max_tokens=max_tokens, stop_tokens=[tok.eos_id])
  stream = TextStream(tok, [stop])
  deltas = []
  tokens, rest, stopped = read_until_stop(handle, stream, on_delta=deltas.append)
  assert stopped and tokens == direct[:n] and handle.cancelled
  assert "".join(deltas) + rest == stream.sent == text[:text.find(stop)]
  engine.step()  # reaps the cancelled request
  assert handle.status == "cancelled" and engine.num_active == 0 and not engine.has_work()
  assert handle.tokens[:n] == tokens and len(handle.tokens) <= n + 1  # the engine stopped at the stop string
  assert engine.stats.decode_steps - steps_before <= n and engine.stats.cancelled == 1


def _send_completion(sock, body):
  """Writes one completion request on a raw socket; its reply is left unread."""
  data = json.dumps(body).encode()
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def _poll(condition, timeout=30.0) -> bool:
  """Whether `condition()` became true within `timeout` seconds (checked every 10 ms)."""
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


def _hold_engine(engine, monkeypatch, held):
  """Records the handles the server submits; the engine's thread skips its steps while `held(first handle)`."""
  handles, submit, step = [], engine.submit, engine.step

  def recording_submit(*args, **kwargs):
    handles.append(submit(*args, **kwargs))
    return handles[-1]

  def held_step():
    if handles and held(handles[0]):
      time.sleep(0.01)
      return True
    return step()

  monkeypatch.setattr(engine, "submit", recording_submit)
  monkeypatch.setattr(engine, "step", held_step)
  return handles


@pytest.mark.parametrize("stream, leave", [(False, "close"), (True, "close"), (False, "half-close")])
def test_a_client_that_leaves_cancels_its_request(server, monkeypatch, stream, leave):
  """Before, a non-streamed request whose client had closed the connection decoded on to max_tokens in its slot, and
  a streamed one was cancelled only when a write of its text failed, never while no text came (queued, or held as
  here). The engine is held once the request has `pause` tokens until the request is cancelled, so it can only end
  by the cancellation, at exactly `pause` of max_tokens=24 tokens ("print(" runs to 24 without EOS). A half-close
  (the client shuts down only its write side) cannot be told from a close: it cancels too (see `DisconnectWatch`)."""
  engine, url = server
  pause, max_tokens = 4, 24
  handles = _hold_engine(engine, monkeypatch, lambda h: len(h.tokens) >= pause and not h.cancelled)
  sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60)
  _send_completion(sock, {"prompt": "print(", "max_tokens": max_tokens, "stream": stream})
  assert _poll(lambda: handles and len(handles[0].tokens) >= pause), "the request did not start"
  if leave == "close":
    sock.close()  # streamed: the reply's headers lie unread, so the close sends a reset; non-streamed: an EOF
  else:
    sock.shutdown(socket.SHUT_WR)
  h = handles[0]
  assert _poll(lambda: h.done), f"the request went on after its client left ({len(h.tokens)} tokens, {h.status})"
  assert (h.status, h.finish_reason, len(h.tokens)) == ("cancelled", "cancelled", pause)
  assert _poll(lambda: engine.num_active == 0 and engine.num_queued == 0)
  sock.close()
  monkeypatch.undo()
  assert post(url, {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_pipelined_request_is_not_taken_for_a_disconnect(server, monkeypatch):
  """Bytes of a next request arriving on the keep-alive connection while a request runs wake the disconnect watch:
  it peeks at them without consuming them and ends; the running request finishes and both are answered in order."""
  engine, url = server
  watching = lambda: any(t.name == "moe-jax-http-watch" and t.is_alive() for t in threading.enumerate())  # noqa: E731
  assert _poll(lambda: not watching()), "earlier requests' watches did not end"  # within their poll_s
  release = threading.Event()
  handles = _hold_engine(engine, monkeypatch, lambda h: len(h.tokens) >= 2 and not release.is_set())
  sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60)
  body = {"prompt": "print(", "max_tokens": 8}
  _send_completion(sock, body)
  assert _poll(lambda: handles and len(handles[0].tokens) >= 2 and watching()), "the request did not start"
  _send_completion(sock, body)  # pipelined: read by the server only after the first reply
  assert _poll(lambda: not watching()), "the watch did not end on the pipelined bytes"
  assert not handles[0].cancelled
  release.set()
  replies = sock.makefile("rb")
  for _ in range(2):
    status = replies.readline()
    headers = {}
    while (line := replies.readline()) != b"\r\n":
      name, value = line.decode().split(":", 1)
      headers[name.strip().lower()] = value.strip()
    out = json.loads(replies.read(int(headers["content-length"])))
    assert status.startswith(b"HTTP/1.1 200"), (status, out)
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
  assert len(handles) == 2 and [h.status for h in handles] == ["finished", "finished"]
  sock.close()


class _Tokens:
  """A handle stand-in for `read_until_stop`: yields fixed tokens."""

  def __init__(self, tokens):
    self.tokens, self.cancelled = tokens, False

  def __iter__(self):
    return iter(self.tokens)

  def cancel(self):
    self.cancelled = True


def test_completions_keep_the_leading_space_a_metaspace_decoder_strips():
  """Decoded alone, Mixtral's completion " world again" lost its leading space: the text read "world again" and a stop
  string " world" was never found. The stream now decodes the tokens as a continuation of the prompt."""
  from moe_jax import hf, tokenizer  # pylint: disable=g-import-not-at-top
  tok = hf.load_tokenizer(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "hf", "mixtral"))
  prompt, full = tok.encode("hello"), tok.encode("hello world again")
  completion = full[len(prompt):]
  assert tok.decode(completion) == "world again"  # the decoder's own behaviour, which misled every caller
  assert tokenizer.decode_continuation(tok, prompt, completion) == " world again"
  for stops, sent, stopped, n_read in (([], " world again", False, len(completion)), ([" again"], " world", True, None),
                                       ([" world"], "", True, len(tok.encode("hello world")) - len(prompt))):
    stream = TextStream(tok, stops, prompt=prompt)
    read, _, hit = read_until_stop(_Tokens(completion), stream)
    assert (stream.sent, hit) == (sent, stopped), stops
    assert n_read is None or len(read) == n_read, stops  # " world" ends the request at the token completing it


def test_a_byte_fallback_character_streams_whole(tmp_path):
  """A Llama-style byte-fallback decoder gives one U+FFFD per byte of an unfinished character: holding back only one
  sent "a\ufffd", and every later delta was then dropped (the text no longer extended what was sent)."""
  from tokenizers import Tokenizer, decoders, models, normalizers  # pylint: disable=g-import-not-at-top
  from moe_jax import hf  # pylint: disable=g-import-not-at-top
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
  for t in ["▁", "a", "b", "c", "▁a", "h", "i", "!"]:
    vocab.setdefault(t, len(vocab))
  raw = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
  raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
  raw.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
  tok = hf.load_tokenizer(str(tmp_path))
  ids = tok.encode("a中b😀c hi!")
  assert tok.decode(ids[:3]).count("\ufffd") == 2  # 中 spelled as three byte tokens
  deltas = []
  stream = TextStream(tok, [])
  _, rest, _ = read_until_stop(_Tokens(ids), stream, on_delta=deltas.append)
  assert "".join(deltas) + rest == stream.sent == tok.decode(ids) == "a中b😀c hi!"


def test_a_burst_of_clients_is_answered_not_reset(server):
  """48 clients connecting at once: with the stdlib's listen backlog of 5 most connections were reset before the
  engine saw them (40-49 of 64 in one run). Every client gets an answer now: 200, or 429 when the engine's queue
  (8 here) is full."""
  _, url = server
  port = int(url.rsplit(":", 1)[1])
  barrier, answers, errors = threading.Barrier(48), [], []

  def client(i):
    body = json.dumps({"prompt": [5, 6, 7, i], "max_tokens": 2}).encode()
    barrier.wait()
    try:
      conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
      conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
      response = conn.getresponse()
      response.read()
      answers.append(response.status)
      conn.close()
    except OSError as e:
      errors.append(repr(e))

  threads = [threading.Thread(target=client, args=(i,)) for i in range(48)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(180)
  assert not errors, errors[:3]
  assert len(answers) == 48 and set(answers) <= {200, 429} and 200 in answers, answers

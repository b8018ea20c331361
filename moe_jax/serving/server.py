"""An HTTP endpoint with the OpenAI completions shape, streaming included, over the engine (stdlib only).

    python -m moe_jax.serving.server --checkpoint=tiny-trained --port=8000 [--slots=32]
    curl -s localhost:8000/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 16}'
    curl -sN localhost:8000/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 16, "stream": true}'

POST /v1/completions takes {"prompt": text or token ids, "max_tokens", "temperature", "top_p", "top_k" (extension),
"stop": a string or list of strings, "stream"} ("n" / "best_of" other than 1 are refused: one completion per
request; so are "logprobs", "echo", "seed", "suffix", "logit_bias" and the penalties unless off, and any field not
named here but "model" and "user") and answers a `text_completion` object, or with "stream": true
server-sent events, one `data: {...}` chunk per text delta and `data: [DONE]` at the end. A stop string ends the
request, streamed or not, at the token that completes it (the engine frees the slot then); the text ends just before
the stop string (as in OpenAI's API) and `usage.completion_tokens` counts the tokens generated up to and including
that token. GET /v1/models lists the model. Errors: 400 invalid request (the engine's message), 429 queue full
(back-pressure), 500 a request that failed (e.g. non-finite logits). The engine runs on its own thread; each HTTP
request is served on its own thread and reads its request handle (`read_until_stop`). A client that closes the
connection before its completion ends, streamed or not, cancels the request (`DisconnectWatch`): the engine frees
its slot at its next step instead of decoding on to max_tokens for nobody.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from absl import logging

from moe_jax import tokenizer as tokenizer_lib
from moe_jax.serving.engine import Engine
from moe_jax.serving.request import InvalidRequest, QueueFull, RequestFailed, RequestHandle

_SAMPLING = ("temperature", "top_p", "top_k")
_ONE_CHOICE = ("n", "best_of")
# OpenAI fields this server does not implement: refused (400) unless at a value that leaves the answer as it is.
_UNSUPPORTED = {"logprobs": (None,), "echo": (False, None), "seed": (None,), "suffix": (None, ""),
                "logit_bias": (None, {}), "presence_penalty": (0, None), "frequency_penalty": (0, None)}
_ACCEPTED = {"model", "user", "prompt", "max_tokens", "stop", "stream", *_SAMPLING, *_ONE_CHOICE, *_UNSUPPORTED}


class TextStream:
  """Turns a growing token list into text deltas, holding back a trailing incomplete UTF-8 character or a tail that
  may begin a stop string, and cuts the text at a stop string. The tokens are decoded as a continuation of the
  prompt (`tokenizer.decode_continuation`), so a leading space the decoder would strip from a text's start stays."""

  def __init__(self, tokenizer, stops: list[str], prompt=()):
    self.tokenizer, self.stops, self.prompt = tokenizer, stops, list(prompt)
    self.sent = ""

  def delta(self, tokens: list[int], final: bool) -> tuple[str, bool]:
    """(new text to send, whether a stop string was reached)."""
    text = tokenizer_lib.decode_continuation(self.tokenizer, self.prompt, tokens)
    hit = min((text.find(s) for s in self.stops if s and s in text), default=-1)
    if hit >= 0:
      text, final = text[:hit], True
    if not final:
      # An incomplete character: one U+FFFD from a UTF-8 decoder, one per byte from a byte-fallback decoder.
      text = text.rstrip("\ufffd")
      # Hold back a tail that may be the start of a stop string.
      held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
      text = text[:len(text) - held]
    if not text.startswith(self.sent):  # sent text cannot be taken back: say so instead of dropping the rest quietly
      logging.log_first_n(logging.WARNING, "text stream: the decoded text no longer extends what was sent (%r, now "
                          "%r); the rest is not streamed", 10, self.sent[-40:], text[-40:])
      return "", hit >= 0
    new, self.sent = text[len(self.sent):], text
    return new, hit >= 0


def read_until_stop(handle: RequestHandle, text: TextStream,
                    on_delta: Callable[[str], None] | None = None) -> tuple[list[int], str, bool]:
  """Reads a request's tokens until it ends or its text reaches a stop string, which cancels the request.

  Both the streaming and the non-streaming completion read a request this way, so a stop string ends either at the
  token that completes it: the handle is cancelled there and the engine frees the slot at its next step instead of
  decoding on to max_tokens. Tokens the engine may still emit between the cancel and that step are not read.

  Args:
    handle: the request's handle (iterated; a caller-stepped engine is stepped by the iteration).
    text: the request's `TextStream`; afterwards `text.sent` is the whole completion text, cut before the stop
      string (the stop string itself is not part of it, as in OpenAI's API).
    on_delta: called with each text delta as it becomes final (before the last one, which is returned).

  Returns:
    (tokens, rest, stopped): the tokens read, up to and including the one that completed a stop string (what
    `usage.completion_tokens` counts); the last text delta, not yet passed to `on_delta`; whether a stop string
    was reached.

  Raises:
    RequestFailed: the request failed before it ended or reached a stop string.
  """
  tokens = []
  for t in handle:
    tokens.append(t)
    delta, stopped = text.delta(tokens, final=False)
    if delta and on_delta is not None:
      on_delta(delta)
    if stopped:
      handle.cancel()
      break
  rest, stopped = text.delta(tokens, final=True)
  return tokens, rest, stopped


class DisconnectWatch:
  """Cancels a request when its HTTP client closes the connection before the request ends.

  A thread waits for the connection's socket to turn readable while the request is served. The request's body has
  been read by then, so a readable socket holds either the end of the stream or bytes the client sent after the body.
  The thread peeks at one byte without consuming it: none (EOF) or a reset means the client closed the connection,
  and the request is cancelled (the engine frees its slot at its next step; a queued request leaves the queue).
  Bytes there are a pipelined next request on the keep-alive connection: an EOF behind them cannot be seen without
  reading them, so the watch ends and the request runs to its end as before, its reply read by the handler's next
  request. A client that only shuts down its write side after sending the request (a half-close, as `nc -N` does)
  cannot be told from one that left: its request is cancelled too. HTTP clients keep their side open while they wait
  for the reply.

  Use as a context manager around the reading of the request; afterwards `disconnected` says whether the watch
  cancelled it. The thread is not joined at the end of the `with` block (that would hold the reply back): it may
  outlive the block by up to `poll_s`, only ever peeks at the socket, and cancels nothing once the block has ended.

  Args:
    sock: the connection's socket, the request's body already read from it.
    handle: the request's handle.
    poll_s: how often the thread looks whether the watch has ended; readiness of the socket wakes it at once.

  Attributes:
    disconnected: whether the client closed the connection and the request was cancelled.
  """

  def __init__(self, sock: socket.socket, handle: RequestHandle, poll_s: float = 1.0):
    self.sock, self.handle, self.poll_s = sock, handle, poll_s
    self.disconnected = False
    self._ended = threading.Event()
    self._lock = threading.Lock()  # the end of the block and a cancel do not interleave
    self._thread = threading.Thread(target=self._watch, name="moe-jax-http-watch", daemon=True)

  def __enter__(self) -> DisconnectWatch:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    with self._lock:
      self._ended.set()

  def _peer_closed(self) -> bool | None:
    """True: EOF, a reset or another socket error (e.g. a keepalive timeout); False: bytes are waiting; None:
    nothing to read after all."""
    try:
      return not self.sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
    except BlockingIOError:
      return None
    except OSError:  # ConnectionError, TimeoutError, ...: the connection is gone (after the block: nothing cancelled)
      return True

  def _watch(self) -> None:
    try:
      with selectors.DefaultSelector() as sel:  # not select.select: it refuses descriptors >= FD_SETSIZE (1024)
        sel.register(self.sock, selectors.EVENT_READ)
        while not self._ended.is_set() and not self.handle.done:
          if not sel.select(self.poll_s) or self._ended.is_set():
            continue
          closed = self._peer_closed()
          if closed is None:
            continue
          with self._lock:
            if closed and not self._ended.is_set() and not self.handle.done:
              self.disconnected = True
              logging.info("request %r: the client closed the connection; cancelling the request after %d of %d "
                           "tokens", self.handle.request_id, len(self.handle.tokens), self.handle.request.max_tokens)
              self.handle.cancel()
          return
    except (OSError, ValueError):  # the socket was closed under the watch: the request has been answered
      return


def _parse(body: dict, tokenizer) -> dict:
  if not isinstance(body, dict):
    raise InvalidRequest("the request body must be a JSON object")
  unknown = sorted(set(body) - _ACCEPTED)
  if unknown:  # a misspelt field would otherwise be dropped without a word
    raise InvalidRequest(f"unrecognized request field(s): {', '.join(map(repr, unknown))}")
  for name, off in _UNSUPPORTED.items():
    if name in body and not any(body[name] == v and isinstance(body[name], bool) == isinstance(v, bool) for v in off):
      raise InvalidRequest(f"\"{name}\"={body[name]!r} is not supported by this server (leave it out)")
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt)
  elif isinstance(prompt, list):
    ids = prompt
  else:
    raise InvalidRequest("\"prompt\" must be a string or a list of token ids")
  stop = body.get("stop") or []
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise InvalidRequest("\"stop\" must be a string or a list of strings")
  stream = body.get("stream", False)
  if not isinstance(stream, bool) and stream is not None:
    raise InvalidRequest(f"\"stream\" must be true or false, got {stream!r}")
  for name in _ONE_CHOICE:  # one completion per request: refused rather than silently ignored
    if body.get(name, 1) not in (1, None):
      raise InvalidRequest(f"\"{name}\"={body[name]!r}: this server returns one completion per request (1)")
  return dict(prompt=ids, max_tokens=body.get("max_tokens", 16), stream=bool(stream),
              sampling={k: body[k] for k in _SAMPLING if k in body and body[k] is not None}, stop=stop)


def make_handler(engine: Engine, tokenizer, model_name: str):
  """The request handler class bound to one engine."""
  eos = getattr(tokenizer, "eos_id", None)

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002  pylint: disable=redefined-builtin
      del format, args  # quiet

    def _json(self, code: int, obj: dict) -> None:
      data = json.dumps(obj).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _error(self, code: int, kind: str, message: str) -> None:
      self._json(code, {"error": {"message": message, "type": kind, "code": code}})

    def do_GET(self):  # noqa: N802
      if self.path.rstrip("/") == "/v1/models":
        self._json(200, {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "moe-jax"}]})
      else:
        self._error(404, "not_found", f"no route {self.path}")

    def do_POST(self):  # noqa: N802
      try:  # the body is read first, whatever the route: a keep-alive connection's next request starts after it
        size = int(self.headers.get("Content-Length", 0))
        if size < 0:
          raise ValueError
      except ValueError:
        self.close_connection = True  # where the body ends is unknown
        self._error(400, "invalid_request_error", f"Content-Length={self.headers.get('Content-Length')!r} must be "
                    "an int >= 0")
        return
      data = self.rfile.read(size)
      if self.path.rstrip("/") != "/v1/completions":
        self._error(404, "not_found", f"no route {self.path}")
        return
      try:
        try:
          body = json.loads(data or b"null")
        except RecursionError as e:
          raise InvalidRequest("the JSON body is nested too deeply") from e
        req = _parse(body, tokenizer)
        handle = engine.submit(req["prompt"], max_tokens=req["max_tokens"], sampling=req["sampling"],
                               stop_tokens=[eos] if eos is not None else [])
      except (ValueError, InvalidRequest) as e:
        self._error(400, "invalid_request_error", str(e))
        return
      except QueueFull as e:
        self._error(429, "queue_full", str(e))
        return
      cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
      text = TextStream(tokenizer, req["stop"], prompt=handle.request.prompt)
      n_prompt = len(handle.request.prompt)

      def chunk(delta: str, finish: str | None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": delta, "index": 0, "logprobs": None, "finish_reason": finish}]}

      def reason() -> str:
        return "length" if handle.finish_reason == "length" else "stop"

      if not req["stream"]:
        try:
          with DisconnectWatch(self.connection, handle) as watch:
            tokens, _, stopped = read_until_stop(handle, text)
        except RequestFailed as e:
          self._error(500, "request_failed", str(e))
          return
        if watch.disconnected:  # nobody to answer
          self.close_connection = True
          return
        body = chunk(text.sent, "stop" if stopped else reason())
        body["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                         "total_tokens": n_prompt + len(tokens)}
        self._json(200, body)
        return
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Connection", "close")
      self.end_headers()

      def send(delta: str) -> None:
        self.wfile.write(f"data: {json.dumps(chunk(delta, None))}\n\n".encode())
        self.wfile.flush()

      try:
        try:
          with DisconnectWatch(self.connection, handle) as watch:
            _, rest, stopped = read_until_stop(handle, text, on_delta=send)
          if watch.disconnected:
            self.close_connection = True
            return
          final = chunk(rest, "stop" if stopped or handle.cancelled else reason())
          self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())
        except RequestFailed as e:
          err = {"error": {"message": str(e), "type": "request_failed", "code": 500}}
          self.wfile.write(f"data: {json.dumps(err)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
      except (BrokenPipeError, ConnectionResetError):
        if not (handle.done or handle.cancelled):  # the client went away: free the slot
          logging.info("request %r: the client closed the stream; cancelling the request after %d of %d tokens",
                       handle.request_id, len(handle.tokens), handle.request.max_tokens)
          handle.cancel()
      self.close_connection = True

  return Handler


class _Server(ThreadingHTTPServer):
  """The stdlib's listen backlog is 5: in a burst of clients most connections were reset before the engine saw
  them (40-49 of 64 in one test), neither answered nor refused with a 429. The queue's limit is the engine's."""
  request_queue_size = 1024


def serve(engine: Engine, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
          model_name: str = "moe-jax") -> ThreadingHTTPServer:
  """Starts the engine's thread and an HTTP server thread; returns the server (`server.server_address` has the
  port; `shutdown()` it, then `engine.stop()`)."""
  engine.start()
  server = _Server((host, port), make_handler(engine, tokenizer, model_name))
  server.daemon_threads = True
  threading.Thread(target=server.serve_forever, name="moe-jax-http", daemon=True).start()
  return server


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  from moe_jax import cli  # pylint: disable=g-import-not-at-top
  from moe_jax.serving.engine import EngineConfig  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  config, model, tokenizer = cli.from_flags(f)
  cache_len = f.cache_len or config.max_seq_len
  engine = Engine(model, EngineConfig(num_slots=f.slots, cache_len=cache_len, kv_cache=f.kv_cache,
                                      prefill_lengths=tuple(sorted({min(int(x), cache_len)
                                                                    for x in f.prefill_lengths})),
                                      prefill_batches=(1, 8), max_queue=f.max_queue))
  engine.warmup()
  server = serve(engine, tokenizer, host=f.host, port=f.port, model_name=config.name)
  print(f"serving {config.name} on http://{server.server_address[0]}:{server.server_address[1]}/v1/completions",
        flush=True)
  try:
    threading.Event().wait()
  except KeyboardInterrupt:
    server.shutdown()
    engine.stop()


if __name__ == "__main__":
  from absl import app, flags

  from moe_jax import cli

  flags.DEFINE_string("config", "tiny", "Preset name (random weights).")
  flags.DEFINE_string("checkpoint", None, "Shipped checkpoint name or a checkpoint directory.")
  flags.DEFINE_string("hf", None, "Hugging Face model directory.")
  flags.DEFINE_integer("seed", 0, "PRNG seed of random weights.")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
  flags.DEFINE_integer("port", 8000, "Port (0: any free port).")
  flags.DEFINE_integer("slots", 32, "Decode slots.")
  flags.DEFINE_integer("cache_len", 0, "Positions per slot (0: the model's max_seq_len).")
  flags.DEFINE_string("kv_cache", "bf16", "KV cache mode.")
  cli.define_kv_calib_windows()
  flags.DEFINE_list("prefill_lengths", ["32", "128", "512"], "Prefill bucket lengths.")
  flags.DEFINE_integer("max_queue", 256, "Pending requests before 429.")
  app.run(main)

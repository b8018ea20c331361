"""The OpenAI-shaped HTTP endpoint on 127.0.0.1: completion, streaming, stop strings, errors, back-pressure."""

import json
import urllib.error
import urllib.request

import pytest

from moe_jax.serving import Engine, EngineConfig
from moe_jax.serving.server import TextStream, serve
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
])
def test_bad_requests_get_400(server, body, message):
  _, url = server
  status, out = post(url, body)
  if message is None:
    assert status == 200
  else:
    assert status == 400 and message in out["error"]["message"], out


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

"""The HTTP server: completions streamed and not, refusals naming the field,
disconnects, a failing step, and the launcher's clean exit on SIGTERM.

One engine on random tiny models serves the module through a real uvicorn
server in a thread (httpx's ASGI transport buffers whole responses, so it
cannot show streaming or a client going away).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import jax.numpy as jnp
import pytest

from helpers import SERVING_ENGINE, serve_app
from specjax import GREEDY, autoregressive_generate
from specjax.bench.serving.load import held_out_requests, poisson_arrivals, run_http
from specjax.heads import config as head_config
from specjax.serving import Engine, EngineConfig, Request, fit_config, summarize
from specjax.serving.background import BackgroundEngine
from specjax.serving.http import make_app
from specjax.serving.http.choices import ChoiceForm
from specjax.serving.http.text import Decoder as _Decoder
from specjax.serving.http.tool_parsers import HERMES
from specjax.testing import ByteTokenizer, tiny_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One engine configuration for this module, the launcher test and
# tests/test_load_test.py: their programs come from the compilation cache.
ENGINE = SERVING_ENGINE
PROMPT = "def add(a, b):\n"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
  """(url, background): the tiny engine behind the app, on a free local port."""
  target, draft, tokenizer = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(policy="adaptive", **ENGINE))
  engine.warmup(timed_runs=0)
  background = BackgroundEngine(engine)
  url, server, thread = serve_app(make_app(background, tokenizer, "tiny"))
  yield url, background
  server.should_exit = True
  thread.join(10)
  background.close()


@pytest.fixture
def client(served):
  with httpx.Client(base_url=served[0], timeout=30) as c:
    yield c


def _events(response: httpx.Response) -> list:
  """The data of each server-sent event ("[DONE]" as a string)."""
  datas = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
  return [d if d == "[DONE]" else json.loads(d) for d in datas]


def _complete(client, **body):
  return client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})


def test_completion_and_stream_agree(client):
  plain = _complete(client, max_tokens=12)
  assert plain.status_code == 200, plain.text
  out = plain.json()
  assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
  assert out["model"] == "tiny" and isinstance(out["created"], int)
  (choice,) = out["choices"]
  assert choice["finish_reason"] == "length" and choice["logprobs"] is None
  usage = dict(out["usage"])
  speculation = usage.pop("speculation")  # the policy's steps decide the figures
  assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 12, "total_tokens": 27}
  assert speculation.keys() == {
    "drafted", "accepted", "drafted_at_position", "accepted_at_position", "forced"
  }  # fmt: skip

  streamed = _complete(client, max_tokens=12, stream=True, stream_options={"include_usage": True})
  assert streamed.status_code == 200
  assert streamed.headers["content-type"].startswith("text/event-stream")
  events = _events(streamed)
  assert events[-1] == "[DONE]"
  chunks, last = events[:-2], events[-2]
  assert last["choices"] == [] and last["usage"].keys() == out["usage"].keys()
  assert all(last["usage"][k] == usage[k] for k in usage)
  assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
  assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
    "length"
  ]
  # Greedy: the same tokens, so the deltas add up to the non-streamed text.
  assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]

  ids = _complete(client, prompt=list(PROMPT.encode()), max_tokens=12)  # token ids
  assert ids.json()["choices"][0]["text"] == choice["text"]


def test_multibyte_characters_stream_whole():
  decoder = _Decoder(ByteTokenizer())
  text = "é€😀 ok"
  deltas = [decoder.add([b], final=False) for b in text.encode()]
  assert "\ufffd" not in "".join(deltas) and "".join(deltas) == text
  assert deltas[:2] == ["", "é"]  # held back until the character is whole


def test_a_tool_call_cut_short_says_so():
  """A call cut by max_tokens or a stop string inside its arguments (issue 73):
  the text written, finish_reason "length" / "stop" (never "tool_calls"), and
  `incomplete_tool_call` on the choice, whole or on the stream's last chunk."""
  cut = '<tool_call>\n{"name": "f", "arguments": {"a": "x'
  for reason in ("length", "stop"):
    whole = ChoiceForm(ByteTokenizer(), True, False, HERMES).choice(0, cut, reason, [], True)
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"a": "x'
    assert whole["finish_reason"] == reason and whole["incomplete_tool_call"] is True
    form = ChoiceForm(ByteTokenizer(), True, False, HERMES)
    chunks = [form.choice(0, cut[:30], None, [], first=True), form.choice(0, cut[30:], reason, [])]
    assert "incomplete_tool_call" not in chunks[0] and chunks[1]["incomplete_tool_call"] is True
    assert chunks[1]["finish_reason"] == reason
  done = cut + '"}}\n</tool_call>'
  whole = ChoiceForm(ByteTokenizer(), True, False, HERMES).choice(0, done, "stop", [], True)
  assert whole["finish_reason"] == "tool_calls" and "incomplete_tool_call" not in whole
  json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"])


def test_health_and_metrics(client):
  health = client.get("/health").json()
  assert health["status"] == "ok" and health["model"] == "tiny"
  assert health["policy"] == "adaptive" and health["max_prompt_len"] == 32
  assert health["max_new_tokens"] == 16
  _complete(client, max_tokens=4)
  metrics = client.get("/metrics.json").json()
  assert metrics["requests"]["completed"] >= 1 and metrics["tokens"] >= 4
  for key in ("ttft_s", "tpot_s"):
    assert set(metrics[key]) == {"mean", "p50", "p90", "p99"} and metrics[key]["p99"] > 0
  assert "acceptance_rate" in metrics and metrics["requests"]["live"] == 0
  assert metrics["policy"]["kind"] == "adaptive" and metrics["policy"]["step_ms"]


@pytest.mark.parametrize(
  "body, param, message",
  [
    (b'{"prompt": "x", ', None, "not valid JSON"),
    (b'["x"]', None, "must be a JSON object"),
    ({"prompt": "x", "echo": True}, "echo", "echo is not a supported field"),
    ({"prompt": "x", "logprobs": 1}, "logprobs", "logprobs: this engine records none"),
    ({"prompt": "x", "seed": "1"}, "seed", "seed: Input should be a valid integer"),
    ({"prompt": "x", "stop": [1]}, "stop", "stop must be a string or a list of strings"),
    ({"max_tokens": 4}, "prompt", "prompt is required"),
    (
      {"prompt": "x", "max_tokens": 0},
      "max_tokens",
      "max_tokens must be an integer in [1, 16], got 0",
    ),
    (
      {"prompt": "x", "max_tokens": 17},
      "max_tokens",
      "max_tokens must be an integer in [1, 16], got 17",
    ),
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens", "max_tokens"),
    # More bytes than max_prompt_len tokens can spell: refused before tokenizing.
    ({"prompt": "a" * 40}, "prompt", "prompt has 40 bytes: more than the 32 tokens"),
    ({"prompt": list(range(40))}, "prompt", "prompt has 40 tokens; the engine takes at most "),
    ({"prompt": ""}, "prompt", "prompt must be a non-empty list"),
    ({"prompt": [1, 256]}, "prompt", "vocab_size=256"),
    ({"prompt": [1, -1]}, "prompt", "vocab_size=256"),
    ({"prompt": [1, "a"]}, "prompt", "prompt must be a string or a list of integer token ids"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be a number >= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "top_k": 257}, "top_k", "top_k must be in [0, vocab_size=256]"),
    ({"prompt": "x", "stop_token_id": 256}, "stop_token_id", "stop_token_id must be None or"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
  ],
)
def test_bad_requests_name_the_field(client, body, param, message):
  if isinstance(body, bytes):
    response = client.post(
      "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
  else:
    response = client.post("/v1/completions", json=body)
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert error["type"] == "invalid_request_error" and error["param"] == param
  assert message in error["message"]
  if param is not None:
    assert param in error["message"]


def test_other_model_is_not_found(client):
  response = _complete(client, model="gpt-4")
  assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_background_refuses_in_the_callers_thread(served):
  _, background = served
  events = []
  with pytest.raises(ValueError, match=r"max_new_tokens must be an integer in \[1, 16\]"):
    background.submit(Request([1, 2], 17), events.append)
  done = threading.Event()

  def on_event(event):
    events.append(event)
    if event.finished:
      done.set()

  rid = background.submit(Request([1, 2], 3), on_event)
  assert done.wait(10)
  assert {e.request_id for e in events} == {rid}
  assert sum(len(e.tokens) for e in events) == 3 and events[-1].finish_reason == "length"


def test_load_generator_over_http(served):
  url, _ = served
  requests = held_out_requests(3, ByteTokenizer(), max_new_tokens=6, max_prompt_len=32)
  completions = run_http(url, requests, poisson_arrivals(50.0, 3, seed=0))
  for c in completions:
    assert c.finish_reason == "length" and c.error is None and len(c.tokens) == 6
    assert 0 < c.ttft <= c.e2e and c.tpot > 0
  assert summarize(completions)["output_tokens"] == 18


def _slow_steps(engine, seconds: float):
  """Makes each step of `engine` take at least `seconds` (undone by deleting
  the instance attribute)."""
  step = type(engine).step.__get__(engine)

  def slow():
    time.sleep(seconds)
    return step()

  engine.step = slow


def _wait_idle(background, timeout: float = 10.0) -> None:
  deadline = time.monotonic() + timeout
  while background.call(lambda e: e.live_requests() or e.has_work()):
    assert time.monotonic() < deadline, "the engine still holds a request"
    time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_slot(served, client):
  url, background = served
  engine = background.engine
  expected = _complete(client, max_tokens=16).json()["choices"][0]["text"]
  cancelled = client.get("/metrics.json").json()["requests"]["cancelled"]
  _slow_steps(engine, 0.05)  # 16 tokens take at least 0.8 s: the client leaves first
  try:
    with httpx.Client(base_url=url, timeout=30) as leaving:
      body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 16, "stream": True}
      with leaving.stream("POST", "/v1/completions", json=body) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: {")
    _wait_idle(background)
  finally:
    del engine.step
  metrics = client.get("/metrics.json").json()["requests"]
  assert metrics["cancelled"] == cancelled + 1 and metrics["live"] == 0
  # The server carries on: the same greedy request gives the same text.
  assert _complete(client, max_tokens=16).json()["choices"][0]["text"] == expected


def test_failing_step_fails_its_requests_and_serving_goes_on(served, client):
  _, background = served
  engine = background.engine
  step = type(engine).step.__get__(engine)
  calls = []

  def fail_once():
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("device lost")
    return step()

  engine.step = fail_once
  try:
    failed = _complete(client, max_tokens=4)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "device lost" in error["message"]
    streamed = _events(_complete(client, max_tokens=4, stream=True))
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"][0]["finish_reason"] == "length"
  finally:
    del engine.step
  _wait_idle(background)


# -- the launcher: python -m experiments.serve, stopped by SIGTERM


def start_server() -> subprocess.Popen:
  """The tiny server on a free port (`.port`), its output in a file (`.log`)."""
  port = _free_port()
  with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
    # logprobs=0: the module's engine, whose programs are in the compilation cache.
    overrides = [f"--config.{k}={v}".replace(" ", "") for k, v in ENGINE.items()]
    overrides.append("--config.logprobs=0")
    process = subprocess.Popen(
      [sys.executable, "-m", "experiments.serve", "--config.model=tiny", f"--config.port={port}"]
      + overrides,
      cwd=ROOT,
      stdout=log,
      stderr=subprocess.STDOUT,
    )
  process.port, process.log = port, log.name
  return process


def _tail(path: str) -> str:
  with open(path) as f:
    return f.read()[-4000:]


def test_serve_fits_the_engine_to_the_model_or_names_the_flags():
  """The server's defaults (() buckets, 0 budget) fit the model's context; values
  that cannot fit are refused naming the flags, before anything compiles."""
  from configs import serve as serve_config
  from specjax.jobs import serve

  target, draft, _ = tiny_setup(0)  # max_seq_len 256
  config = serve_config.get_config()
  fitted = fit_config(serve.engine_config(config), target, draft, names=serve.FIT_FLAGS)
  assert (fitted.prompt_buckets, fitted.max_new_tokens) == ((32, 64, 128), 123)
  config.prompt_buckets, config.max_new_tokens = (64, 128, 256), 256
  with pytest.raises(ValueError, match="lower --config.prompt_buckets, --config.max_new_tokens"):
    fit_config(serve.engine_config(config), target, draft, names=serve.FIT_FLAGS)
  config.max_new_tokens = -1
  with pytest.raises(ValueError, match=r"config.max_new_tokens must be an integer >= 0 \(0: fit"):
    serve.check_config(config)


def test_serve_refuses_what_cannot_fit_in_one_line():
  process = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.serve",
      "--config.model=tiny",
      "--config.prompt_buckets=(64,128,256)",
      "--config.max_new_tokens=256",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert process.returncode == 2, process.stderr
  assert "Traceback" not in process.stderr
  assert (
    "error: target: the largest of --config.prompt_buckets (256) + --config.max_new_tokens (256) "
    "+ --config.gamma + 1 (5) = 517 exceeds max_seq_len=256" in process.stderr
  )


def test_serve_exits_cleanly_on_sigterm(background):
  process = background(start_server)
  port, log = process.port, process.log
  try:
    deadline = time.monotonic() + 120
    while True:
      assert process.poll() is None, _tail(log)
      assert time.monotonic() < deadline, "the server did not come up in 120 s"
      try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
          break
      except httpx.TransportError:
        time.sleep(0.25)
    response = httpx.post(
      f"http://127.0.0.1:{port}/v1/completions",
      json={"prompt": PROMPT, "max_tokens": 4},
      timeout=30,
    )
    assert response.json()["usage"]["completion_tokens"] == 4
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, _tail(log)
  finally:
    if process.poll() is None:
      process.kill()
    os.unlink(log)


test_serve_exits_cleanly_on_sigterm.start_in_background = start_server


@pytest.mark.parametrize(
  "kind, drafter, gamma",
  [("eagle", "model", 3), ("dflash", "dflash", 3), ("dspark", "dspark", 3)],
  ids=["eagle", "dflash", "dspark"],
)
@pytest.mark.sample("dspark")  # the EAGLE and block heads' runs in the slow tier
def test_serve_drafts_with_a_head_by_path(tmp_path, kind, drafter, gamma):
  """--config.head: the server drafts with any head `specjax.hf.load_drafter` reads
  (here a specjax export for the tiny target; --config.drafter "model" takes any
  kind, a head's kind only its own); greedy output is the target's own. The block
  drafter (dflash) drafts up to block_size - 1 tokens and refuses more naming the flag
  (its gamma of 0 is measured at start-up: tests/test_gamma_choice.py)."""
  from flax import nnx

  import specjax.hf
  from configs import serve as serve_config
  from specjax import heads
  from specjax.heads import make_head
  from specjax.jobs import serve

  target, _, _ = tiny_setup(0)
  settings = dict(d_ff=64) if kind == "eagle" else dict(block_size=4, draft_layers=2)
  if kind == "dspark":  # the sequential block drafter: its Markov head's rank too
    settings["markov_rank"] = 8
  head = make_head(head_config(kind, target.cfg, **settings), rngs=nnx.Rngs(1))
  specjax.hf.save_head(head, str(tmp_path / "head"), layout="specjax")
  config = serve_config.get_config()
  config.update(dict(SERVING_ENGINE, model="tiny", head=str(tmp_path / "head"), policy="always"))
  config.update(dict(drafter=drafter, gamma=gamma, widths=(4,)))
  engine, _, _ = serve.warm_engine(config)
  assert isinstance(engine.drafter, heads.kind(kind).drafter) and engine.config.gamma == 3
  prompt = [5, 17, 33, 2, 99]
  done = engine.run([Request(prompt=prompt, max_new_tokens=12)])[0]
  plain = autoregressive_generate(
    target, jnp.asarray([prompt]), jnp.asarray([5]), max_new_tokens=12, sampling=GREEDY
  )
  assert done.tokens == plain.tokens[0].tolist() and done.proposed > 0
  if kind == "dflash":
    config.gamma = 4
    with pytest.raises(ValueError, match=r"config.gamma must be in \[1, 3\] for a block drafter"):
      serve.warm_engine(config)
    config.gamma, config.drafter = 0, "eagle"
    with pytest.raises(ValueError, match="config.head holds a dflash head; config.drafter is"):
      serve.warm_engine(config)
    config.drafter, config.head = "dflash", ""
    with pytest.raises(ValueError, match="config.model='tiny' needs config.head"):
      serve.check_config(config)  # before any model loads
    config.drafter = "dflash3"
    with pytest.raises(ValueError, match="config.drafter must be one of model, eagle, medusa"):
      serve.check_config(config)
    return
  config.draft = "runs/draft"
  with pytest.raises(ValueError, match="config.head drafts in place of config.draft"):
    serve.check_config(config)


def test_a_failure_mid_stream_ends_it_with_an_error_event():
  """Issue 73: an exception other than APIError mid-stream dropped the connection
  with no word; the stream now ends with an error event in the API's shape (and
  no [DONE]), after the chunks already sent."""
  import asyncio
  import types

  from specjax.serving.http.streaming import stream

  async def chunks():
    yield 0, "ab", []
    raise RuntimeError("injected: the engine thread died")

  run = types.SimpleNamespace(
    chunks=chunks, choices=[types.SimpleNamespace(finish_reason=None)], disconnected=False
  )
  form = ChoiceForm(ByteTokenizer(), chat=False, logprobs=False)
  head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny"}

  async def collect():
    return [event async for event in stream(run, form, head, None)]

  events = asyncio.run(collect())
  assert len(events) == 2 and events[0].startswith("data: ")
  assert json.loads(events[0][len("data: ") :])["choices"][0]["text"] == "ab"
  error = json.loads(events[1][len("data: ") :])["error"]
  assert error["type"] == "server_error" and "RuntimeError" in error["message"]
  assert "[DONE]" not in "".join(events)

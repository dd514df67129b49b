"""Two real processes on loopback (jax.distributed with a local coordinator, 4 CPU
devices per process, gloo CPU collectives): one sharded generate call gives the
single-process tokens; one server across both answers what a single-process
server answers, and stops with an error when the other process dies."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_serving_constraints import SCHEMA  # the small schema the serving tests use

import specjax

# Runs in tests/test_front_door.py's process when the whole suite runs.
pytestmark = pytest.mark.front_door

HERE = os.path.dirname(os.path.abspath(__file__))


def make_inputs():
  """The models, prompts and arguments both the workers and the reference use."""
  cfg = specjax.ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, max_seq_len=64
  )
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(
    cfg.replace(d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, n_layers=1), rngs=nnx.Rngs(1)
  )
  prompts = jax.random.randint(jax.random.key(4), (4, 6), 0, 512, dtype=jnp.int32)
  lengths = jnp.array([6, 3, 5, 1], jnp.int32)
  kwargs = dict(
    gamma=3,
    max_new_tokens=10,
    sampling=specjax.SamplingParams(temperature=1.0),
    key=jax.random.key(9),
  )
  return target, draft, prompts, lengths, kwargs


# The server test's engine and requests (tests/multiprocess_serving_worker.py too).
BODIES = (
  {"prompt": "def add(a, b):\n", "max_tokens": 10, "temperature": 0},
  {"prompt": "import os\n", "max_tokens": 10, "temperature": 0.8, "seed": 5},
  {"prompt": "x = [", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 11, "n": 2},
)


def serving_models():
  """A target whose heads and kv heads a model axis of 4 divides, and its draft."""
  cfg = specjax.ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, max_seq_len=64
  )
  small = cfg.replace(d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, n_layers=1)
  return specjax.Transformer(cfg, rngs=nnx.Rngs(0)), specjax.Transformer(small, rngs=nnx.Rngs(1))


def serving_config(mesh=None, constrained=False):
  """The server test's engine settings; `constrained`: with a constraint table of
  2,048 states, which holds json_object's automaton (1,623 states on the byte
  vocabulary) beside SCHEMA's (158) but not beside WIDE's (593) or a second copy."""
  from specjax.serving import EngineConfig

  return EngineConfig(
    slots=4,
    gamma=3,
    policy="always",
    prompt_buckets=(16,),
    max_new_tokens=24 if constrained else 10,
    widths=(2, 4),
    mesh=mesh,
    constraint_states=2048 if constrained else 0,
  )


# The constrained server test's requests (tests/multiprocess_serving_worker.py
# sends them one by one, then the first and, while it runs, the others at once):
# json_object three times (the leader reuses its cached automaton, each follower
# unpickles a new copy per step's message), a small schema beside it, a wide one
# that waits for room.
WIDE = {
  "type": "object",
  "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
  },
  "required": ["title", "tags"],
}
JSON_OBJECT = {"response_format": {"type": "json_object"}, "max_tokens": 24}
CONSTRAINED_BODIES = (
  {"prompt": "x = [", "temperature": 0, **JSON_OBJECT},  # runs its 24 tokens
  {"prompt": "import os\n", "temperature": 0.8, "seed": 5, **JSON_OBJECT},
  {"prompt": "def add(a, b):\n", "temperature": 0, **JSON_OBJECT},
  {
    "prompt": "{",
    "max_tokens": 24,
    "temperature": 0.9,
    "seed": 11,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
  },
  {
    "prompt": "class A:\n",
    "max_tokens": 24,
    "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE}},
  },
)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  out = str(tmp_path / "tokens.json")
  ran = _run_workers("multiprocess_worker.py", out)
  assert all(code == 0 for code, _ in ran), "\n----\n".join(log[-4000:] for _, log in ran)
  with open(out) as f:
    result = json.load(f)
  assert result["devices"] == 8
  target, draft, prompts, lengths, kwargs = make_inputs()
  reference = specjax.speculative_generate(target, draft, prompts, lengths, **kwargs)
  np.testing.assert_array_equal(np.asarray(result["tokens"]), np.asarray(reference.tokens))


def _run_workers(script: str, out: str, *extra: str, timeout: float = 600) -> list[str]:
  """Runs `script` as processes 0 and 1; their logs. Each is killed at `timeout`:
  a hung job fails the test rather than hanging it."""
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  workers = [
    subprocess.Popen(
      [sys.executable, os.path.join(HERE, script), str(i), port, out, *extra],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in (0, 1)
  ]
  logs = []
  for w in workers:
    try:
      logs.append(w.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      w.kill()
      logs.append(w.communicate()[0] + f"\n[killed after {timeout} s]")
  return [(w.returncode, log) for w, log in zip(workers, logs)]


def _single_process_answers(bodies=BODIES, constrained=False) -> list:
  """What a one-device server answers to `bodies`, one after another."""
  import httpx

  from helpers import serve_app
  from specjax.serving import Engine
  from specjax.serving.background import BackgroundEngine
  from specjax.serving.http import make_app
  from specjax.testing import ByteTokenizer

  eos = 0 if constrained else None  # structured output ends at EOS (the byte tokenizer's "\x00")
  engine = Engine(*serving_models(), serving_config(constrained=constrained), eos_ids=eos)
  background = BackgroundEngine(engine)
  url, server, thread = serve_app(make_app(background, ByteTokenizer(), "tiny"))
  try:
    with httpx.Client(base_url=url, timeout=120) as client:
      return [client.post("/v1/completions", json=body).json() for body in bodies]
  finally:
    server.should_exit = True
    thread.join(10)
    background.close()


def _texts(answer) -> list[str]:
  return [choice["text"] for choice in answer["choices"]]


def test_two_processes_serve_what_one_serves(tmp_path):
  out = str(tmp_path / "answers.json")
  results = _run_workers("multiprocess_serving_worker.py", out)
  assert all(rc == 0 for rc, _ in results), "\n----\n".join(log[-4000:] for _, log in results)
  with open(out) as f:
    served = json.load(f)
  assert served["broken"] is None
  assert all(a["status"] == 200 for a in served["answers"]), served
  expected = _single_process_answers()
  assert [_texts(a["body"]) for a in served["answers"]] == [_texts(a) for a in expected]


def test_two_processes_serve_overlapping_constrained_requests(tmp_path):
  """Issue 73, requirement 2: constrained requests that overlap, more than the
  constraint table holds at once (the wide schema waits for json_object's rows
  to end), on two processes: the texts one process serves. The table interns
  automata by content, so the leader's cached json_object automaton and each
  follower's fresh copy share one block, and both admit the same requests."""
  out = str(tmp_path / "answers.json")
  results = _run_workers("multiprocess_serving_worker.py", out, "constrained")
  assert all(rc == 0 for rc, _ in results), "\n----\n".join(log[-4000:] for _, log in results)
  with open(out) as f:
    served = json.load(f)
  assert served["broken"] is None
  rounds = served["answers"], served["overlapping"]
  assert all(a["status"] == 200 for answers in rounds for a in answers), served
  assert served["counters"]["constraint_waits"] > 0, served["counters"]  # the wide one waited
  expected = [_texts(a) for a in _single_process_answers(CONSTRAINED_BODIES, constrained=True)]
  for answers in rounds:  # one by one, then overlapping
    assert [_texts(a["body"]) for a in answers] == expected


def test_a_dead_process_stops_the_server_with_an_error(tmp_path):
  """Process 1 exits abruptly after 2 steps: process 0 ends, with an error, in
  bounded time (the test's timeout: it must not wait for the dead process)."""
  out = str(tmp_path / "answers.json")
  (leader_rc, leader_log), (follower_rc, _) = _run_workers(
    "multiprocess_serving_worker.py", out, "2", timeout=240
  )
  assert follower_rc == 17
  assert "killed after" not in leader_log, leader_log[-4000:]
  assert leader_rc != 0, leader_log[-4000:]
  # Its client was told (the step's collective failed), the rest refused; JAX's
  # coordination service may then end the process once heartbeats stop.
  with open(out) as f:
    served = json.load(f)
  assert "Error" in served["broken"]  # the failed collective's own message
  first = served["answers"][0]
  assert first["status"] == 500 and "fell out of step" in first["body"]["error"]["message"]


@pytest.mark.slow
def test_the_server_launcher_runs_as_two_processes(tmp_path):
  """`python -m experiments.serve --distributed` on two processes: one endpoint,
  the one-device greedy text, and SIGTERM to process 0 stops both with 0."""
  import contextlib
  import signal
  import time

  import httpx

  from specjax.serving import Engine, EngineConfig, Request
  from specjax.testing import ByteTokenizer, tiny_setup

  port, coordinator = _free_port(), _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  flags = [
    "--distributed",
    f"--coordinator_address=127.0.0.1:{coordinator}",
    "--num_processes=2",
    "--config.model=tiny",
    "--config.mesh=(2,4)",
    "--config.slots=4",
    "--config.prompt_buckets=(32,)",
    "--config.max_new_tokens=16",
    "--config.policy=always",
    f"--config.port={port}",
  ]
  stack = contextlib.ExitStack()
  logs = [stack.enter_context((tmp_path / f"process_{i}.log").open("w")) for i in (0, 1)]
  processes = [
    subprocess.Popen(
      [sys.executable, "-m", "experiments.serve", *flags, f"--process_id={i}"],
      cwd=os.path.dirname(HERE),
      env=env,
      stdout=logs[i],
      stderr=subprocess.STDOUT,
    )
    for i in (0, 1)
  ]
  try:
    deadline = time.monotonic() + 400
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline and all(p.poll() is None for p in processes):
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        time.sleep(1)
    prompt = "def add(a, b):\n"
    answer = httpx.post(
      f"{url}/v1/completions",
      json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
      timeout=120,
    )
    assert answer.status_code == 200, answer.text
    processes[0].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
    stack.close()
  output = "\n----\n".join((tmp_path / f"process_{i}.log").read_text()[-3000:] for i in (0, 1))
  assert codes == [0, 0], output
  target, draft, tokenizer = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(slots=2, gamma=4, policy="always", widths=(2,)))
  done = engine.run([Request(prompt=tokenizer.encode(prompt), max_new_tokens=12)])[0]
  assert answer.json()["choices"][0]["text"] == ByteTokenizer().decode(done.tokens)

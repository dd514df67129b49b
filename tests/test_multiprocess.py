"""Two real processes on loopback: one sharded generate call gives the
single-process tokens (jax.distributed with a local coordinator, 4 CPU devices
per process, gloo CPU collectives)."""

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


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  port, out = str(_free_port()), str(tmp_path / "tokens.json")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  workers = [
    subprocess.Popen(
      [sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(i), port, out],
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
      logs.append(w.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      w.kill()
      logs.append(w.communicate()[0])
  assert all(w.returncode == 0 for w in workers), "\n----\n".join(log[-4000:] for log in logs)
  with open(out) as f:
    result = json.load(f)
  assert result["devices"] == 8
  target, draft, prompts, lengths, kwargs = make_inputs()
  reference = specjax.speculative_generate(target, draft, prompts, lengths, **kwargs)
  np.testing.assert_array_equal(np.asarray(result["tokens"]), np.asarray(reference.tokens))

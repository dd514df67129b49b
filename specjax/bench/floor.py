"""The machine's floor for decoding: what a model call cannot beat on this hardware.

A small-batch decode step reads every weight once, so its floor is how fast the
machine reads them (`read_bandwidth_gbs`: read-only, every core, far past the
caches) and runs the same products (`matmul_floor_seconds`: the model's products
alone). `ar_over_floor` and
`ar_over_matmul_floor` say how far a real step is from each
(docs/performance.md, "Where decode time goes, and the floor").
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.bench.timing import time_calls
from specjax.kernels import matmul
from specjax.models.transformer import Transformer
from specjax.validation import check_positive_int


def _median_seconds(fn, *args, num_runs: int) -> float:
  timings, _ = time_calls({"f": lambda: fn(*args)}, num_runs)
  return timings["f"].median_s


def weight_bytes(model: Transformer) -> int:
  """Bytes of the model's parameters as stored (what a decode step must read)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return int(sum(x.size * x.dtype.itemsize for x in leaves))


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_bandwidth_gbs(
  megabytes: int = 1024, threads: int | None = None, num_runs: int = 5
) -> float:
  """Main-memory read bandwidth in GB/s, measured the way a decode step reads its
  weights: read-only, every core, an array far larger than the caches.

  On CPU: the faster of two readers over a float32 array of `megabytes` MB,
  `threads` threads (default: the cores this process may run on) each summing
  its own contiguous part with numpy (which releases the GIL), and XLA's own
  reduction of the same array split in as many rows. On an accelerator: a
  jitted sum of the array on the default device. The median of `num_runs`.
  """
  check_positive_int("megabytes", megabytes)
  threads = _cores() if threads is None else threads
  check_positive_int("threads", threads)
  n = megabytes * 2**20 // 4 // threads * threads
  reduce = jax.jit(lambda x: jnp.sum(x.reshape(threads, -1), axis=1))
  if jax.default_backend() != "cpu":
    x = jnp.ones((n,), jnp.float32)
    return n * 4 / _median_seconds(reduce, x, num_runs=num_runs) / 1e9
  host = np.ones((n,), np.float32)
  parts = np.split(host, threads)

  def numpy_read():
    workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
    for worker in workers:
      worker.start()
    for worker in workers:
      worker.join()

  numpy_s = _median_seconds(numpy_read, num_runs=num_runs)
  # XLA at its usual optimisation level, whatever the process's flags (the test
  # suite compiles at level 0, where a reduction is not vectorised).
  x = jnp.asarray(host)
  xla = reduce.lower(x).compile({"xla_backend_optimization_level": 2})
  xla_s = _median_seconds(xla, x, num_runs=num_runs)
  return n * 4 / min(numpy_s, xla_s) / 1e9


def matmul_gflops(n: int = 1024, num_steps: int = 8, num_runs: int = 5) -> float:
  """Measured float32 throughput in GFLOP/s of `[n, n] @ [n, n]` products."""
  check_positive_int("n", n)

  @jax.jit
  def run(a, b):
    # Each product feeds the next, so none can be hoisted or dropped.
    return jax.lax.fori_loop(0, num_steps, lambda _, a: (a @ b) * (1.0 / n), a)

  a = jnp.ones((n, n), jnp.float32)
  seconds = _median_seconds(run, a, a, num_runs=num_runs) / num_steps
  return 2 * n**3 / seconds / 1e9


def _kernels(model: Transformer):
  """Per layer the weight matrices a call multiplies by, then the head (`[V, D]`
  when tied, else `[D, V]`)."""
  cfg = model.cfg
  layers = []
  for layer in model.layers:
    attn, mlp = layer.attn, layer.mlp
    mats = {
      "qkv": attn.qkv_proj.kernel[...],
      "o": attn.o_proj.kernel[...],
      "down": mlp.down_proj.kernel[...],
    }
    if cfg.mlp == "gelu":
      mats["up"] = mlp.up_proj.kernel[...]
    else:  # gated: SwiGLU, GeGLU
      mats["gate_up"] = mlp.gate_up_proj.kernel[...]
    layers.append(mats)
  # A tied head multiplies by the [V, D] embedding as stored (no transposed copy).
  head = model.embed.embedding[...] if cfg.tie_embeddings else model.lm_head[...]
  return layers, head


@functools.partial(jax.jit, static_argnames=("num_steps", "tied"))
def _matmul_skeleton(layers, head, x, *, num_steps: int, tied: bool):
  """`num_steps` passes of the model's products alone on `x [N, D]` (`tied`: the
  head is the `[V, D]` embedding)."""
  compute = x.dtype

  def dot(a, w):  # the products a decode step runs (specjax's CPU kernel where it applies)
    return matmul(a, w, compute)

  def body(_, x):
    for mats in layers:
      # The model's fused products. Which columns stand for the queries (or the
      # gate) does not change the cost: the first N*H feed o_proj, the first F gate.
      qkv = dot(x, mats["qkv"])
      n_q = mats["o"].shape[0]
      # k and v feed the next step through a scalar, so they are not dead code.
      kv = jnp.sum(qkv[:, n_q:]) * 1e-9
      x = x + dot(qkv[:, :n_q], mats["o"]) + kv.astype(compute)
      if "gate_up" in mats:
        gate_up = dot(x, mats["gate_up"])
        f = gate_up.shape[-1] // 2
        h = gate_up[:, :f] * gate_up[:, f:]
      else:
        h = dot(x, mats["up"])
      x = x + dot(h, mats["down"])
    logits = matmul(x, head, jnp.float32, transposed=tied)
    return x + (1e-9 * jnp.max(logits, axis=-1, keepdims=True)).astype(compute)

  return jax.lax.fori_loop(0, num_steps, body, x)


def matmul_floor_seconds(
  model: Transformer, batch: int, tokens_per_call: int = 1, num_steps: int = 64, num_runs: int = 5
) -> float:
  """Seconds of one call's matrix products alone: `[batch * tokens_per_call, D]`
  through every projection and the head, with the model's own weights."""
  check_positive_int("batch", batch)
  check_positive_int("tokens_per_call", tokens_per_call)
  layers, head = _kernels(model)
  x = jnp.full((batch * tokens_per_call, model.cfg.d_model), 0.01, model.cfg.compute_dtype)
  run = functools.partial(_matmul_skeleton, num_steps=num_steps, tied=model.cfg.tie_embeddings)
  return _median_seconds(run, layers, head, x, num_runs=num_runs) / num_steps


def machine_floor(num_runs: int = 5) -> dict[str, float]:
  """`{"read_bandwidth_gbs", "matmul_gflops"}` measured on the default device."""
  return {
    "read_bandwidth_gbs": round(read_bandwidth_gbs(num_runs=num_runs), 2),
    "matmul_gflops": round(matmul_gflops(num_runs=num_runs), 2),
  }


def model_floor(
  model: Transformer, batch: int, tokens_per_call: int = 1, num_runs: int = 5
) -> dict[str, float]:
  """The model's floor: its matmul-only call time and its weight bytes per call."""
  seconds = matmul_floor_seconds(model, batch, tokens_per_call, num_runs=num_runs)
  return {"matmul_floor_ms": seconds * 1e3, "weight_bytes": weight_bytes(model)}


def floor_fields(
  target: Transformer,
  *,
  batch: int,
  ar_step_s: float,
  spec_iteration_s: float,
  verify_call_s: float,
  draft_call_s: float | None,
  draft_calls_per_iteration: float,
  num_runs: int,
) -> dict[str, Any]:
  """How far decoding is from the machine's floor (the measurements above).

  Args:
    ar_step_s, spec_iteration_s: seconds of an AR step, a speculative iteration.
    verify_call_s: seconds of one target call over gamma + 1 tokens.
    draft_call_s: seconds of one one-token draft call; None when not a model
      call of its own (layer skip).
    draft_calls_per_iteration: draft calls per iteration (0 for prompt lookup).


  Returns:
    `read_bandwidth_gbs`, `matmul_gflops`, `target_weight_bytes`,
    `target_bandwidth_floor_ms`, `target_matmul_floor_ms`, `ar_over_floor`,
    `ar_over_matmul_floor` and `spec_overhead_fraction` (the share of an
    iteration that is neither drafting nor verification calls; None when the
    drafter's calls are not measured).
  """

  machine = machine_floor(num_runs)
  floor_s = matmul_floor_seconds(target, batch, num_runs=num_runs)
  weights = weight_bytes(target)
  bandwidth_floor_s = weights / (machine["read_bandwidth_gbs"] * 1e9)
  out = {
    **machine,
    "target_weight_bytes": weights,
    "target_bandwidth_floor_ms": bandwidth_floor_s * 1e3,
    "target_matmul_floor_ms": floor_s * 1e3,
    "ar_step_ms": ar_step_s * 1e3,
    "ar_over_floor": ar_step_s / bandwidth_floor_s,
    "ar_over_matmul_floor": ar_step_s / floor_s,
    "spec_ms_per_iteration": spec_iteration_s * 1e3,
    "target_verify_ms": verify_call_s * 1e3,
    "draft_call_ms": None if draft_call_s is None else draft_call_s * 1e3,
    "draft_calls_per_iteration": draft_calls_per_iteration,
    "spec_overhead_fraction": None,
  }
  if draft_call_s is not None:
    models_s = verify_call_s + draft_calls_per_iteration * draft_call_s
    out["spec_overhead_fraction"] = 1.0 - models_s / spec_iteration_s
  return out


__all__ = [
  "floor_fields",
  "machine_floor",
  "matmul_floor_seconds",
  "matmul_gflops",
  "read_bandwidth_gbs",
  "model_floor",
  "weight_bytes",
]

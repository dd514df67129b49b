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


# Nominal memory bandwidth in GB/s (the vendors' figures) by device kind: the
# first entry whose words all appear in `jax.Device.device_kind`, lower-cased.
# What a measured read may approach, never pass (`read_bandwidth` drops a method
# that reads more than 10% faster than this: a copy XLA elided, say).
NOMINAL_BANDWIDTH_GBS: tuple[tuple[tuple[str, ...], float], ...] = (
  (("gh200",), 4000.0),  # before h200, which it contains
  (("h200",), 4800.0),
  (("h100", "pcie"), 2000.0),
  (("h100", "nvl"), 3900.0),
  (("h100",), 3350.0),  # SXM ("NVIDIA H100 80GB HBM3")
  (("h800",), 3350.0),
  (("b200",), 8000.0),
  (("a100", "pcie", "80gb"), 1935.0),
  (("a100", "80gb"), 2039.0),  # SXM4 80GB
  (("a100",), 1555.0),  # 40GB, SXM4 and PCIe
  (("l40s",), 864.0),
  (("l4",), 300.0),
  (("a10g",), 600.0),
  (("v100",), 900.0),
  (("tpu v6 lite",), 1640.0),  # Trillium (v6e)
  (("tpu v5 lite",), 819.0),  # v5e
  (("tpu v5p",), 2765.0),
  (("tpu v4",), 1200.0),
)


def nominal_bandwidth_gbs(device_kind: str | None = None) -> float | None:
  """The nominal memory bandwidth of a device kind (default: the default
  device's) from `NOMINAL_BANDWIDTH_GBS`, or None where it is not in the table
  (every CPU: its bandwidth depends on the machine's memory, not its kind)."""
  kind = (jax.devices()[0].device_kind if device_kind is None else device_kind).lower()
  for words, gbs in NOMINAL_BANDWIDTH_GBS:
    if all(word in kind for word in words):
      return gbs
  return None


def read_bandwidth(
  megabytes: int = 1024, threads: int | None = None, num_runs: int = 5
) -> dict[str, Any]:
  """Memory read bandwidth the way a decode step reads its weights: read-only,
  every core, an array far larger than the caches; the best of several readers,
  since any one reader may fall short of what the step itself reaches (on an
  AVX2 Zen 3 numpy's and XLA's sums read at 24.6 GB/s while the model's own
  products streamed 28.9: a "floor" the step beat).

  Readers, each the median of `num_runs` over `megabytes` MB:
  - on CPU: `numpy` (`threads` threads, default the cores this process may run
    on, each summing its own contiguous part; numpy releases the GIL), `xla_reduce`
    (XLA's sum of the same array split in as many rows), and `kernel_<build>_<dtype>`
    (specjax's CPU matmul kernel, each build calibration may choose, one row
    times a `[2048, N]` float32 or bfloat16 matrix of that size: the weights'
    own streaming read in a decode step);
  - on an accelerator: `copy` (a device-to-device copy, counted as one read and
    one write per byte), `reduce_rows` (XLA's row sums over rows of 8,192
    floats: a streaming read) and `reduce` (one sum of the whole array).

  Returns:
    `read_bandwidth_gbs` (the fastest reader, GB/s), `read_method` (its name),
    `read_methods` (every reader's GB/s, None where it could not run),
    `read_method_errors` (why, by reader), `nominal_bandwidth_gbs` (the
    device's, where `NOMINAL_BANDWIDTH_GBS` knows it) and `device_kind`.
  """
  check_positive_int("megabytes", megabytes)
  threads = _cores() if threads is None else threads
  check_positive_int("threads", threads)
  nbytes = megabytes * 2**20 // (4 * threads) * (4 * threads)
  kind = jax.devices()[0].device_kind
  nominal = nominal_bandwidth_gbs(kind)
  on_cpu = jax.default_backend() == "cpu"
  readers = _cpu_readers(nbytes, threads) if on_cpu else _device_readers(nbytes)
  rates: dict[str, float | None] = {}
  errors: dict[str, str] = {}
  for name, make in readers:
    try:
      fn, bytes_moved = make()
      rate = bytes_moved / _median_seconds(fn, num_runs=num_runs) / 1e9
    except Exception as e:  # a reader that cannot run here leaves the others
      rates[name], errors[name] = None, f"{type(e).__name__}: {e}"[:300]
      continue
    finally:
      fn = None
    if nominal is not None and rate > 1.1 * nominal:
      rates[name] = None
      errors[name] = f"{rate:.0f} GB/s is past the nominal {nominal:.0f}: not a real read"
    else:
      rates[name] = rate
  measured = {k: v for k, v in rates.items() if v is not None}
  if not measured:
    raise RuntimeError(f"no read bandwidth reader ran: {errors}")
  best = max(measured, key=measured.get)
  return {
    "read_bandwidth_gbs": measured[best],
    "read_method": best,
    "read_methods": rates,
    "read_method_errors": errors,
    "nominal_bandwidth_gbs": nominal,
    "device_kind": kind,
  }


def read_bandwidth_gbs(
  megabytes: int = 1024, threads: int | None = None, num_runs: int = 5
) -> float:
  """Main-memory read bandwidth in GB/s: the fastest reader of `read_bandwidth`."""
  return read_bandwidth(megabytes, threads, num_runs)["read_bandwidth_gbs"]


def _cpu_readers(nbytes: int, threads: int):
  """`(name, make)` pairs; `make()` -> `(fn, bytes read per call)`."""
  n = nbytes // 4
  reduce = jax.jit(lambda x: jnp.sum(x.reshape(threads, -1), axis=1))
  host = {}

  def numpy_reader():
    host["x"] = np.ones((n,), np.float32)
    parts = np.split(host["x"], threads)

    def read():
      workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
      for worker in workers:
        worker.start()
      for worker in workers:
        worker.join()

    return read, nbytes

  def xla_reader():
    # XLA at its usual optimisation level, whatever the process's flags (the
    # test suite compiles at level 0, where a reduction is not vectorised).
    x = jnp.asarray(host.pop("x")) if "x" in host else jnp.ones((n,), jnp.float32)
    xla = reduce.lower(x).compile({"xla_backend_optimization_level": 2})
    return functools.partial(xla, x), nbytes

  readers = [("numpy", numpy_reader), ("xla_reduce", xla_reader)]
  from specjax.kernels import cpu_matmul

  try:
    builds = cpu_matmul.candidates()
  except (RuntimeError, ValueError):
    builds = []
  weights = {}  # one matrix per dtype, read by every build in turn
  for dtype in (jnp.float32, jnp.bfloat16):
    for lib in builds:
      name = f"kernel_{lib.variant}_{jnp.dtype(dtype).name}"
      readers.append((name, functools.partial(_kernel_reader, lib, dtype, nbytes, weights)))
  return readers


_KERNEL_K = 2048  # rows of the kernel reader's matrix: the 1B shape's d_model


def _kernel_reader(lib, dtype, nbytes: int, weights: dict):
  """One row times a `[2048, N]` matrix of `nbytes` (kept in `weights` for the
  next build; the other dtype's is dropped) through kernel build `lib`."""
  from specjax.kernels import cpu_matmul

  dtype = jnp.dtype(dtype)
  if dtype not in weights:
    weights.clear()
    cols = max(nbytes // (_KERNEL_K * dtype.itemsize), 1)
    weights[dtype] = jnp.ones((_KERNEL_K, cols), dtype)
  w = weights[dtype]
  x = jnp.full((1, _KERNEL_K), 0.5, dtype)
  product = jax.jit(
    functools.partial(
      cpu_matmul.product, out_dtype=dtype, transposed=False, target=lib.target(False)
    )
  )
  return functools.partial(product, x, w), w.nbytes


def _device_readers(nbytes: int):
  """The accelerator's readers: `(name, make)`, `make()` -> `(fn, bytes moved per call)`."""
  n = nbytes // 4
  row = 8192
  rows = max(n // row, 1)

  def make(fn, moved, shape):
    x = jnp.ones(shape, jnp.float32)
    return functools.partial(jax.jit(fn), x), moved(x.nbytes)

  return [
    ("copy", lambda: make(jnp.copy, lambda b: 2 * b, (n,))),
    ("reduce_rows", lambda: make(lambda x: jnp.sum(x, axis=1), lambda b: b, (rows, row))),
    ("reduce", lambda: make(jnp.sum, lambda b: b, (n,))),
  ]


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


def machine_floor(num_runs: int = 5) -> dict[str, Any]:
  """`read_bandwidth`'s fields (`read_bandwidth_gbs` rounded) and `matmul_gflops`,
  measured on the default device."""
  read = read_bandwidth(num_runs=num_runs)
  return {
    **read,
    "read_bandwidth_gbs": round(read["read_bandwidth_gbs"], 2),
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
  "nominal_bandwidth_gbs",
  "read_bandwidth",
  "read_bandwidth_gbs",
  "model_floor",
  "weight_bytes",
]

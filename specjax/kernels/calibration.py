"""Kernel or XLA's dot, per product shape: timed once on this machine, then kept.

A kernel tuned on one CPU can lose to XLA on another, so the choice is measured
where it runs: the first time a product shape (x dtype, w dtype, K, N, layout)
is traced, the kernel and XLA's dot are each timed on it at 1, 2, 5, 8 and 16
rows (`ROWS`), in a thread of its own (the caller may be inside a trace). The
kernel takes the shape when it is faster at one row (the most frequent call:
every autoregressive step, every draft call at batch 1) or faster over those
row counts (the geometric mean of its time over XLA's is at most 1), and then
runs every product of that shape up to `EXACT_ROWS` rows. One path for the
whole range, not the faster per row count, because only the kernel keeps a
row's result independent of the other rows: a decode step and the
verification of gamma + 1 tokens must agree to the bit. Above that range (a
prefill) the two are compared once more, at `PREFILL_ROWS`.

Decisions are written to a JSON file beside the kernel library (keyed by the
library, which names the source, compiler, flags and CPU, and by XLA_FLAGS),
so later processes reuse them; `decisions()` is what this process used.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ROWS = (1, 2, 5, 8, 16)
PREFILL_ROWS = 256
# Rows past this go to the prefill decision; up to it, one path per shape.
EXACT_ROWS = 64
_NUM_RUNS = 5
_TARGET_CALL_S = 4e-3  # products per timed call: enough that a call takes about this

# A product under test: (x [M, K], w, use_kernel) -> [M, N].
Product = Callable[[jax.Array, jax.Array, bool], jax.Array]


@dataclasses.dataclass(frozen=True)
class Decision:
  """The kernel-or-XLA choice for one product shape, with the timings behind it.

  `kernel_us` / `xla_us`: microseconds of one product at each of `ROWS`;
  `prefill_us`: (kernel, XLA) at `PREFILL_ROWS`.
  """

  kernel: bool
  prefill_kernel: bool
  kernel_us: tuple[float, ...]
  xla_us: tuple[float, ...]
  prefill_us: tuple[float, float]

  @staticmethod
  def choose(kernel_us, xla_us, prefill_us) -> Decision:
    ratios = [k / x for k, x in zip(kernel_us, xla_us)]
    kernel = ratios[0] <= 1.0 or math.prod(ratios) ** (1 / len(ratios)) <= 1.0
    return Decision(
      kernel=kernel,
      prefill_kernel=prefill_us[0] <= prefill_us[1],
      kernel_us=tuple(kernel_us),
      xla_us=tuple(xla_us),
      prefill_us=tuple(prefill_us),
    )

  def uses_kernel(self, rows: int) -> bool:
    """Whether a product of `rows` rows of this shape runs on the kernel."""
    return self.kernel if rows <= EXACT_ROWS else self.prefill_kernel


def shape_key(x_dtype, w_dtype, k: int, n: int, transposed: bool) -> str:
  """The decisions' key of a product shape, e.g. "float32@bfloat16 2048x3072"."""
  layout = "NxK" if transposed else "KxN"
  return f"{jnp.dtype(x_dtype).name}@{jnp.dtype(w_dtype).name} {k}x{n} {layout}"


_lock = threading.Lock()
_decisions: dict[str, dict[str, Decision]] = {}  # by store path, then shape key


def decisions() -> dict[str, dict]:
  """The decisions this process made or loaded, by shape key (for result files)."""
  with _lock:
    return {
      key: dataclasses.asdict(decision)
      for store in _decisions.values()
      for key, decision in store.items()
    }


def store_path(library_path: str) -> str:
  """The decisions file of a kernel library under this process's XLA_FLAGS."""
  flags = hashlib.sha256(os.environ.get("XLA_FLAGS", "").encode()).hexdigest()[:8]
  base = os.path.splitext(library_path)[0]
  return f"{base}-decisions-{flags}.json"


def decide(
  store: str, product: Product, x_dtype, w_dtype, k: int, n: int, transposed: bool
) -> Decision:
  """The decision for this product shape: from this process, the store, or timed now."""
  key = shape_key(x_dtype, w_dtype, k, n, transposed)
  with _lock:
    known = _decisions.setdefault(store, {})
    if key not in known:
      known.update(_load(store))
    if key in known:
      return known[key]
    decision = _in_thread(lambda: _measure(product, x_dtype, w_dtype, k, n, transposed))
    known[key] = decision
    _save(store, key, decision)
    return decision


def _in_thread(fn):
  # JAX's trace state is per thread: the timing runs as eager code even when
  # the caller is tracing a jitted function.
  out: dict = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # re-raised in the caller
      out["error"] = e

  thread = threading.Thread(target=run, name="specjax-kernel-calibration")
  thread.start()
  thread.join()
  if "error" in out:
    raise out["error"]
  return out["value"]


def time_product(
  product: Product, x: jax.Array, w: jax.Array, use_kernel: bool, num_runs: int = _NUM_RUNS
) -> float:
  """Seconds of one `product(x, w, use_kernel)`: a jitted loop of dependent products
  (enough that a call takes a few ms), one warm-up, the median of `num_runs` calls."""
  estimate = max(w.size * w.dtype.itemsize / 20e9, 2 * x.shape[0] * w.size / 50e9, 2e-6)
  steps = int(min(max(_TARGET_CALL_S // estimate, 1), 256))

  def body(_, x):
    y = product(x, w, use_kernel)
    # Each product feeds the next through a scalar, so none is hoisted or dropped.
    return x + (1e-30 * y[0, 0]).astype(x.dtype)

  run = jax.jit(lambda x, w: jax.lax.fori_loop(0, steps, lambda i, x: body(i, x), x))
  run(x, w).block_until_ready()
  times = []
  for _ in range(num_runs):
    start = time.perf_counter()
    run(x, w).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times) / steps


def _measure(product: Product, x_dtype, w_dtype, k, n, transposed) -> Decision:
  rng = np.random.default_rng(0)
  shape = (n, k) if transposed else (k, n)
  w = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, w_dtype)

  def both(rows, num_runs=_NUM_RUNS):
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32), x_dtype)
    return [time_product(product, x, w, kernel, num_runs) * 1e6 for kernel in (True, False)]

  timed = [both(rows) for rows in ROWS]
  prefill = both(PREFILL_ROWS, num_runs=3)
  return Decision.choose([t[0] for t in timed], [t[1] for t in timed], prefill)


def _load(store: str) -> dict[str, Decision]:
  try:
    with open(store) as f:
      raw = json.load(f)
    # The timings are kept; the choice is made again, so a change of rule applies.
    return {
      key: Decision.choose(d["kernel_us"], d["xla_us"], d["prefill_us"])
      for key, d in raw.items()
      if len(d["kernel_us"]) == len(ROWS)
    }
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return {}  # missing or unreadable: measured again and rewritten


def _save(store: str, key: str, decision: Decision) -> None:
  directory = os.path.dirname(store)
  try:
    with open(os.path.join(directory, ".lock"), "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      merged = {k: dataclasses.asdict(d) for k, d in _load(store).items()}
      merged[key] = dataclasses.asdict(decision)
      fd, tmp = tempfile.mkstemp(dir=directory, suffix=".json")
      with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
      os.replace(tmp, store)
  except OSError:
    pass  # an unwritable cache only costs a new measurement in the next process

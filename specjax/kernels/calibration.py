"""Kernel build or XLA's dot, per product shape: timed once on this machine, then kept.

A kernel tuned on one CPU can lose to XLA on another, and of two builds a CPU
runs the one for its widest vectors is not always the faster (on a Zen 4, whose
AVX-512 units are 256 bits wide, the AVX2 build's bfloat16 products measured
1.2x faster at 1-5 rows and the AVX512-BF16 build's 1.5x faster at 16). So the
choice is measured where it runs: the first time a product shape (x dtype, w
dtype, K, N, layout) is traced, XLA's dot and each candidate build
(`cpu_matmul.candidates`) are timed on it at 1, 2, 5, 8 and 16 rows (`ROWS`), in
a thread of its own (the caller may be inside a trace). A build may take the
shape when it is faster than XLA at one row (the most frequent call: every
autoregressive step, every draft call at batch 1) or over those row counts (the
geometric mean of its time over XLA's is at most 1); the best such build
(`Decision.choose`) then runs every product of that shape up to `EXACT_ROWS`
rows. One path for the whole range, not the faster per row count, because a
row's result must not depend on the other rows: a decode step and the
verification of gamma + 1 tokens must agree to the bit, and each build sums in
its own order. Above that range (a prefill) the paths are compared once more,
at `PREFILL_ROWS`. Each path is timed in a block of its own, XLA last, over
copies of the weights larger than the cache (`weight_copies`), so the timings
are those of weights read from memory, as in a decode step.

Decisions are written to a JSON file beside the first candidate's library
(keyed by the library, which names the source, compiler, flags and CPU, and by
XLA_FLAGS), so later processes reuse them; `decisions()` is what this process
used.
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

from specjax.kernels import cpu

ROWS = (1, 2, 5, 8, 16)
PREFILL_ROWS = 256
# Rows past this go to the prefill decision; up to it, one path per shape.
EXACT_ROWS = 64
_NUM_RUNS = 5
_TARGET_CALL_S = 4e-3  # products per timed call: enough that a call takes about this
# Weight copies timed in turn (`weight_copies`): at most this many, for
# matrices of at least _COPY_MIN_BYTES (compile time grows with the copies:
# 64 copies of a tiny matrix took 20 s per shape to calibrate, 1 copy 3.6 s).
_MAX_COPIES, _COPY_MIN_BYTES = 8, 1 << 20
# Bumped when the timing method changes, so decisions timed the old way are not reused.
_METHOD = 3

# A product under test: (x [M, K], w, path) -> [M, N]; path "xla" or a build's name.
Product = Callable[[jax.Array, jax.Array, str], jax.Array]


@dataclasses.dataclass(frozen=True)
class Decision:
  """The path of one product shape, "xla" or a kernel build, with the timings behind it.

  `us`: path -> microseconds of one product at each of `ROWS`; `prefill_us`:
  path -> microseconds at `PREFILL_ROWS`.
  """

  path: str
  prefill_path: str
  us: dict[str, tuple[float, ...]]
  prefill_us: dict[str, float]

  @staticmethod
  def choose(us: dict[str, tuple[float, ...]], prefill_us: dict[str, float]) -> Decision:
    """A build may take the shape when it beats XLA at one row or over `ROWS`
    (geometric mean of its time over XLA's at most 1); of those, the one with the
    lowest geometric mean wins, its one-row ratio counted twice (one-row calls
    are the most frequent). Each path's time at a row count is first capped by
    its times at larger ones. Prefill: the fastest at `PREFILL_ROWS`."""
    # A product of fewer rows reads the same weights and computes less, so it
    # costs no more than one of more rows: a one-row time above a larger row
    # count's is noise (this shared machine gave 1.8 ms at 1 row, 1.0 at 2) and
    # is replaced by it.
    fewer = {path: [min(times[i:]) for i in range(len(times))] for path, times in us.items()}
    xla = fewer["xla"]
    scores = {}
    for path, times in fewer.items():
      if path == "xla":
        continue
      ratios = [t / x for t, x in zip(times, xla)]
      if ratios[0] <= 1.0 or _geomean(ratios) <= 1.0:
        scores[path] = _geomean([ratios[0], *ratios])
    return Decision(
      path=min(scores, key=scores.get, default="xla"),
      prefill_path=min(prefill_us, key=prefill_us.get),
      us={path: tuple(times) for path, times in us.items()},
      prefill_us=dict(prefill_us),
    )

  def path_for(self, rows: int) -> str:
    """ "xla" or the build that runs a product of `rows` rows of this shape."""
    return self.path if rows <= EXACT_ROWS else self.prefill_path


def _geomean(values) -> float:
  return math.prod(values) ** (1 / len(values))


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
  """The decisions file of a kernel library (the first candidate) under this
  process's XLA_FLAGS."""
  flags = hashlib.sha256(os.environ.get("XLA_FLAGS", "").encode()).hexdigest()[:8]
  base = os.path.splitext(library_path)[0]
  return f"{base}-decisions-v{_METHOD}-{flags}.json"


def decide(
  store: str,
  product: Product,
  builds: tuple[str, ...],
  x_dtype,
  w_dtype,
  k: int,
  n: int,
  transposed: bool,
) -> Decision:
  """The decision for this product shape among XLA and `builds` (kernel builds,
  as `product` names them): from this process, the store, or timed now. A stored
  decision timed over other builds is timed again."""
  key = shape_key(x_dtype, w_dtype, k, n, transposed)
  paths = {"xla", *builds}
  timed_here = lambda d: d is not None and set(d.us) == paths
  with _lock:
    known = _decisions.setdefault(store, {})
    decision = known.get(key)
    if not timed_here(decision):
      decision = _load(store).get(key)
    if not timed_here(decision):
      decision = _in_thread(lambda: _measure(product, builds, x_dtype, w_dtype, k, n, transposed))
      _save(store, key, decision)
    known[key] = decision
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


def weight_copies(w: jax.Array) -> tuple[jax.Array, ...]:
  """`w` and copies of it, read in turn by `time_product` so that a product's
  weights come from memory, as in a decode step over a model larger than the
  cache, not from a cache that holds one matrix (a 16 MB float32 2048x2048
  product ran 2.5x faster timed on one copy). Matrices of `_COPY_MIN_BYTES` or
  more get enough copies to fill twice the CPU's largest cache, at most
  `_MAX_COPIES` (each copy is one more product in the compiled loop); smaller
  ones are timed alone, as they would be in a model that fits the cache."""
  nbytes = w.size * w.dtype.itemsize
  if nbytes < _COPY_MIN_BYTES:
    return (w,)
  count = min(-(-2 * cpu.largest_cache_bytes() // nbytes), _MAX_COPIES)
  return (w, *(jnp.array(w, copy=True) for _ in range(count - 1)))


def time_product(
  product: Product, x: jax.Array, ws: tuple[jax.Array, ...], path: str, num_runs: int = _NUM_RUNS
) -> float:
  """Seconds of one `product(x, w, path)`, w taken in turn from `ws` (copies of
  one weight matrix, `weight_copies`): a jitted loop of dependent products
  (enough that a call takes a few ms), one warm-up, the median of `num_runs` calls."""
  w = ws[0]
  estimate = max(w.size * w.dtype.itemsize / 20e9, 2 * x.shape[0] * w.size / 50e9, 2e-6)
  passes = int(min(max(_TARGET_CALL_S // (estimate * len(ws)), 1), 256))

  def body(x, ws):
    for w in ws:
      y = product(x, w, path)
      # Each product feeds the next through a scalar, so none is hoisted or dropped.
      x = x + (1e-30 * y[0, 0]).astype(x.dtype)
    return x

  run = jax.jit(lambda x, ws: jax.lax.fori_loop(0, passes, lambda _, x: body(x, ws), x))
  run(x, ws).block_until_ready()
  times = []
  for _ in range(num_runs):
    start = time.perf_counter()
    run(x, ws).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times) / (passes * len(ws))


def _measure(product: Product, builds, x_dtype, w_dtype, k, n, transposed) -> Decision:
  rng = np.random.default_rng(0)
  shape = (n, k) if transposed else (k, n)
  ws = weight_copies(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, w_dtype))
  xs = {rows: jnp.asarray(rng.standard_normal((rows, k), np.float32), x_dtype) for rows in ROWS}
  prefill_x = jnp.asarray(rng.standard_normal((PREFILL_ROWS, k), np.float32), x_dtype)
  # Each path in a block of its own, XLA last: XLA's bfloat16 dot converts the
  # weights into a temporary, and for about half a second after it the kernel
  # measured up to 1.6x slower (interleaved timings would favour XLA).
  us, prefill_us = {}, {}
  for path in (*builds, "xla"):
    us[path] = [time_product(product, xs[rows], ws, path) * 1e6 for rows in ROWS]
    prefill_us[path] = time_product(product, prefill_x, ws, path, num_runs=3) * 1e6
  return Decision.choose(us, prefill_us)


def _load(store: str) -> dict[str, Decision]:
  try:
    with open(store) as f:
      raw = json.load(f)
    # The timings are kept; the choice is made again, so a change of rule applies.
    return {
      key: Decision.choose(d["us"], d["prefill_us"])
      for key, d in raw.items()
      if all(len(times) == len(ROWS) for times in d["us"].values())
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

"""Timing rules and helpers shared by every measurement in `specjax.bench`.

Rules:
  * every timed call ends in `jax.block_until_ready`, so a time covers the device
    work and not just the asynchronous dispatch;
  * one warm-up call (trace + compile + run) precedes the timed runs, and the
    median of the timed runs is reported: robust to a noisy neighbour on a
    shared machine, where the mean is not;
  * the cost of one model call is measured as N calls inside one jitted
    `lax.fori_loop`, divided by N, so the per-call dispatch overhead is
    amortised the way it is inside the real `lax.while_loop`
    (`specjax.bench.costs`);
  * jitted helpers take the models as pytrees, as the generate functions do.

Sweeps that compile variant after variant free each one's programs
(`free_compiled_programs`) and hold their baseline outside JAX's caches
(`compile_ahead`).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp

from specjax.kernels import kernel_status
from specjax.validation import check_positive_int


def free_compiled_programs() -> None:
  """Drops every compiled program in JAX's caches and collects the garbage.

  Each XLA:CPU executable keeps memory mappings of its code (300 to 700 for a
  speculative program on the bundled pair), and they go only with the program.
  A process that compiles variant after variant passes the kernel's limit
  (`vm.max_map_count`, 65,530 by default) and dies inside a later compile
  ("Cannot allocate memory", then a segmentation fault). Sweeps call this after
  each variant, once they hold no reference to its programs.

  Only the executables go: traced jaxprs and lowered modules stay cached, so a
  freed program that is called again skips tracing and lowering (about 40% of
  its cost on a CPU; the tests share programs across modules this way) and is
  compiled again, or read back from the persistent compilation cache where one
  is configured. Programs compiled ahead of time that the caller still holds
  (`compile_ahead`) survive. On a JAX whose private caches differ from the
  ones named here, every cache is cleared (`jax.clear_caches`) instead.
  """
  for clear in _executable_cache_clears():
    clear()
  gc.collect()


def _executable_cache_clears() -> list[Callable[[], None]]:
  """The clear functions of JAX's caches that hold compiled executables (jit's
  C++ dispatch caches, `_pjit_lower`'s lowerings, which keep theirs, and
  `_cached_compilation`), or `[jax.clear_caches]`."""
  try:
    from jax._src import pjit
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax

    return [
      pjit._cpp_pjit_cache_fun_only.clear,
      pjit._cpp_pjit_cache_explicit_attributes.clear,
      _jax.PjitFunctionCache.clear_all,
      pjit._pjit_lower.cache_clear,
      pxla._cached_compilation.cache_clear,
    ]
  except (ImportError, AttributeError):
    return [jax.clear_caches]


def compile_ahead(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
  """`fn` compiled now for arguments like `args` and `kwargs`, held outside JAX's caches.

  The executable lives as long as the returned function, through
  `free_compiled_programs`: a sweep's baseline (autoregressive decoding, timed
  next to each variant in turn) compiles once. Every argument, positional or
  keyword, is traced (arrays and pytrees, models included); bind static
  options with `functools.partial` or a closure. Call it with arguments of the
  same shapes, dtypes and pytree structure, passed the same way.
  """
  return jax.jit(fn).lower(*args, **kwargs).compile()


def memory_map_count() -> int | None:
  """Lines of /proc/self/maps: the process's memory mappings (None off Linux)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall times of one function: the warm-up call and the timed runs.

  Attributes:
    first_s: seconds of the first call (trace + compile + one run).
    runs_s: seconds of each timed run after it.
  """

  first_s: float
  runs_s: tuple[float, ...]

  @property
  def median_s(self) -> float:
    return statistics.median(self.runs_s)

  @property
  def compile_s(self) -> float:
    """First call minus a steady call: an estimate of trace + compile time.

    Clamped at 0: with a persistent compilation cache hit the difference is
    noise around zero.
    """
    return max(0.0, self.first_s - self.median_s)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def time_calls(
  fns: Mapping[str, Callable[[], Any]], num_runs: int
) -> tuple[dict[str, Timing], dict[str, Any]]:
  """Times several zero-argument functions, one warm-up call each, then `num_runs` rounds.

  The rounds interleave the functions (a, b, a, b, ...) rather than running
  each back to back, so a slow phase of a shared machine hits all of them
  alike and their ratio stays fair.

  Args:
    fns: name -> function returning a pytree of arrays (blocked on).
    num_runs: timed runs per function, >= 1.

  Returns:
    `(timings, outputs)`: name -> `Timing`, name -> output of the last run.
  """
  check_positive_int("num_runs", num_runs)
  first, outputs = {}, {}
  for name, fn in fns.items():
    first[name], outputs[name] = _timed(fn)
  runs = {name: [] for name in fns}
  for _ in range(num_runs):
    for name, fn in fns.items():
      seconds, outputs[name] = _timed(fn)
      runs[name].append(seconds)
  timings = {name: Timing(first_s=first[name], runs_s=tuple(runs[name])) for name in fns}
  return timings, outputs


def random_prompts(
  key: jax.Array, batch_size: int, width: int, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
  """Uniform random token ids `[batch_size, width]` int32 and lengths `[batch_size]`.

  Every row is full width, so timings do not depend on padding. For synthetic
  (random-weight) models, where real text would mean nothing.
  """
  check_positive_int("batch_size", batch_size)
  check_positive_int("width", width)
  check_positive_int("vocab_size", vocab_size)
  prompts = jax.random.randint(key, (batch_size, width), 0, vocab_size, dtype=jnp.int32)
  return prompts, jnp.full((batch_size,), width, jnp.int32)


def cpu_model() -> str:
  """The CPU's model name as /proc/cpuinfo gives it (else the platform's processor)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def peak_memory_gb() -> float:
  """This process's peak resident memory so far, in GB (10^9 bytes)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak * (1 if sys.platform == "darwin" else 1024) / 1e9


def environment_info() -> dict[str, Any]:
  """Backend, device, CPU model and cores, library versions, whether specjax's
  CPU matmul kernel runs (`specjax.kernels.kernel_status`), the process's peak
  memory so far and the UTC date, for a result file."""
  device = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "cpu_model": cpu_model(),
    "cpu_count": os.cpu_count(),
    "cpu_matmul_kernel": kernel_status()["available"] if jax.default_backend() == "cpu" else None,
    "peak_memory_gb": round(peak_memory_gb(), 2),
    "jax_version": jax.__version__,
    "flax_version": flax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }

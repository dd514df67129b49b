"""Timing rules and helpers shared by every measurement in `specjax.bench`: every
timed call blocked on, one warm-up, the median of the timed runs. The rules and
why: docs/performance.md ("How `specjax.bench` measures").
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp

from specjax.kernels import cpu, kernel_status
from specjax.validation import check_positive_int


def free_compiled_programs() -> None:
  """Drops every compiled program in JAX's caches and collects the garbage.

  Each XLA:CPU executable holds memory mappings until it goes, and a sweep of
  many variants would pass `vm.max_map_count` (docs/performance.md). Only the
  executables go (traced and lowered modules stay cached); programs held from
  `compile_ahead` survive. On a JAX whose private caches differ from the ones
  named here, every cache is cleared (`jax.clear_caches`) instead.
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
  """`fn` compiled now for arguments like `args` and `kwargs`, held outside JAX's
  caches (it survives `free_compiled_programs`). Every argument is traced; bind
  static options with `functools.partial`. Call it with arguments of the same
  shapes, dtypes and structure, passed the same way.
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
    """First call minus a steady call: trace + compile time, clamped at 0 (a
    persistent-cache hit)."""

    return max(0.0, self.first_s - self.median_s)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def time_calls(
  fns: Mapping[str, Callable[[], Any]], num_runs: int
) -> tuple[dict[str, Timing], dict[str, Any]]:
  """Times several zero-argument functions, one warm-up call each, then `num_runs`
  interleaved rounds (a, b, a, b, ...).

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
  """Uniform random token ids `[batch_size, width]` int32 and full-width lengths
  `[batch_size]`, for random-weight models."""
  check_positive_int("batch_size", batch_size)
  check_positive_int("width", width)
  check_positive_int("vocab_size", vocab_size)
  prompts = jax.random.randint(key, (batch_size, width), 0, vocab_size, dtype=jnp.int32)
  return prompts, jnp.full((batch_size,), width, jnp.int32)


def peak_memory_gb() -> float:
  """This process's peak resident memory so far, in GB (10^9 bytes)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak * (1 if sys.platform == "darwin" else 1024) / 1e9


def environment_info() -> dict[str, Any]:
  """Backend, devices, the CPU (model, vector extensions, cores), library
  versions, `kernels.kernel_status()`, peak memory and the UTC date, for a
  result file."""

  device = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    **cpu.describe(),
    # Which kernel variant ran and, per product shape, kernel or XLA with the
    # timings behind the choice.
    "cpu_matmul_kernel": kernel_status() if jax.default_backend() == "cpu" else None,
    "peak_memory_gb": round(peak_memory_gb(), 2),
    "jax_version": jax.__version__,
    "flax_version": flax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }

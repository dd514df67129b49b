"""`matmul(x, w)`: the products of a decode step, on CPU through a kernel of our own.

XLA:CPU's dot neither streams the weights at the memory floor at decode's few
rows nor keeps gamma + 1 rows as cheap as one. `cpu_matmul.cc` reads each weight
once for all rows and sums each output in one fixed order, so a row's result is
the same whatever the other rows are (greedy verification compares them).

How a product is dispatched:
- at trace time, `uses_kernel` says whether a kernel build may take it: float32 /
  bfloat16, one device, the builds this CPU runs (`build.py`; `cpu.py` names
  the variants its vector extensions allow, `candidates` the ones timed) and
  the fastest of them and XLA's dot on this product shape here
  (`calibration.py`: timed once, then kept);
- such a product is one `specjax_matmul` primitive whose lowering follows the
  platform being lowered for: the kernel's FFI call on CPU, XLA's dot on every
  other platform and in `jax.export` (whose programs must not depend on a
  library built here).

`SPECJAX_CPU_KERNEL`: `auto` (default; a kernel that cannot be built is one
logged warning naming the cause, then XLA's dot), `1` (the kernel wherever it
can run, untimed; a failed build is an error), `0` (XLA's dot everywhere).
`SPECJAX_CPU_KERNEL_VARIANT` pins one build (`avx512_bf16`, `avx512`, `avx2`,
`generic`; default: the widest this CPU runs, with the AVX2 build timed beside
an AVX-512 one). Gradients go through XLA's dot.
Design and figures: docs/performance.md ("a CPU kernel of our own").
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.extend.core
import jax.numpy as jnp
from absl import logging
from jax._src import dispatch
from jax.interpreters import batching, mlir

from specjax import compiler_options
from specjax.kernels import build, calibration, cpu

# The most rows the kernel ever takes; a longer prefill goes to XLA's dot.
MAX_ROWS = 512
EXACT_ROWS = calibration.EXACT_ROWS
MODES = ("auto", "0", "1")
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def mode() -> str:
  """`SPECJAX_CPU_KERNEL`: "auto", "0" or "1"."""
  value = os.environ.get("SPECJAX_CPU_KERNEL", "auto")
  if value not in MODES:
    raise ValueError(f"SPECJAX_CPU_KERNEL must be one of {MODES}, got {value!r}.")
  return value


def variant() -> str:
  """The kernel build for this CPU: `SPECJAX_CPU_KERNEL_VARIANT`, else the fastest it runs."""
  supported = cpu.supported_variants()
  value = os.environ.get("SPECJAX_CPU_KERNEL_VARIANT", "auto")
  if value == "auto":
    return supported[0]
  if value not in supported:
    raise ValueError(
      f"SPECJAX_CPU_KERNEL_VARIANT must be 'auto' or one this CPU runs {supported}, got {value!r}."
    )
  return value


@functools.cache
def _load(name: str) -> build.Library | str:
  """The built library of variant `name`, or why it cannot be had (once per process)."""
  try:
    return build.build(name)
  except build.KernelUnavailable as e:
    return str(e)


_warned: set[str] = set()


def library() -> build.Library | None:
  """The kernel library this process uses, or None (mode 0, or it cannot be built:
  one warning per cause in mode auto).

  Raises:
    ValueError: SPECJAX_CPU_KERNEL or SPECJAX_CPU_KERNEL_VARIANT is invalid.
    RuntimeError: SPECJAX_CPU_KERNEL=1 and the kernel cannot be built.
  """
  if mode() == "0":
    return None
  loaded = _load(variant())
  if isinstance(loaded, build.Library):
    return loaded
  if mode() == "1":
    raise RuntimeError(f"SPECJAX_CPU_KERNEL=1 but the CPU matmul kernel is unavailable: {loaded}")
  if loaded not in _warned:
    _warned.add(loaded)
    logging.warning("specjax CPU matmul kernel unavailable, using XLA's dot: %s", loaded)
  return None


# Where the CPU's widest build is an AVX-512 one, the narrower builds are timed
# beside it, on products large enough for the difference to matter: AVX2's
# 256-bit tiles can win where AVX-512 runs at half width (Zen 4), and the plain
# AVX-512 build's float32 FMAs beat AVX512-BF16's vdpbf16ps on bfloat16
# products where that instruction is slow (2-core Xeon with AMX, 2026-12-06:
# six 1B layers at 5 rows 28 ms against 32, at 8 rows 37 against 45).
_ALTERNATE = {"avx512_bf16": ("avx512", "avx2"), "avx512": ("avx2",)}
_ALTERNATE_MIN_WEIGHTS = 1 << 20


def candidates() -> list[build.Library]:
  """The kernel builds calibration chooses among, first the one for this CPU's
  widest vectors (`library()`), then, unless SPECJAX_CPU_KERNEL_VARIANT names
  one build, the narrower builds beside an AVX-512 one (`_ALTERNATE`). A
  candidate that cannot be built is left out with one warning naming the cause.
  Empty in mode 0 or when the first cannot be built; only the first in mode 1,
  which times nothing (and there a first that cannot be built is an error).
  """
  first = library()
  if first is None:
    return []
  pinned = os.environ.get("SPECJAX_CPU_KERNEL_VARIANT", "auto") != "auto"
  if mode() == "1" or pinned:
    return [first]
  found = [first]
  for other in _ALTERNATE.get(first.variant, ()):
    if other not in cpu.supported_variants():
      continue
    loaded = _load(other)
    if isinstance(loaded, build.Library):
      found.append(loaded)
    elif loaded not in _warned:
      _warned.add(loaded)
      logging.warning("specjax CPU matmul kernel: the %s build is unavailable: %s", other, loaded)
  return found


def uses_kernel(rows: int, dtype, w_dtype, k: int, n: int, *, transposed: bool = False) -> bool:
  """Whether a product `[rows, k] @ [k, n]` (x and result in `dtype`, weights in
  `w_dtype`; `transposed`: w stored `[n, k]`) runs on the kernel.

  Raises:
    ValueError: SPECJAX_CPU_KERNEL or SPECJAX_CPU_KERNEL_VARIANT is invalid.
    RuntimeError: SPECJAX_CPU_KERNEL=1 and the kernel cannot be built.
  """
  return _choose(rows, dtype, w_dtype, k, n, transposed) is not None


def _choose(rows, dtype, w_dtype, k, n, transposed) -> str | None:
  """The FFI target for this product, or None for XLA's dot."""
  if mode() == "0" or jnp.dtype(dtype) not in _DTYPES or jnp.dtype(w_dtype) not in _DTYPES:
    return None
  if not (0 < rows <= MAX_ROWS and k > 0 and n > 0):
    return None
  # A kernel call on one device; sharded products are left to XLA's partitioner.
  if compiler_options.current_platform() != "cpu" or jax.device_count() != 1:
    return None
  libs = candidates()
  if not libs:
    return None
  if mode() == "1":
    return libs[0].target(transposed)
  if k * n < _ALTERNATE_MIN_WEIGHTS:
    libs = libs[:1]
  targets = {lib.variant: lib.target(transposed) for lib in libs}
  store = calibration.store_path(libs[0].path)
  timed = lambda x, w, path: product(x, w, dtype, transposed, targets.get(path))
  decision = calibration.decide(store, timed, tuple(targets), dtype, w_dtype, k, n, transposed)
  return targets.get(decision.path_for(rows))


def product(x: jax.Array, w: jax.Array, out_dtype, transposed: bool, target: str | None):
  """`x [M, K] @ w` -> `[M, N]` in `out_dtype` through the FFI `target` (a
  `build.Library.target`), or XLA's dot when None: one path, no dispatch rules
  (timing and benchmarks compare the two)."""
  if target is None:
    return _xla_product(x, w, out_dtype=jnp.dtype(out_dtype), transposed=transposed)
  return _kernel_product(x, w, out_dtype, transposed, target)


def kernel_status() -> dict:
  """What the CPU matmul kernel does here, for result files: `mode`, `variant`,
  `available`, `detail` (the library's path or why not), `candidates` (the
  builds timed against XLA), the CPU (`cpu_model`, `cpu_extensions`,
  `cpu_count`) and `decisions` (the build or "xla" per product shape, with the
  timings, as this process chose them)."""
  status = {"mode": os.environ.get("SPECJAX_CPU_KERNEL", "auto"), **cpu.describe()}
  try:
    status["variant"] = variant()
    loaded = _load(status["variant"]) if mode() != "0" else "SPECJAX_CPU_KERNEL=0"
  except ValueError as e:
    status["variant"], loaded = None, str(e)
  status["available"] = isinstance(loaded, build.Library)
  status["detail"] = loaded.path if status["available"] else loaded
  status["candidates"] = [lib.variant for lib in candidates()] if status["available"] else []
  status["exact_rows"] = EXACT_ROWS
  status["decisions"] = calibration.decisions()
  return status


# The product as one primitive, lowered per platform.
matmul_p = jax.extend.core.Primitive("specjax_matmul")


def _xla_product(x, w, *, out_dtype, transposed, target=None):
  """XLA's dot: `x [M, K] @ w` -> `[M, N]` in out_dtype (w cast to x's dtype)."""
  wk = (w.T if transposed else w).astype(x.dtype)
  return jnp.matmul(x, wk, preferred_element_type=out_dtype).astype(out_dtype)


def _abstract(x, w, *, out_dtype, transposed, target):
  n = w.shape[0] if transposed else w.shape[1]
  return jax.core.ShapedArray((x.shape[0], n), out_dtype)


_xla_lowering = mlir.lower_fun(_xla_product, multiple_results=False)


def _cpu_lowering(ctx, x, w, *, out_dtype, transposed, target):
  # An exported program must run wherever it is loaded, without our library.
  if target is None or ctx.module_context.lowering_parameters.for_export:
    return _xla_lowering(ctx, x, w, out_dtype=out_dtype, transposed=transposed, target=target)
  return jax.ffi.ffi_lowering(target)(ctx, x, w)


def _batched(args, dims, *, out_dtype, transposed, target):
  x, w = args
  bx, bw = dims
  if bw is not None:  # per-example weights: XLA's batched dot
    xla = functools.partial(_xla_product, out_dtype=out_dtype, transposed=transposed)
    return jax.vmap(xla, in_axes=(bx, bw))(x, w), 0
  x = jnp.moveaxis(x, bx, 0)
  b, m, k = x.shape
  y = matmul_p.bind(
    x.reshape(b * m, k), w, out_dtype=out_dtype, transposed=transposed, target=target
  )
  return y.reshape(b, m, -1), 0


matmul_p.def_impl(functools.partial(dispatch.apply_primitive, matmul_p))
matmul_p.def_abstract_eval(_abstract)
mlir.register_lowering(matmul_p, _xla_lowering)
mlir.register_lowering(matmul_p, _cpu_lowering, platform="cpu")
batching.primitive_batchers[matmul_p] = _batched


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _kernel_product(x, w, out_dtype, transposed: bool, target: str):
  """`x [M, K] @ w [K, N]` (or `@ w[N, K].T` when `transposed`) -> `[M, N]` in
  `out_dtype`, through `target` when lowered for CPU."""
  return matmul_p.bind(x, w, out_dtype=jnp.dtype(out_dtype), transposed=transposed, target=target)


def _product_fwd(x, w, out_dtype, transposed, target):
  return _kernel_product(x, w, out_dtype, transposed, target), (x, w)


def _product_bwd(out_dtype, transposed, target, residuals, g):
  # XLA's products: gradients are for training, whose batches are large.
  x, w = residuals
  wk = (w.T if transposed else w).astype(g.dtype)  # [K, N]
  dx = jnp.matmul(g, wk.T, preferred_element_type=jnp.float32)
  dw = jnp.matmul(x.T.astype(g.dtype), g, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), (dw.T if transposed else dw).astype(w.dtype)


_kernel_product.defvjp(_product_fwd, _product_bwd)


def matmul(x: jax.Array, w: jax.Array, dtype=None, *, transposed: bool = False) -> jax.Array:
  """`x [..., K] @ w [K, N]` -> `[..., N]` in `dtype` (default x's), float32
  accumulation: the kernel when `uses_kernel` says so, else XLA's dot (w cast
  to x's dtype, as `nnx.Linear` does). `transposed`: w is `[N, K]` (tied head)."""
  dtype = jnp.dtype(dtype or x.dtype)
  *lead, k = x.shape
  n_axis = 0 if transposed else 1
  if w.ndim != 2 or w.shape[1 - n_axis] != k:
    layout = f"[N, K={k}]" if transposed else f"[K={k}, N]"
    raise ValueError(f"w must be {layout}, got shape {w.shape}.")
  rows, n = math.prod(lead), w.shape[n_axis]
  target = _choose(rows, dtype, w.dtype, k, n, transposed)
  if target is not None:
    y = _kernel_product(x.reshape(rows, k).astype(dtype), w, dtype, transposed, target)
    return y.reshape(*lead, n)
  wk = w.T if transposed else w
  return jnp.matmul(x, wk.astype(x.dtype), preferred_element_type=dtype).astype(dtype)

"""`matmul(x, w)`: the products of a decode step, on CPU through a kernel of our own.

XLA:CPU's dot neither streams the weights at the memory floor at decode's few
rows nor keeps gamma + 1 rows as cheap as one. `cpu_matmul.cc` reads each weight
once for up to 8 rows and sums each output in a fixed order, so a row's result
is the same whatever the other rows (greedy verification compares them). It is
compiled on first use with `-march=native`, cached under `$SPECJAX_KERNEL_CACHE`
(default `~/.cache/specjax/kernels`, keyed by source, jax version, compiler and
CPU flags) and registered as the FFI target `specjax_cpu_matmul`.

`uses_kernel` decides at trace time: float32 / bfloat16 products of at most
`MAX_ROWS[w.dtype]` rows on one CPU device, once built. `SPECJAX_CPU_KERNEL=0`
keeps XLA's dot everywhere; `=1` makes a failed build an error instead of a
logged fallback. Gradients go through XLA's dot. Measurements and the design:
docs/performance.md ("a CPU kernel of our own").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

TARGET = "specjax_cpu_matmul"
TARGET_T = "specjax_cpu_matmul_t"  # w stored [N, K] (a tied head's embedding)
# The most rows the kernel takes, by the weights' dtype: it reads w once per 8
# rows, so its cost grows with the rows past 8. float32: XLA's blocked product
# wins from 16 rows on; bfloat16: XLA converts the whole weight to float32 first,
# and the kernel stays faster up to a 512-token prefill (a chain of 1B-shaped
# layers, 2-core AMD EPYC, 2026-12-03: float32 16 rows XLA 365 ms / kernel 487;
# bfloat16 16 rows 1903 / 372, 64 rows 2203 / 1144, 512 rows 10757 / 6241).
MAX_ROWS = {jnp.dtype(jnp.float32): 8, jnp.dtype(jnp.bfloat16): 512}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_matmul.cc")
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MODES = ("auto", "0", "1")


def _cpu_flags() -> str:
  """The CPU's feature flags as /proc/cpuinfo lists them ("" where it does not)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def _compile(compiler: str, flags: list[str], path: str) -> None:
  """Compiles the kernel to `path` atomically (another process may be building it)."""
  directory = os.path.dirname(path)
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
  os.close(fd)
  try:
    subprocess.run(
      [compiler, *flags, _SOURCE, "-o", tmp], check=True, capture_output=True, text=True
    )
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@functools.cache
def _build() -> tuple[bool, str]:
  """Builds (or finds in the cache), loads and registers the kernel once per
  process: `(available, the library's path or why not)`."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
  if not compiler:
    return False, "no C++ compiler (g++ or clang++; or set CXX)"
  flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
  flags.append(f"-I{jax.ffi.include_dir()}")
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(
    b"\0".join(
      [source, jax.__version__.encode(), compiler.encode(), " ".join(flags).encode()]
      + [_cpu_flags().encode()]
    )
  ).hexdigest()[:16]
  cache = os.environ.get("SPECJAX_KERNEL_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "specjax", "kernels"
  )
  path = os.path.join(cache, f"cpu_matmul-{key}.so")
  try:
    if not os.path.exists(path):
      _compile(compiler, flags, path)
    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in ((TARGET, library.SpecjaxMatmul), (TARGET_T, library.SpecjaxMatmulT)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
  except (OSError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    return False, f"the kernel did not build: {detail.strip()[-2000:]}"
  return True, path


def _mode() -> str:
  mode = os.environ.get("SPECJAX_CPU_KERNEL", "auto")
  if mode not in _MODES:
    raise ValueError(f"SPECJAX_CPU_KERNEL must be one of {_MODES}, got {mode!r}.")
  return mode


def kernel_status() -> dict:
  """What the CPU matmul kernel does on this machine, for result files:
  `{"available", "detail" (its path or why not), "avx512_bf16", "mode"}`."""
  available, detail = _build() if _mode() != "0" else (False, "SPECJAX_CPU_KERNEL=0")
  return {
    "available": available,
    "detail": detail,
    "avx512_bf16": "avx512_bf16" in _cpu_flags().split(),
    "mode": _mode(),
  }


def uses_kernel(rows: int, x_dtype, w_dtype) -> bool:
  """Whether a product of `rows` rows in these dtypes runs on the kernel.

  Raises:
    ValueError: SPECJAX_CPU_KERNEL is not "auto", "0" or "1".
    RuntimeError: SPECJAX_CPU_KERNEL=1 and the kernel cannot build.
  """
  mode = _mode()
  if mode == "0" or jnp.dtype(x_dtype) not in _DTYPES or jnp.dtype(w_dtype) not in _DTYPES:
    return False
  if rows > MAX_ROWS[jnp.dtype(w_dtype)]:
    return False
  if jax.default_backend() != "cpu" or jax.device_count() != 1:
    return False
  available, detail = _build()
  if not available:
    if mode == "1":
      raise RuntimeError(f"SPECJAX_CPU_KERNEL=1 but {detail}")
    logging.log_first_n(logging.WARNING, "specjax CPU matmul kernel unavailable: %s", 1, detail)
  return available


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kernel_product(x: jax.Array, w: jax.Array, out_dtype, transposed: bool) -> jax.Array:
  """`x [M, K] @ w [K, N]` (or `@ w[N, K].T` when `transposed`) -> `[M, N]` in
  `out_dtype`, through the FFI target."""
  n = w.shape[0] if transposed else w.shape[1]
  out = jax.ShapeDtypeStruct((x.shape[0], n), out_dtype)
  target = TARGET_T if transposed else TARGET
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)


def _product_fwd(x, w, out_dtype, transposed):
  return _kernel_product(x, w, out_dtype, transposed), (x, w)


def _product_bwd(out_dtype, transposed, residuals, g):
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
  rows = math.prod(lead)
  if rows and uses_kernel(rows, dtype, w.dtype):
    y = _kernel_product(x.reshape(rows, k).astype(dtype), w, dtype, transposed)
    return y.reshape(*lead, w.shape[n_axis])
  wk = w.T if transposed else w
  return jnp.matmul(x, wk.astype(x.dtype), preferred_element_type=dtype).astype(dtype)

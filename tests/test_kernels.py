"""The CPU matmul kernel (specjax.kernels): same products as XLA's dot, a row's
result independent of the other rows, gradients, and the dispatch rules."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import cpu_matmul, kernel_status, matmul, uses_kernel

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or not (shutil.which("g++") or shutil.which("clang++")),
  reason="the kernel is built for the CPU backend by a C++ compiler",
)

F32, BF16 = jnp.float32, jnp.bfloat16


def _arrays(m, k, n, x_dtype, w_dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, w_dtype)
  return x, w


def _uses_custom_call(fn, *args) -> bool:
  return cpu_matmul.TARGET in jax.jit(fn).lower(*args).as_text()


def test_the_kernel_builds_here():
  status = kernel_status()
  assert status["available"], status["detail"]
  assert status["mode"] == "auto"


# Odd K (a bfloat16 pair with no partner), N not a multiple of the 32/128-wide
# tiles, and rows across the 8-row passes.
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 16])
@pytest.mark.parametrize(
  "x_dtype,w_dtype,out_dtype", [(F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, F32)]
)
def test_products_match_xla(m, x_dtype, w_dtype, out_dtype):
  x, w = _arrays(m, 301, 1000, x_dtype, w_dtype)
  product = lambda x, w: cpu_matmul._kernel_product(x.astype(out_dtype), w, out_dtype, False)
  got = jax.jit(product)(x, w)
  assert got.dtype == out_dtype and got.shape == (m, 1000)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  # float32 accumulation of 301 terms; a bfloat16 result is rounded once at the end.
  tol = 1e-4 if out_dtype == F32 else 2**-8
  np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("m", [1, 5, 9])
@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_transposed_weights_match_xla(m, x_dtype, w_dtype):
  """w stored [N, K], as a tied output head reads the [V, D] embedding."""
  x, w = _arrays(m, 301, 200, x_dtype, w_dtype)
  got = jax.jit(lambda x, w: cpu_matmul._kernel_product(x, w.T, F32, True))(x, w)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
  """One token and a block of gamma + 1 give bit-identical rows: greedy
  verification compares them."""
  x, w = _arrays(16, 2048, 1536, dtype, dtype, seed=1)
  for transposed in (False, True):
    weights = w.T if transposed else w
    product = jax.jit(lambda x, w, t=transposed: cpu_matmul._kernel_product(x, w, x.dtype, t))
    full = np.asarray(product(x, weights))
    for rows in (slice(0, 1), slice(3, 8), slice(5, 6), slice(2, 11)):
      np.testing.assert_array_equal(np.asarray(product(x[rows], weights)), full[rows])


def test_leading_axes_and_vmap():
  x, w = _arrays(6, 64, 96, F32, F32)
  expected = np.asarray(x) @ np.asarray(w)
  got = jax.jit(matmul)(x.reshape(2, 3, 64), w)
  np.testing.assert_allclose(np.asarray(got).reshape(6, 96), expected, rtol=1e-5, atol=1e-5)
  mapped = jax.jit(jax.vmap(matmul, in_axes=(0, None)))(x.reshape(3, 2, 64), w)
  np.testing.assert_allclose(np.asarray(mapped).reshape(6, 96), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_match_xla(transposed):
  x, w = _arrays(4, 40, 24, F32, F32)
  w = w.T if transposed else w
  ours = lambda x, w: matmul(x, w, transposed=transposed)
  theirs = lambda x, w: jnp.matmul(x, w.T if transposed else w)
  loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
  expected = jax.grad(loss(theirs), argnums=(0, 1))(x, w)
  for a, b in zip(got, expected):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dispatch_rules(monkeypatch):
  x, w = _arrays(4, 64, 32, F32, F32)
  assert _uses_custom_call(lambda x, w: matmul(x, w), x, w)
  big = jnp.zeros((cpu_matmul.MAX_ROWS[jnp.dtype(F32)] + 1, 64), F32)
  assert not _uses_custom_call(lambda x, w: matmul(x, w), big, w)  # prefill: XLA's dot
  assert _uses_custom_call(lambda x, w: matmul(x, w), big.astype(BF16), w.astype(BF16))
  assert not uses_kernel(4, jnp.float16, F32)
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
  assert not _uses_custom_call(lambda x, w: matmul(x, w), x, w)
  assert kernel_status()["available"] is False
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "yes")
  with pytest.raises(ValueError, match="SPECJAX_CPU_KERNEL must be one of"):
    uses_kernel(4, F32, F32)


def test_bad_shapes_are_refused():
  x, w = _arrays(2, 64, 32, F32, F32)
  with pytest.raises(ValueError, match=r"w must be \[K=64, N\]"):
    matmul(x, w.T)
  with pytest.raises(ValueError, match=r"w must be \[N, K=64\]"):
    matmul(x, w, transposed=True)

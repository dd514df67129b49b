"""The CPU matmul kernel (specjax.kernels): every variant this CPU runs (the AVX2
build included, on an AVX-512 machine) computes XLA's products with a row's
result independent of the other rows; a kernel that cannot be built is one
warning and XLA's dot; dispatch follows the platform lowered for."""

import logging
import os
import re
import shutil
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import pretrained, trees
from specjax.kernels import build, calibration, cpu, cpu_matmul, kernel_status, matmul, uses_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or not (shutil.which("g++") or shutil.which("clang++")),
  reason="the kernel is built for the CPU backend by a C++ compiler",
)

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# The builds tested here: this CPU's own and those calibration may choose beside
# it (plain AVX-512, AVX2: what an AVX2-only CPU such as Zen 3 runs), and the
# portable one (ARM's code).
VARIANTS = list(dict.fromkeys([cpu.supported_variants()[0], "avx512", "avx2", "generic"]))
VARIANTS = [v for v in VARIANTS if v in cpu.supported_variants()]
MIXES = [(x, w, y) for x in (F32, BF16) for w in (F32, BF16) for y in (F32, BF16)]


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
  return build.build(request.param)


def _arrays(m, k, n, x_dtype, w_dtype, seed=0, transposed=False):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
  w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)) * 0.1, w_dtype)
  return x, w


def _product(lib, out_dtype, transposed):
  target = lib.target(transposed)
  return jax.jit(lambda x, w: cpu_matmul.product(x, w, out_dtype, transposed, target))


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
  """A process state where the kernel was never built, with an empty cache."""
  monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(tmp_path / "cache"))
  cpu_matmul._load.cache_clear()
  cpu_matmul._warned.clear()
  jax.clear_caches()
  yield tmp_path
  cpu_matmul._load.cache_clear()
  cpu_matmul._warned.clear()
  jax.clear_caches()


def _fake_compiler(tmp_path, body: str) -> str:
  """A CXX that answers --version and then runs `body` (sh) for a compile."""
  path = tmp_path / "fake-cxx"
  path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n{body}\n')
  path.chmod(0o755)
  return str(path)


# Products and exactness, per variant.


def test_the_kernel_builds_here():
  status = kernel_status()
  assert status["available"], status["detail"]
  assert status["variant"] == cpu.supported_variants()[0]
  assert status["cpu_model"] and isinstance(status["cpu_extensions"], list)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "-".join(d.name for d in m))
def test_products_match_float64(lib, mix, transposed):
  """Odd K (a bfloat16 pair with no partner), N not a multiple of any tile."""
  x_dtype, w_dtype, out_dtype = mix
  x, w = _arrays(9, 301, 1000, x_dtype, w_dtype, transposed=transposed)
  got = _product(lib, out_dtype, transposed)(x, w)
  assert got.dtype == out_dtype and got.shape == (9, 1000)
  wk = np.asarray(w, np.float64)
  exact = np.asarray(x, np.float64) @ (wk.T if transposed else wk)
  # float32 accumulation of 301 terms; a bfloat16 result is rounded once at the end.
  tol = 1e-4 if out_dtype == F32 else 2**-8
  np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "-".join(d.name for d in m))
def test_a_rows_result_does_not_depend_on_the_other_rows(lib, mix, transposed):
  """Row by row, bit for bit: alone, in any block of 1-16 rows, or among 64,
  with N split between threads and ragged, K odd. Greedy verification compares
  a decode step's one row with the same row among gamma + 1."""
  x_dtype, w_dtype, out_dtype = mix
  x, w = _arrays(64, 301, 1000, x_dtype, w_dtype, seed=1, transposed=transposed)
  product = _product(lib, out_dtype, transposed)
  full = np.asarray(product(x, w), np.float32)
  # Every block size for the homogeneous mixes, a sample for the others.
  sizes = range(1, 17) if len(set(mix)) == 1 else (1, 5, 9, 16)
  for size in sizes:
    start = (7 * size) % (64 - size)
    part = np.asarray(product(x[start : start + size], w), np.float32)
    np.testing.assert_array_equal(part, full[start : start + size], err_msg=f"rows {size}")


def test_zero_sized_products(lib):
  x, w = _arrays(3, 0, 40, F32, F32)
  got = _product(lib, F32, False)(x, w)
  assert got.shape == (3, 40) and not np.asarray(got).any()  # K = 0: zeros
  x, w = _arrays(3, 16, 0, F32, F32)
  assert _product(lib, F32, False)(x, w).shape == (3, 0)
  assert matmul(jnp.zeros((0, 16)), jnp.ones((16, 8))).shape == (0, 8)


# Dispatch.


def test_leading_axes_and_vmap(monkeypatch):
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  x, w = _arrays(6, 64, 96, F32, F32)
  expected = np.asarray(x) @ np.asarray(w)
  got = jax.jit(matmul)(x.reshape(2, 3, 64), w)
  np.testing.assert_allclose(np.asarray(got).reshape(6, 96), expected, rtol=1e-5, atol=1e-5)
  mapped = jax.jit(jax.vmap(matmul, in_axes=(0, None)))(x.reshape(3, 2, 64), w)
  np.testing.assert_allclose(np.asarray(mapped).reshape(6, 96), expected, rtol=1e-5, atol=1e-5)
  per_example = jax.jit(jax.vmap(matmul))(x.reshape(3, 2, 64), jnp.stack([w] * 3))
  np.testing.assert_allclose(np.asarray(per_example).reshape(6, 96), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_match_xla(monkeypatch, transposed):
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  x, w = _arrays(4, 40, 24, F32, F32, transposed=transposed)
  ours = lambda x, w: matmul(x, w, transposed=transposed)
  theirs = lambda x, w: jnp.matmul(x, w.T if transposed else w)
  loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
  expected = jax.grad(loss(theirs), argnums=(0, 1))(x, w)
  for a, b in zip(got, expected):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _calls_kernel(fn, *args) -> bool:
  # A new function each time: jit keeps traces by function, and the mode is read
  # when tracing.
  return build.TARGET in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def test_modes(monkeypatch):
  x, w = _arrays(4, 64, 32, F32, F32)
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  assert _calls_kernel(matmul, x, w)
  too_many = jnp.zeros((cpu_matmul.MAX_ROWS + 1, 64), F32)
  assert not _calls_kernel(matmul, too_many, w)  # a long prefill: XLA's dot
  assert not uses_kernel(4, jnp.float16, F32, 64, 32)
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
  assert not _calls_kernel(matmul, x, w)
  assert kernel_status()["available"] is False
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "yes")
  with pytest.raises(ValueError, match="SPECJAX_CPU_KERNEL must be one of"):
    uses_kernel(4, F32, F32, 64, 32)
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "auto")
  monkeypatch.setenv("SPECJAX_CPU_KERNEL_VARIANT", "sve9")
  with pytest.raises(ValueError, match="SPECJAX_CPU_KERNEL_VARIANT must be 'auto' or one"):
    uses_kernel(4, F32, F32, 64, 32)


def test_auto_times_each_shape_once_and_keeps_the_choice(monkeypatch):
  """In auto mode a new product shape is timed (kernel and XLA), the choice is
  recorded in kernel_status() and the decisions file, and every row count up
  to EXACT_ROWS takes the same path."""
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "auto")
  x, w = _arrays(3, 96, 136, F32, F32)
  key = calibration.shape_key(F32, F32, 96, 136, False)
  calls_kernel = _calls_kernel(matmul, x, w)
  decision = kernel_status()["decisions"][key]
  assert calls_kernel == (decision["path"] != "xla")
  assert set(decision["us"]) == {"xla", cpu_matmul.library().variant}  # too small for two builds
  assert all(len(us) == len(calibration.ROWS) for us in decision["us"].values())
  for rows in (1, 5, 17, calibration.EXACT_ROWS):
    assert _calls_kernel(matmul, jnp.zeros((rows, 96)), w) == calls_kernel
  store = calibration.store_path(cpu_matmul.library().path)
  assert key in calibration._load(store)


def test_auto_times_every_candidate_build_on_large_shapes(monkeypatch):
  """A product with at least 2^20 weights is timed through every candidate build
  (this CPU's widest, and the narrower ones beside an AVX-512 one) and XLA; the
  fastest runs it."""
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "auto")
  monkeypatch.delenv("SPECJAX_CPU_KERNEL_VARIANT", raising=False)
  names = [lib.variant for lib in cpu_matmul.candidates()]
  widest = cpu.supported_variants()[0]
  assert names == {"avx512_bf16": [widest, "avx512", "avx2"], "avx512": [widest, "avx2"]}.get(
    widest, [widest]
  )
  x, w = _arrays(2, 1024, 1024, BF16, BF16)
  text = jax.jit(lambda a, b: matmul(a, b)).lower(x, w).as_text()
  decision = kernel_status()["decisions"][calibration.shape_key(BF16, BF16, 1024, 1024, False)]
  assert set(decision["us"]) == set(decision["prefill_us"]) == {"xla", *names}
  if decision["path"] == "xla":
    assert build.TARGET not in text
  else:
    assert f"{build.TARGET}_{decision['path']}_" in text
  assert kernel_status()["candidates"] == names


def test_timing_reads_weights_from_memory_not_a_cache(monkeypatch):
  """Calibration times a product of 1 MiB of weights or more over copies of
  them that together fill twice the largest cache (at most 8), each a buffer of
  its own; a smaller matrix alone."""
  monkeypatch.setattr(cpu, "largest_cache_bytes", lambda: 2 << 20)
  copies = calibration.weight_copies(jnp.ones((512, 512), F32))  # 1 MiB -> 4 copies
  assert len(copies) == 4
  assert len({c.unsafe_buffer_pointer() for c in copies}) == 4
  assert all(bool((c == 1).all()) for c in copies)
  assert len(calibration.weight_copies(jnp.ones((512, 256), F32))) == 1  # under 1 MiB
  assert len(calibration.weight_copies(jnp.ones((1024, 1024), F32))) == 1  # 4 MiB
  monkeypatch.setattr(cpu, "largest_cache_bytes", lambda: 64 << 20)
  assert len(calibration.weight_copies(jnp.ones((512, 512), F32))) == 8  # capped


def test_the_choice_rule():
  """A build takes a shape when it is faster at one row, or over the row counts
  timed (the geometric mean of the ratios), even if slower at some; of two such
  builds the lower geometric mean wins, one row counted twice."""

  def path(a, xla=(11, 20), b=None):
    us = {"xla": xla, "a": a} | ({"b": b} if b else {})
    return calibration.Decision.choose(us, {"xla": 5, "a": 6}).path

  assert path([10, 20]) == "a"
  assert path([12, 30]) == "xla"
  assert path([10, 60]) == "a"  # faster at one row, 3x slower at the other
  assert path([12, 10]) == "a"  # 9% slower at one row, 2x faster at the other
  assert path([12, 30], b=[12, 15]) == "b"
  assert path([10, 20], b=[11, 10]) == "b"  # geometric means 0.94 vs 0.79 (one row twice)
  assert path([7, 20], b=[11, 10]) == "a"  # 0.74 vs 0.79
  # A time above a larger row count's is noise: 1 row at 30 counts as 10.
  assert path([30, 10], xla=(11, 10.5)) == "a"  # uncapped: 2.7x slower at one row
  decision = calibration.Decision.choose({"xla": [30, 20], "a": [10, 21]}, {"a": 6, "xla": 5})
  assert decision.path_for(calibration.EXACT_ROWS) == "a"
  assert decision.path_for(calibration.EXACT_ROWS + 1) == "xla"  # prefill: XLA was faster


# Failures: one warning naming the cause, then XLA's dot.


def _cause(monkeypatch, tmp_path, case) -> str:
  """Sets up one failure; returns a regex of the message naming it."""
  if case == "no compiler":
    monkeypatch.setenv("CXX", "/bin/false")
    return r"/bin/false --version failed"
  if case == "missing compiler":
    monkeypatch.setenv("CXX", "no-such-c++")
    return r"CXX='no-such-c\+\+' was not found"
  if case == "compile error":
    missing = "fatal error: xla/ffi/api/ffi.h: No such file or directory"
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, f"echo '{missing}' >&2; exit 1"))
    return r"compiling the kernel \(fake-cxx\) failed \(exit 1\): fatal error: xla/ffi"
  if case == "cache under a file":
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    return r"cannot create the kernel cache"
  if case == "cache of another user":
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(other))
    return r"is owned by uid 65534, not by this user"
  if case == "cache writable by others":
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(shared))
    return r"writable by group or others \(mode 777\)"
  if case == "truncated library":
    # The first 4 KB of a shared library (numpy's), where the kernel's would be:
    # what an interrupted copy or a full disk leaves.
    os.makedirs(build.cache_dir(), mode=0o700)
    with open(np._core._multiarray_umath.__file__, "rb") as good:
      head = good.read(4096)
    with open(build.recipe(cpu_matmul.variant()).path, "wb") as cut:
      cut.write(head)
    return r"is corrupt .*delete it to rebuild"
  if case == "missing symbol":
    source = tmp_path / "empty.cc"
    source.write_text("int specjax_nothing;\n")
    monkeypatch.setattr(build, "SOURCE", str(source))
    return r"lacks a symbol: .*SpecjaxKernelIsa"
  raise AssertionError(case)


CAUSES = [
  "no compiler",
  "missing compiler",
  "compile error",
  "cache under a file",
  "cache of another user",
  "cache writable by others",
  "truncated library",
  "missing symbol",
]


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("case", CAUSES)
def test_a_kernel_that_cannot_be_built_is_one_warning_then_xla(
  fresh_kernel, monkeypatch, caplog, case
):
  cause = _cause(monkeypatch, fresh_kernel, case)
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "auto")
  x, w = _arrays(3, 64, 48, F32, F32)
  with caplog.at_level(logging.WARNING):
    for rows in (3, 2):  # two traces, one warning
      got = jax.jit(matmul)(x[:rows], w)
      np.testing.assert_allclose(np.asarray(got), np.asarray(x[:rows] @ w), rtol=1e-5, atol=1e-5)
  warnings = [r.getMessage() for r in caplog.records if "kernel unavailable" in r.getMessage()]
  assert len(warnings) == 1, warnings
  assert re.search(cause, warnings[0]), warnings[0]
  assert not _calls_kernel(matmul, x, w)
  status = kernel_status()
  assert status["available"] is False and re.search(cause, status["detail"])
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  with pytest.raises(RuntimeError, match="SPECJAX_CPU_KERNEL=1 but the CPU matmul kernel"):
    matmul(x, w)


def test_the_cache_is_private_and_keyed_by_the_compiler(fresh_kernel, monkeypatch):
  library = build.build(cpu_matmul.variant())
  directory = os.path.dirname(library.path)
  assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
  assert os.path.exists(os.path.join(directory, ".lock"))
  assert build.recipe(cpu_matmul.variant()).path == library.path
  # Another compiler version (here: a wrapper reporting one) is another library
  # (the recipe's key; building it would only compile the same source again).
  wrapper = _fake_compiler(fresh_kernel, f'exec {build.compiler()} "$@"')
  monkeypatch.setenv("CXX", wrapper)
  assert build.recipe(cpu_matmul.variant()).path != library.path


def test_the_main_job_runs_with_the_build_failing(tmp_path):
  env = dict(os.environ, CXX="/bin/false", SPECJAX_KERNEL_CACHE=str(tmp_path / "cache"))
  env.pop("SPECJAX_CPU_KERNEL", None)
  done = subprocess.run(
    [sys.executable, "-m", "experiments.decode", "--config.max_new_tokens=8",
     "--config.num_runs=3", "--config.report_floor=False"],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stderr.count("kernel unavailable") == 1, done.stderr[-3000:]
  assert "/bin/false --version failed" in done.stderr


# Export and the platform lowered for.


@pytest.fixture(scope="module")
def pair():
  target, draft, _ = pretrained.load_pair()
  return target, draft


def test_exports_hold_no_cpu_custom_call(pair, monkeypatch):
  """An exported program must run where our library was never built: for cuda
  and tpu (lowered on this CPU host) and for cpu alike, the target's forward
  and the speculative decoding program hold XLA's dot, not the kernel."""
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  jax.clear_caches()
  target, draft = pair
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  forward = jax.jit(lambda model, tokens: model(tokens))
  assert build.TARGET in forward.lower(target, tokens).as_text()  # jit on CPU: the kernel
  for platform in ("cpu", "cuda", "tpu"):
    exported = jax.export.export(forward, platforms=(platform,))(target, tokens)
    assert build.TARGET not in exported.mlir_module(), platform
  from specjax.bench.compile import lower_speculative

  program = lower_speculative(target, draft, batch=1, prompt_len=8, max_new_tokens=8, gamma=4)
  assert build.TARGET in program.as_text()
  for platform in ("cpu", "cuda", "tpu"):
    exported = _export_speculative(target, draft, platform)
    assert build.TARGET not in exported.mlir_module(), platform
  # The cpu export runs here and computes the forward's logits.
  exported_forward = jax.export.export(forward, platforms=("cpu",))(target, tokens)
  np.testing.assert_allclose(
    np.asarray(exported_forward.call(target, tokens)),
    np.asarray(forward(target, tokens)),
    rtol=2e-5,
    atol=2e-5,
  )


def _export_speculative(target, draft, platform):
  from specjax.bench.compile import speculative_program

  program, args, kwargs = speculative_program(
    target, draft, batch=1, prompt_len=8, max_new_tokens=8, gamma=4
  )
  return jax.export.export(program, platforms=(platform,))(*args, **kwargs)


# Greedy speculative decoding equals greedy decoding through the kernel.


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_greedy_speculation_equals_greedy_decoding_through_the_kernel(pair, monkeypatch, batch):
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  jax.clear_caches()
  target, draft = pair
  _assert_greedy_equal(target, draft, batch, max_new_tokens=24)


def test_a_17_node_tree_equals_greedy_decoding_through_the_kernel(pair, monkeypatch):
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "1")
  jax.clear_caches()
  target, draft = pair
  tree = trees.full((4, 3))  # 16 nodes: 17 rows scored
  drafter = specjax.drafting.TreeDrafter(draft, tree)
  _assert_greedy_equal(target, drafter, 1, max_new_tokens=24, gamma=len(tree))


@pytest.mark.slow  # 4 GB of weights, minutes on 2 cores
def test_greedy_equal_at_the_1b_shape(monkeypatch):
  monkeypatch.delenv("SPECJAX_CPU_KERNEL", raising=False)
  target, draft, _ = pretrained.load_pair(scale="1b", draft_dtype=jnp.bfloat16)
  for batch in (1, 2, 4):
    _assert_greedy_equal(target, draft, batch, max_new_tokens=16)
  tree = trees.full((4, 3))
  drafter = specjax.drafting.TreeDrafter(draft, tree)
  _assert_greedy_equal(target, drafter, 1, max_new_tokens=16, gamma=len(tree))


def _assert_greedy_equal(target, draft, batch, max_new_tokens, gamma=4):
  from specjax.data.prompts import encode_prompts

  _, _, tokenizer = pretrained.load_pair()
  texts = ["def fib(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
  prompts, lengths = encode_prompts(tokenizer, texts[:batch])
  plain = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=max_new_tokens, sampling=specjax.GREEDY
  )
  spec = specjax.speculative_generate(
    target, draft, prompts, lengths, gamma=gamma, max_new_tokens=max_new_tokens,
    sampling=specjax.GREEDY,
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))


def test_bad_shapes_are_refused():
  x, w = _arrays(2, 64, 32, F32, F32)
  with pytest.raises(ValueError, match=r"w must be \[K=64, N\]"):
    matmul(x, w.T)
  with pytest.raises(ValueError, match=r"w must be \[N, K=64\]"):
    matmul(x, w, transposed=True)

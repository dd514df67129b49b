"""Shared test set-up: persistent compilation cache and tiny model fixtures."""

import gc
import os

# Set before jax is imported anywhere in the test process.
# The tests run on the CPU; with the [aot] extra installed, JAX would otherwise
# probe the CUDA plugin and libtpu at every start (errors on stderr, no driver).
# Compiling for those targets needs nothing else (specjax.aot).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Tests check behaviour, not speed: LLVM's cheapest optimisation level cuts the
# suite's compile time (most of a fresh CI run) by about a fifth. Matmuls run in
# precompiled library kernels either way. Subprocess suites inherit it. The
# 10^6-sample simulations, which run long, compile at level 1 per program
# (helpers.SIMULATION_COMPILER_OPTIONS); the chi-square batches of
# test_distribution.py lost by it, level 1's compiles eating the faster runs
# (from an empty cache, its temperature test 53 s against 29 s at level 0, its
# top-k test 35 s against 24 s; 2-core AMD EPYC, 2026-12-02).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()
# XLA's legacy elemental emitters for CPU fusions compile a speculative program
# in about 60% of the time of the default fusion emitters (1.4 s against 2.3 s
# for the tiny pair's, 30 s against 48 s for test_cross_tokenizer.py from an
# empty cache, 2026-11-30); kernels are correct either way.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# One LLVM module per program, compiled on one thread, and the plain scheduler:
# tests/test_generation.py from an empty cache took 183 s against 196 s without
# them (2-core AMD EPYC, 2026-12-01); with SPECJAX_SLOW_TESTS=1 the other core
# runs the front-door process (tests/test_front_door.py) meanwhile.
os.environ["XLA_FLAGS"] += "".join(
  f" {flag}"
  for flag in (
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
  )
  if flag.split("=")[0] not in os.environ["XLA_FLAGS"]
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# tests/multidevice needs 8 devices from its first jax import: it runs in its own
# process (tests/test_multidevice.py), never inside this one.
if "device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]
# tests/aot needs the accelerator compilers (the [aot] extra), which live in an
# environment of their own (tests/test_aot_suite.py starts it there).
if not os.environ.get("SPECJAX_AOT_SUITE"):
  collect_ignore = [*globals().get("collect_ignore", []), "aot"]

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import specjax
from helpers import TINY, TINY_DRAFT
from specjax import bench

# Subprocess suites started at collection (see `background`), by start function.
_BACKGROUND = {}


# Two tiers. The default run (`python -m pytest`, what .ci/run runs) checks every
# property at least once: each module, each verifier's exactness, every launcher
# at a small size, the README's and the quick guides' blocks. SPECJAX_SLOW_TESTS=1
# adds the slow tier: tests marked `slow` (a long guide, a launcher's full-size
# run, a further case of a property checked elsewhere) and the cases a `sample`
# marker leaves out of a parametrized test:
#   @pytest.mark.sample(1)                     # its first case only
#   @pytest.mark.sample("llama", "gemma3")     # the cases with these ids
# (JAX's own suite runs a sample of its parametrized cases the same way,
# JAX_NUM_GENERATED_CASES.)
SLOW = bool(os.environ.get("SPECJAX_SLOW_TESTS"))


def _in_default_tier(item, index: int) -> bool:
  """False for a `slow` item, or a case its test's `sample` marker leaves out
  (`index`: the case's position among its test's cases)."""
  if item.get_closest_marker("slow"):
    return False
  sample = item.get_closest_marker("sample")
  if sample is None or not hasattr(item, "callspec"):
    return True
  if any(isinstance(a, int) for a in sample.args):
    return index < sample.args[0]
  return item.callspec.id in sample.args


class _SampleIdsCheck:
  """Fails collection when a `sample` marker names a case its test does not have
  (a typo would leave the test out of the default tier unseen); runs before -k
  and -m deselect anything."""

  @pytest.hookimpl(tryfirst=True)
  def pytest_collection_modifyitems(self, items):
    ids: dict = {}
    for item in items:
      if item.get_closest_marker("sample") and hasattr(item, "callspec"):
        ids.setdefault(item.function, (item, set()))[1].add(item.callspec.id)
    for item, found in ids.values():
      wanted = {a for a in item.get_closest_marker("sample").args if isinstance(a, str)}
      if wanted - found:
        raise pytest.UsageError(f"{item.nodeid}: sample names no case {sorted(wanted - found)}")


class _Balance:
  """Marks every test of the files tests/test_front_door.py moves whole into its
  process (`BALANCE`) `front_door`; runs before -m selects by it."""

  @pytest.hookimpl(tryfirst=True)
  def pytest_collection_modifyitems(self, config, items):
    from test_front_door import BALANCE

    for item in items:
      if os.path.relpath(item.path, config.rootpath) in BALANCE:
        item.add_marker(pytest.mark.front_door)


def pytest_configure(config):
  config.pluginmanager.register(_SampleIdsCheck())
  config.pluginmanager.register(_Balance())
  config.addinivalue_line(
    "markers",
    "slow: the slow tier only (SPECJAX_SLOW_TESTS=1): a further case of a property the "
    "default run already checks, or a long guide or launcher run",
  )
  config.addinivalue_line(
    "markers",
    "sample(n or *ids): the default tier runs only these cases of a parametrized test "
    "(its first n, or those with these ids); SPECJAX_SLOW_TESTS=1 runs all",
  )
  config.addinivalue_line(
    "markers",
    "front_door: runs launchers, docs blocks or subprocesses, or balances the two processes; "
    "with tests/test_front_door.py selected, they run in its background process instead of "
    "this one",
  )


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they will
def pytest_collection_modifyitems(session, config, items):
  """Starts each selected test's `start_in_background` process right away; hands
  the front-door tests to tests/test_front_door.py's process when it is selected,
  and runs that test last, so that this process waits on it only at the end."""
  from test_front_door import start_front_door

  if not SLOW:
    skip = pytest.mark.skip(reason="slow tier: SPECJAX_SLOW_TESTS=1 runs it")
    cases: dict = {}  # a test's cases so far, for `sample`'s positions
    for item in items:
      function = getattr(item, "function", None)
      index = cases[function] = cases.get(function, -1) + 1
      if not _in_default_tier(item, index):
        item.add_marker(skip)
  starts = {_start(i) for i in items}
  if start_front_door in starts:
    moved = [item for item in items if item.get_closest_marker("front_door")]
    if moved:
      items[:] = [item for item in items if not item.get_closest_marker("front_door")]
      config.hook.pytest_deselected(items=moved)
    waits = [i for i in items if _start(i) is start_front_door]
    items[:] = [i for i in items if _start(i) is not start_front_door] + waits
  for item in items:
    start = _start(item)
    if start is not None and start not in _BACKGROUND:
      process = start()  # None: nothing to start (the test says why)
      if process is not None:
        _BACKGROUND[start] = process


def pytest_collection_finish(session):
  """Moves every object alive after collection (jax, flax, torch, the test modules)
  out of the garbage collector's reach: tracing and lowering allocate millions
  of short-lived objects, and each full collection they set off walked all of
  those long-lived ones again (a tenth of the CPU time in `perf`).
  tests/test_generation.py from an empty compilation cache: 47 CPU-s against
  53 (2-core AMD EPYC, 2026-12-02)."""
  gc.collect()
  gc.freeze()


def _start(item):
  """The item's test function's `start_in_background`, or None."""
  return getattr(getattr(item, "function", None), "start_in_background", None)


def pytest_sessionfinish(session, exitstatus):
  for process in _BACKGROUND.values():  # started but never collected (deselected, aborted)
    process.kill()


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
  """Drops each module's compiled programs when it ends. Every XLA CPU executable
  keeps memory mappings of its code; a whole suite in one process would otherwise
  pass the kernel's limit (vm.max_map_count, 65530 by default) and crash inside
  a later compile. Traced and lowered programs stay cached
  (`specjax.bench.free_compiled_programs`): one a later module shares
  skips tracing and lowering and comes back from the persistent compilation
  cache."""
  yield
  bench.free_compiled_programs()


@pytest.fixture
def background():
  """`background(start)`: the process collection started with `start`, or a new one."""
  return lambda start: _BACKGROUND.pop(start, None) or start()


jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def tiny_cfg():
  return specjax.ModelConfig(**TINY)


@pytest.fixture(scope="session")
def target(tiny_cfg):
  return specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def prompts():
  """A ragged batch of 4 random prompts, `[4, 9]` with lengths 9, 2, 6, 1 (a module may
  override it, e.g. with prompts prompt lookup can match)."""
  tokens = jax.random.randint(jax.random.key(42), (4, 9), 0, 512, dtype=jnp.int32)
  return tokens, jnp.array([9, 2, 6, 1], jnp.int32)


@pytest.fixture(scope="session")
def greedy_reference(target, prompts):
  """The target's greedy decoding of `prompts`, 16 new tokens per row."""
  return specjax.autoregressive_generate(
    target, *prompts, max_new_tokens=16, sampling=specjax.GREEDY
  )


@pytest.fixture(scope="session")
def draft(tiny_cfg):
  return specjax.Transformer(tiny_cfg.replace(**TINY_DRAFT), rngs=nnx.Rngs(1))


@pytest.fixture(scope="session")
def noisy_target(tiny_cfg, target):
  """The target with noise on its weights: agrees often, not always (ragged acceptance)."""
  model = specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  leaves, treedef = jax.tree.flatten(nnx.state(target, nnx.Param))
  keys = jax.random.split(jax.random.key(5), len(leaves))
  leaves = [x + 0.01 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))
  return model

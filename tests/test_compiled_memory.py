"""A launcher's sweep frees each variant's compiled programs (issue 28).

Every XLA:CPU executable keeps memory mappings of its code until it is freed;
`experiments.compare_drafters` once compiled variant after variant until the
process passed the kernel's `vm.max_map_count` (65,530) and died in LLVM. Here
the launcher's own per-variant loop (`compare_drafters.sweep`) runs several
variants on the tiny pair in one process, and the count of /proc/self/maps
lines must come back near where it started after each one. Freeing keeps the
traced programs: a freed program runs again without tracing again.
"""

import sys

import jax
import jax.numpy as jnp
import pytest

from configs import compare_drafters as compare_config
from experiments import compare_drafters
from helpers import tiny_pair
from specjax import benchmarking

# Lines of /proc/self/maps the sweep may hold above its start. Measured on the
# tiny pair (2026-12-01): without the freeing, the count rose by 1,143 over the
# first variant (the target's costs, the baseline and the variant) and by 207 to
# 339 over each further one; with it, it stayed flat, below the start (1,337
# after every variant against 1,522 before: the models' set-up programs go too).
TOLERANCE = 60


def tiny_config():
  """compare_drafters' config on variants of the tiny pair, at T = 0."""
  config = compare_config.get_config()
  config.update(
    gamma=2,
    gamma_max=2,
    max_new_tokens=8,
    num_runs=3,
    temperatures=(0.0,),
    verifiers=("greedy", "token"),
    ngram=2,
    layer_skip=(1,),
    heads=(),
    fr_spec=0,
    gamma_sweep=(),
    adaptive=(),
    cross_tokenizer=False,
  )
  config.trees.sizes = ()
  return config


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_sweep_frees_each_variants_programs():
  config = tiny_config()
  target, draft = tiny_pair()
  plan = compare_drafters.variants(config, target, draft, 0.0)[:3]
  assert len({(v.name, v.verifier) for v in plan}) == 3
  prompts = jnp.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([6, 3], jnp.int32)
  start = benchmarking.memory_map_count()
  counts, rows = [], []
  for row in compare_drafters.sweep(config, target, plan, prompts, lengths):
    counts.append(benchmarking.memory_map_count())  # the variant's programs are freed
    rows.append(row)
  print(f"memory maps: {start} before the sweep, {counts} after each variant")
  assert [(r["drafter"], r["verifier"]) for r in rows] == [(v.name, v.verifier) for v in plan]
  assert all(r["speedup"] > 0 and 0 <= r["acceptance_rate"] <= 1 for r in rows)
  assert max(counts) - start <= TOLERANCE, (start, counts)


def test_a_freed_program_runs_again_without_retracing():
  """`free_compiled_programs` drops executables only: the traced program stays
  cached, so calling it again compiles (or reads the persistent cache) but does
  not trace the Python function again."""
  traces = []

  @jax.jit
  def double(x):
    traces.append(x.shape)
    return 2 * x

  assert int(double(jnp.int32(3))) == 6
  benchmarking.free_compiled_programs()
  assert int(double(jnp.int32(4))) == 8
  assert traces == [()], "traced again after free_compiled_programs"

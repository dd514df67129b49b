"""Freeing compiled programs keeps the traced ones (issue 28).

Every XLA:CPU executable keeps memory mappings of its code until it is freed;
`experiments.compare_drafters` once compiled variant after variant until the
process passed the kernel's `vm.max_map_count` (65,530) and died in LLVM. That
the launcher's sweep frees each variant, its memory-map count flat across
three variants in one process, is checked on the launcher's own run
(tests/test_launchers.py, the compare_drafters step). Here: freeing keeps the
traced programs, so a freed program runs again without tracing again.
"""

import jax
import jax.numpy as jnp

from specjax import bench


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
  bench.free_compiled_programs()
  assert int(double(jnp.int32(4))) == 8
  assert traces == [()], "traced again after free_compiled_programs"

"""The accelerator's step, checked where no accelerator is: the compiler options
(command buffers on GPU only), the launch counts read from compiled HLO and the
profiler summary (docs/performance.md, "On the accelerator"; the floor's
readers and nominal bandwidths: tests/test_roofline.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import compiler_options


def test_command_buffer_options_record_loops_on_gpu_only():
  on = compiler_options.command_buffer_options(True)
  types = on["xla_gpu_enable_command_buffer"].split(",")
  assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUSTOM_CALL"} <= set(types)
  assert on["xla_enable_command_buffers_during_profiling"] is True
  assert compiler_options.command_buffer_options(False) == {"xla_gpu_enable_command_buffer": ""}
  assert compiler_options.compiler_options("cpu") == {}
  assert compiler_options.compiler_options("tpu") == {}
  assert compiler_options.compiler_options("gpu") == on
  with compiler_options.command_buffers(False):
    assert compiler_options.compiler_options("cuda") == {"xla_gpu_enable_command_buffer": ""}
    with compiler_options.command_buffers(True):
      assert compiler_options.compiler_options("gpu") == on
    assert not compiler_options.command_buffers_enabled()
  assert compiler_options.command_buffers_enabled()


def test_command_buffer_switch_from_the_environment(monkeypatch):
  monkeypatch.setenv(compiler_options.ENV, "0")
  assert compiler_options.compiler_options("gpu") == {"xla_gpu_enable_command_buffer": ""}
  with compiler_options.command_buffers(True):  # the context wins
    assert compiler_options.command_buffers_enabled()
  monkeypatch.setenv(compiler_options.ENV, "yes")
  with pytest.raises(ValueError, match="SPECJAX_COMMAND_BUFFERS"):
    compiler_options.command_buffers_enabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_xla_accepts_the_command_buffer_options(enabled):
  """XLA parses every command type by name (a misspelt one is an error even on
  CPU, where the options change nothing)."""
  x = jnp.arange(4.0)
  lowered = jax.jit(lambda x: jnp.sin(x) + 1).lower(x)
  compiled = lowered.compile(compiler_options.command_buffer_options(enabled))
  np.testing.assert_allclose(compiled(x), jnp.sin(x) + 1)
  with pytest.raises(Exception, match="not a valid enum value"):
    lowered.compile({"xla_gpu_enable_command_buffer": "FUSION,WHILST"})


def test_programs_take_the_options_of_their_platform(monkeypatch):
  from specjax.generation.autoregressive import _autoregressive_program
  from specjax.generation.speculative import _speculative_program

  assert isinstance(_autoregressive_program, compiler_options.Program)
  assert isinstance(_speculative_program, compiler_options.Program)

  program = compiler_options.jit(lambda x, n: x * n, static_argnames=("n",))
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(program(x, n=2), x * 2)  # CPU: plain jax.jit
  assert list(program._jitted) == [()]
  # As on a GPU (the options compile on CPU too): a second program, with them.
  monkeypatch.setattr(compiler_options.jax, "default_backend", lambda: "gpu")
  np.testing.assert_array_equal(program(x, n=3), x * 3)
  with compiler_options.command_buffers(False):
    program.lower(x, n=3).compile()
  on = tuple(sorted(compiler_options.command_buffer_options(True).items()))
  off = tuple(sorted(compiler_options.command_buffer_options(False).items()))
  assert set(program._jitted) == {(), on, off}

"""The XLA compiler options specjax sets on its decode programs, in one place.

On a GPU, XLA can record a sequence of kernels as a command buffer (a CUDA
graph) and launch it at once; with `WHILE` and `CONDITIONAL` among the recorded
command types a whole `lax.while_loop`, its body and condition included, is one
graph whose condition is evaluated on the device (CUDA conditional nodes), so a
decode loop pays neither a launch per kernel nor a device-to-host wait per
iteration. XLA's default records fusions and library calls but not loops.

`jit` is `jax.jit` whose compile options follow the platform a program is
compiled for (`current_platform()`: the devices its arguments are placed on when
lowered, so a program lowered on a CPU host for an H100 or a TPU target
(`specjax.aot`) gets that target's options and layout, never the host's):
on GPU `COMMAND_BUFFER_TYPES` (and command buffers kept under the profiler, so a
trace shows what really runs), nothing on any other platform. The switch:
`command_buffers(False)` (a context) or `SPECJAX_COMMAND_BUFFERS=0` turns them
off, which on a GPU means none at all (not even XLA's default fusions), so
`experiments/gpu_check.py` measures both ways. XLA itself drops `WHILE` and
`CONDITIONAL` where the CUDA driver is older than 12.3. An XLA that does not
know an option (an older or newer jaxlib) gets one logged warning and the
programs without specjax's options, never an error.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import jax
from absl import logging

# What XLA records in command buffers when they are on: its own default set
# (2026: fusions, cuBLAS / cuBLASLt / cuDNN and custom calls, dynamic-slice
# fusions) plus loops and conditionals, so a loop body is one graph.
COMMAND_BUFFER_TYPES = (
  "FUSION",
  "CUBLAS",
  "CUBLASLT",
  "CUSTOM_CALL",
  "CUDNN",
  "DYNAMIC_SLICE_FUSION",
  "CONDITIONAL",
  "WHILE",
)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
ENV = "SPECJAX_COMMAND_BUFFERS"
_state = {"enabled": None, "refused": None, "platform": None}  # None: the environment's / host's
# XLA's words when it refuses a compile option (an unknown name, a bad value).
_REFUSALS = ("No such compile option", "While setting option")


def command_buffers_enabled() -> bool:
  """Whether specjax's programs use command buffers on GPU: `command_buffers(...)`
  if inside one, else `SPECJAX_COMMAND_BUFFERS` ("1", the default, or "0")."""
  if _state["enabled"] is not None:
    return _state["enabled"]
  value = os.environ.get(ENV, "1")
  if value not in ("0", "1"):
    raise ValueError(f"{ENV} must be 0 or 1, got {value!r}.")
  return value == "1"


@contextlib.contextmanager
def command_buffers(enabled: bool):
  """Programs compiled inside use command buffers on GPU (`enabled`) or none."""
  previous = _state["enabled"]
  _state["enabled"] = bool(enabled)
  try:
    yield
  finally:
    _state["enabled"] = previous


def command_buffer_options(enabled: bool) -> dict[str, Any]:
  """XLA:GPU's compile options for command buffers on (`COMMAND_BUFFER_TYPES`,
  kept under the profiler) or off (none recorded)."""
  if not enabled:
    return {"xla_gpu_enable_command_buffer": ""}
  return {
    "xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_TYPES),
    "xla_enable_command_buffers_during_profiling": True,
  }


def current_platform() -> str:
  """The platform the program being traced is compiled for: "cpu", "gpu" or
  "tpu". Inside `target_platform(name)` (what `Program.lower` enters for
  arguments placed on another platform's devices) that one, else JAX's default
  backend. Model code that chooses by platform (the layer layout, the Pallas
  kernels, the CPU matmul kernel) asks this, never `jax.default_backend()`."""
  if _state["platform"] is not None:
    return _state["platform"]
  return jax.default_backend()


@contextlib.contextmanager
def target_platform(name: str | None):
  """Programs traced and compiled inside are for `name` ("cpu", "gpu"/"cuda"/
  "rocm", "tpu"; None: the default backend's)."""
  previous = _state["platform"]
  _state["platform"] = None if name is None else ("gpu" if name in GPU_PLATFORMS else name)
  try:
    yield
  finally:
    _state["platform"] = previous


def placed_platform(tree) -> str | None:
  """The platform of the devices the first placed leaf of `tree` sits on (a
  `jax.Array` or a `jax.ShapeDtypeStruct` with a sharding), or None."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    devices = getattr(sharding, "device_set", None)
    if devices:
      name = next(iter(devices)).platform
      return "gpu" if name in GPU_PLATFORMS else name
  return None


def compiler_options(platform: str | None = None) -> dict[str, Any]:
  """The options specjax compiles its programs with on `platform` (default:
  `current_platform()`): the command-buffer options on GPU, none elsewhere."""
  platform = current_platform() if platform is None else platform
  if platform not in GPU_PLATFORMS or _state["refused"]:
    return {}
  return command_buffer_options(command_buffers_enabled())


def refused() -> str | None:
  """XLA's refusal of specjax's options in this process (then none are passed), or None."""
  return _state["refused"]


class Program:
  """`jax.jit(fun, **jit_kwargs)` compiled with `compiler_options()` of the
  default backend at each call; one jitted function per set of options, so the
  switch may change within a process. Calls, `lower` and `trace` go to it."""

  def __init__(self, fun, **jit_kwargs):
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._jitted: dict[tuple, Any] = {}
    functools.update_wrapper(self, fun)

  def jitted(self, platform: str | None = None):
    """The `jax.jit` function this program calls on `platform` (default: the default backend)."""
    options = compiler_options(platform)
    key = tuple(sorted(options.items()))
    if key not in self._jitted:
      extra = {"compiler_options": options} if options else {}
      self._jitted[key] = jax.jit(self._fun, **self._jit_kwargs, **extra)
    return self._jitted[key]

  def __call__(self, *args, **kwargs):
    return self._fallback(lambda f: f(*args, **kwargs))

  def lower(self, *args, **kwargs):
    """`jax.jit(...).lower` with the options of the platform the arguments are
    placed on (abstract `ShapeDtypeStruct`s with shardings on a target's
    devices: `specjax.aot`), traced under `target_platform` of it."""
    # Options are checked at compile: `Lowered.compile` raises if XLA refuses them.
    with target_platform(placed_platform((args, kwargs)) or _state["platform"]):
      return self.jitted().lower(*args, **kwargs)

  def _fallback(self, run):
    """`run(self.jitted())`; if XLA refuses specjax's options, one warning, then
    without them for the rest of the process."""
    try:
      return run(self.jitted())
    except Exception as e:  # XLA's own error type varies across jaxlib versions
      options = compiler_options()
      if not options or not any(words in str(e) for words in _REFUSALS):
        raise
      _state["refused"] = str(e).splitlines()[0]
      logging.warning(
        "XLA refused specjax's compile options %s (%s); compiling without them",
        options,
        _state["refused"],
      )
      return run(self.jitted())

  def trace(self, *args, **kwargs):
    return self.jitted().trace(*args, **kwargs)


def jit(fun=None, **jit_kwargs):
  """`jax.jit` with specjax's compiler options (`Program`); usable as
  `@functools.partial(jit, static_argnames=...)`."""
  if fun is None:
    return functools.partial(jit, **jit_kwargs)
  return Program(fun, **jit_kwargs)

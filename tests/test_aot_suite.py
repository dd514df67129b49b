"""Runs tests/aot in the environment that holds the accelerator compilers.

The `[aot]` extra (the CUDA plugin with ptxas, libtpu) lives in a virtual
environment of its own that sees this one's packages (`python -m venv
--system-site-packages .aot-env`, then `.aot-env/bin/pip install -e ".[aot]"`:
.ci/run and the README's test command make it): jax imports the CUDA plugin
whenever it is installed, and on a machine without a GPU its C++ logs "Could
not find cuda drivers" to stderr at every start, which every other test's
process would carry. SPECJAX_AOT_PYTHON names another interpreter. The suite
starts at collection (tests/conftest.py, `background`), on the core the main
process leaves idle.
"""

import os
import subprocess

from helpers import pytest_process, suite_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, ".aot-env", "bin", "python")


def aot_python() -> str:
  return os.environ.get("SPECJAX_AOT_PYTHON", DEFAULT)


def start_suite() -> subprocess.Popen | None:
  if not os.path.exists(aot_python()):
    return None
  env = dict(os.environ, JAX_PLATFORMS="cpu", SPECJAX_AOT_SUITE="1")
  return pytest_process(["tests/aot"], aot_python(), env)


def test_aot_suite(background):
  suite = background(start_suite)
  assert suite is not None, (
    f"no interpreter with the [aot] extra at {aot_python()}: run `python -m venv "
    '--system-site-packages .aot-env && .aot-env/bin/pip install -e ".[aot]"` (as .ci/run '
    "does) or set SPECJAX_AOT_PYTHON"
  )
  output = suite_output(suite)
  assert suite.returncode == 0, output[-8000:]
  assert " passed" in output.splitlines()[-1], output[-2000:]


test_aot_suite.start_in_background = start_suite

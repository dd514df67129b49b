"""Runs tests/multidevice in its own process with 8 simulated CPU devices.

XLA_FLAGS must be set before jax is imported, which this process already did,
so the multi-device suite gets a fresh interpreter. It is started as soon as
pytest has collected this test (tests/conftest.py, `background`): compiling is
mostly single-threaded, so on a 2-core machine the suite compiles on the core
the main process leaves idle, and the test only collects its result.
"""

import os
import subprocess

from helpers import pytest_process, suite_output


def start_suite() -> subprocess.Popen:
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env = dict(
    os.environ,
    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip(),
    JAX_PLATFORMS="cpu",
  )
  return pytest_process(["tests/multidevice"], env=env)


def test_multidevice_suite(background):
  suite = background(start_suite)
  output = suite_output(suite)
  assert suite.returncode == 0, output[-8000:]


test_multidevice_suite.start_in_background = start_suite

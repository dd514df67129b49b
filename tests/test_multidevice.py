"""Runs tests/multidevice in its own process with 8 simulated CPU devices.

XLA_FLAGS must be set before jax is imported, which this process already did,
so the multi-device suite gets a fresh interpreter.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multidevice_suite():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      os.path.join(ROOT, "tests", "multidevice"),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1500,
  )
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

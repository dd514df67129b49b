"""Configuration of `experiments/kernel_benchmark.py`: the CPU matmul kernel against
XLA's dot on this machine.

  python -m experiments.kernel_benchmark                        # this CPU's variant
  python -m experiments.kernel_benchmark --config.variants=avx2,avx512_bf16

A chain of `num_layers` 1B-shaped layers (about 180 MB of float32 weights each)
at each of `rows`, in each of `dtypes`, through XLA's dot and each of `variants`
("auto": the fastest build this CPU runs; "avx2" runs on any AVX-512 machine too).
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The kernel benchmark's configuration."""
  config = ml_collections.ConfigDict()
  config.rows = "1,2,5,8,16"
  config.dtypes = "float32,bfloat16"
  config.variants = "auto"
  config.num_layers = 6
  config.num_runs = 5
  config.read_megabytes = 1024
  return config

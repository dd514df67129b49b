"""The CPU matmul kernel against XLA's dot on this machine: what
`experiments/kernel_benchmark.py` prints (`kernel_table`).

The workload is a decode step's products at a 1B shape: a chain of layers, each
`x @ Wqkv [2048, 3072]`, `x @ Wo [2048, 2048]`, `x @ Wgate_up [2048, 11264]`,
`h @ Wdown [5632, 2048]` (h: the gated half of gate_up), timed at a few row
counts, float32 and bfloat16 weights, through each kernel variant named and
through XLA's dot. GB/s is the weights' bytes over the chain's time: at one row
a memory-bound product reads at the machine's read bandwidth, which the table
states beside it (`floor.read_bandwidth_gbs`, 2 threads and all cores).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.floor import read_bandwidth_gbs
from specjax.bench.timing import time_calls
from specjax.kernels import build, cpu, cpu_matmul
from specjax.validation import check_positive_int

# (K, N) of one layer's products, in the order a layer runs them.
LAYER_1B = (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 11264), ("down", 5632, 2048))
DTYPES = ("float32", "bfloat16")
# The column of what a model gets: each product shape on its calibrated path.
CHOSEN = "chosen"


def layer_weights(num_layers: int, dtype, seed: int = 0) -> list[dict[str, jax.Array]]:
  """`num_layers` layers of random 1B-shaped weights in `dtype`."""
  rng = np.random.default_rng(seed)
  return [
    {
      name: jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, dtype)
      for name, k, n in LAYER_1B
    }
    for _ in range(num_layers)
  ]


@functools.partial(jax.jit, static_argnames=("target",))
def _chain(layers, x, *, target: str | None):
  """The layers' products on `x [M, 2048]`: through the FFI `target`, XLA's dot
  (None), or, with target "chosen", `cpu_matmul.matmul` as a model calls it
  (each shape on the path calibration chose for it here)."""

  def dot(a, w):
    if target == CHOSEN:
      return cpu_matmul.matmul(a, w)
    return cpu_matmul.product(a, w, a.dtype, False, target)

  for mats in layers:
    qkv = dot(x, mats["qkv"])
    x = x + dot(qkv[:, :2048], mats["o"])
    gate_up = dot(x, mats["gate_up"])
    x = x + dot(gate_up[:, :5632] * gate_up[:, 5632:], mats["down"])
  return x


def kernel_table(
  rows: tuple[int, ...] = (1, 2, 5, 8, 16),
  dtypes: tuple[str, ...] = DTYPES,
  variants: tuple[str, ...] = ("auto",),
  num_layers: int = 6,
  num_runs: int = 5,
  read_megabytes: int = 1024,
) -> dict[str, Any]:
  """Times the chain per (dtype, rows) through XLA's dot and each kernel variant.

  Args:
    rows: activation rows per product (a decode step's B * (gamma + 1)).
    dtypes: weight dtypes ("float32", "bfloat16"); x is in the same dtype.
    variants: kernel builds to time ("auto": this CPU's fastest); a variant
      that cannot be built here is reported with its cause.
    num_layers: layers in the chain (6: about 1 GB of float32 weights).
    num_runs: timed runs per case (median), after a warm-up.
    read_megabytes: size of the read-bandwidth measurement.

  Returns:
    `{"machine", "read_bandwidth_gbs", "read_bandwidth_2_threads_gbs",
    "variants", "cases": [{"dtype", "rows", "weight_bytes", "xla_ms",
    "xla_gbs", "<variant>_ms", "<variant>_gbs", "<variant>_over_xla"}],
    "goals", "chosen_paths", "chosen_candidates"}`: the variants include
    "chosen", the products as a model runs them (`cpu_matmul.matmul`: per
    shape, the build or XLA that calibration chose, `chosen_paths`, among XLA
    and the builds `chosen_candidates`); `goals` per variant checks one row >=
    0.8 x the 2-thread read bandwidth, 5 rows <= 1.3 x one row, and never
    slower than XLA.
  """
  for r in rows:
    check_positive_int("rows", r)
  check_positive_int("num_layers", num_layers)
  check_positive_int("num_runs", num_runs)
  for dtype in dtypes:
    if dtype not in DTYPES:
      raise ValueError(f"dtypes must be among {DTYPES}, got {dtype!r}.")
  names = [cpu.supported_variants()[0] if v == "auto" else v for v in variants]
  for name in names:
    if name not in cpu.VARIANTS:
      raise ValueError(f"variants must be 'auto' or among {sorted(cpu.VARIANTS)}, got {name!r}.")
  libraries, unavailable = {}, {}
  for name in dict.fromkeys(names):
    if name not in cpu.supported_variants():
      unavailable[name] = f"this CPU lacks {cpu.VARIANTS[name][1]}"
      continue
    try:
      libraries[name] = build.build(name)
    except build.KernelUnavailable as e:
      unavailable[name] = str(e)
  result: dict[str, Any] = {
    "machine": cpu.describe(),
    "jax_version": jax.__version__,
    "read_bandwidth_gbs": round(read_bandwidth_gbs(read_megabytes), 2),
    "read_bandwidth_2_threads_gbs": round(read_bandwidth_gbs(read_megabytes, threads=2), 2),
    "variants": {name: {"path": lib.path} for name, lib in libraries.items()}
    | {name: {"unavailable": cause} for name, cause in unavailable.items()},
    "num_layers": num_layers,
    "cases": [],
  }
  for dtype in dtypes:
    layers = layer_weights(num_layers, jnp.dtype(dtype))
    weight_bytes = sum(w.size * w.dtype.itemsize for layer in layers for w in layer.values())
    for r in rows:
      x = jnp.full((r, 2048), 0.01, dtype)
      fns = {
        name: functools.partial(_chain, layers, x, target=lib.target(False))
        for name, lib in libraries.items()
      }
      fns[CHOSEN] = functools.partial(_chain, layers, x, target=CHOSEN)
      fns["xla"] = functools.partial(_chain, layers, x, target=None)
      # Each path in a block of its own, XLA last, not interleaved: after XLA's
      # bfloat16 chain (weights converted into temporaries) the kernel measured
      # 1.6x slower for about half a second.
      timings, outputs = {}, {}
      for name, fn in fns.items():
        one, out = time_calls({name: fn}, num_runs)
        timings[name], outputs[name] = one[name], out[name]
      case = {"dtype": dtype, "rows": r, "weight_bytes": weight_bytes}
      for name, timing in timings.items():
        case[f"{name}_ms"] = round(timing.median_s * 1e3, 2)
        case[f"{name}_gbs"] = round(weight_bytes / timing.median_s / 1e9, 2)
      for name in (*libraries, CHOSEN):
        case[f"{name}_over_xla"] = round(case[f"{name}_ms"] / case["xla_ms"], 3)
        np.testing.assert_allclose(  # the same products, whichever path
          np.asarray(outputs[name], np.float32),
          np.asarray(outputs["xla"], np.float32),
          rtol=0.05,
          atol=0.05,
        )
      result["cases"].append(case)
    del layers
  result["goals"] = {name: _goals(result, name) for name in (*libraries, CHOSEN)}
  status = cpu_matmul.kernel_status()
  result["chosen_paths"] = {key: decision["path"] for key, decision in status["decisions"].items()}
  result["chosen_candidates"] = status["candidates"]
  return result


def _goals(result: dict[str, Any], name: str) -> dict[str, Any]:
  """The issue's goals for one variant: one row at >= 0.8 x the 2-thread read
  bandwidth, five rows <= 1.3 x one row, and never slower than XLA."""
  goals = {}
  bandwidth = result["read_bandwidth_2_threads_gbs"]
  for dtype in {case["dtype"] for case in result["cases"]}:
    cases = {c["rows"]: c for c in result["cases"] if c["dtype"] == dtype}
    out = {"never_slower_than_xla": all(c[f"{name}_ms"] <= c["xla_ms"] for c in cases.values())}
    if 1 in cases:
      out["one_row_over_read_bandwidth"] = round(cases[1][f"{name}_gbs"] / bandwidth, 3)
    if 1 in cases and 5 in cases:
      out["five_rows_over_one"] = round(cases[5][f"{name}_ms"] / cases[1][f"{name}_ms"], 3)
    goals[dtype] = out
  return goals

"""A step-time estimate from a compiled program, labelled as one (no device ran).

  ms = launches × launch cost + bytes read ÷ HBM bandwidth + bytes sent ÷ link bandwidth

per trip of the generation loop, each term from the compiled program for the
target and the chip's published figures (`targets.Chip`, sources named there):
- launches: the trip's kernels (compiled HLO, nested loops per trip) at the
  host launch cost when the loop runs on the host, at a graph node's cost
  when XLA:GPU records the loop in a command buffer (the thunk sequence); a
  TPU runs the loop on the chip and pays neither (the term is 0: an optimist's
  estimate there);
- bytes read: the parameters one device holds plus the K/V cache it reads at
  the given filled length;
- bytes sent: the collectives' per-device link bytes (ring algorithms).
It ignores compute (decode at small batch is not compute-bound), overlap and
caches, so read it as an account of where time goes, not a promise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.aot.targets import Target


def device_param_bytes(model: nnx.Module) -> int:
  """Bytes of an abstract placed model's parameters one device holds."""
  total = 0
  for leaf in jax.tree.leaves(nnx.state(model)):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
      total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
  return total


def cache_read_bytes(cfg, batch: int, filled: int, model_devices: int) -> int:
  """Bytes of K and V one device reads per step: every layer's filled slots of its
  rows, kv heads split over `model_devices` where they divide."""
  heads = cfg.n_kv_heads // model_devices if cfg.n_kv_heads % model_devices == 0 else cfg.n_kv_heads
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  return 2 * cfg.n_layers * batch * heads * filled * cfg.resolved_head_dim * itemsize


def step_ms(report: dict, target: Target, read_bytes: int) -> dict:
  """The estimate for one compiled program's report (`analysis.read`) reading
  `read_bytes` per trip on `target`: its three terms and their sum, in ms."""
  chip = target.chip
  kernels = report.get("kernels_per_trip", 0)
  loop = (report.get("thunks") or {}).get("generation_loop") or {}
  per_kernel_us = chip.graph_launch_us if loop.get("on_device") else chip.launch_us
  launch = kernels * per_kernel_us / 1e3
  memory = read_bytes / (chip.bandwidth_gbs * 1e9) * 1e3
  sent = sum(v["link_bytes"] for v in (report.get("collectives") or {}).values())
  link = sent / (chip.link_gbs * 1e9) * 1e3
  return dict(
    estimate="estimate, not a measurement",
    launch_ms=launch,
    memory_ms=memory,
    link_ms=link,
    step_ms=launch + memory + link,
    per_kernel_us=per_kernel_us,
    read_bytes=int(read_bytes),
  )

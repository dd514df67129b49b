"""Named accelerator targets a CPU host compiles for: GPUs and TPU slices, deviceless.

  target = targets.get("h100")           # or "h200", "a100", "v5e:2x4", "v5p:2x2x1@2"
  mesh = target.mesh((1, 8))             # a jax Mesh over the target's devices
  # abstract arrays placed on it lower and compile through the target's compiler

A GPU target is a `GpuTargetConfigProto` (`gpu_specs/*.txtpb`, their sources named
in each file) handed to the CUDA plugin's topology; a TPU target is a topology name
handed to libtpu. Neither needs the device: `pip install -e ".[aot]"` brings the
compilers (the CUDA plugin, ptxas and libtpu matching the pinned jax), and the
process runs with `JAX_PLATFORMS=cpu` (the CUDA plugin refuses to start without a
driver otherwise). Each target also carries the published figures the step-time
estimate and the fit table use (memory, bandwidth, links), with their sources.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from specjax.distributed.mesh import DATA, MODEL

_SPECS = os.path.join(os.path.dirname(__file__), "gpu_specs")
# libtpu takes a lock file per host; a second process compiling for a TPU at the
# same time (a test beside a check) would otherwise fail to load it. Nothing
# here runs on a TPU, so the processes never share a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
INSTALL_HINT = 'pip install -e ".[aot]" (the CUDA plugin, ptxas and libtpu for the pinned jax)'


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator kind's published figures (per chip or GPU).

  Attributes:
    kind: the device kind XLA reports ("NVIDIA H100 80GB HBM3", "TPU v5 lite").
    platform: "gpu" or "tpu".
    memory_bytes: device memory (HBM).
    bandwidth_gbs: HBM bandwidth, GB/s.
    link_gbs: bandwidth one chip sends to its peers, GB/s per direction (NVLink
      on GPUs, ICI on TPUs): what a collective's bytes are divided by.
    launch_us: assumed host cost of one kernel launched from the host, µs
      (graph_launch_us: one node of a recorded command buffer; TPUs launch one
      program per step: 0).
    source: where the figures come from.
    spec: a GPU's target-config file in `gpu_specs/` ("" for a TPU).
    tpu_name: a TPU's generation as libtpu's topology names spell it ("v5e").
  """

  kind: str
  platform: str
  memory_bytes: int
  bandwidth_gbs: float
  link_gbs: float
  launch_us: float
  graph_launch_us: float
  source: str
  spec: str = ""
  tpu_name: str = ""


# Launch costs are assumptions, not measurements (docs/accelerators.md, "The
# estimate"): about 4 µs per kernel launched from the host on a CUDA stream and
# about 1 µs per node of a CUDA graph, from NVIDIA's "Getting Started with CUDA
# Graphs" (2019) order of magnitude; a TPU runs one compiled program per call.
_GPU_LAUNCH = dict(launch_us=4.0, graph_launch_us=1.0)
_TPU_LAUNCH = dict(launch_us=0.0, graph_launch_us=0.0)
GB = 10**9
CHIPS: dict[str, Chip] = {
  "h100": Chip(
    "NVIDIA H100 80GB HBM3",
    "gpu",
    80 * GB,
    3350.0,
    450.0,
    spec="h100_sxm.txtpb",
    source="NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 each way)",
    **_GPU_LAUNCH,
  ),
  "h200": Chip(
    "NVIDIA H200",
    "gpu",
    141 * GB,
    4800.0,
    450.0,
    spec="h200_sxm.txtpb",
    source="NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (450 each way)",
    **_GPU_LAUNCH,
  ),
  "a100": Chip(
    "NVIDIA A100-SXM4-80GB",
    "gpu",
    80 * GB,
    2039.0,
    300.0,
    spec="a100_sxm_80.txtpb",
    source="NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (300 each way)",
    **_GPU_LAUNCH,
  ),
  "v4": Chip(
    "TPU v4",
    "tpu",
    32 * GB,
    1200.0,
    300.0,
    tpu_name="v4",
    source="Cloud TPU v4 documentation: 32 GiB HBM2 at 1,200 GB/s, ICI 2,400 Gbps (300 GB/s)",
    **_TPU_LAUNCH,
  ),
  "v5e": Chip(
    "TPU v5 lite",
    "tpu",
    16 * GB,
    819.0,
    200.0,
    tpu_name="v5e",
    source="Cloud TPU v5e documentation: 16 GB HBM2 at 819 GB/s, ICI 1,600 Gbps (200 GB/s)",
    **_TPU_LAUNCH,
  ),
  "v5p": Chip(
    "TPU v5",
    "tpu",
    95 * GB,
    2765.0,
    600.0,
    tpu_name="v5p",
    source="Cloud TPU v5p documentation: 95 GB HBM2e at 2,765 GB/s, ICI 4,800 Gbps (600 GB/s)",
    **_TPU_LAUNCH,
  ),
  "v6e": Chip(
    "TPU v6 lite",
    "tpu",
    32 * GB,
    1640.0,
    448.0,
    tpu_name="v6e",
    source="Cloud TPU v6e (Trillium) documentation: 32 GB HBM at 1,640 GB/s, ICI 3,584 Gbps",
    **_TPU_LAUNCH,
  ),
}
GPUS = tuple(k for k, c in CHIPS.items() if c.platform == "gpu")
TPUS = tuple(k for k, c in CHIPS.items() if c.platform == "tpu")
_TPU_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})(?:@(\d+))?$")
_GPU_NAME = re.compile(r"^(h100|h200|a100)(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Target:
  """A compile target: `count` chips of one kind, as one or more slices.

  Attributes:
    name: as `get` reads it: "h100", "h100x8" (eight GPUs, one host), "h100x16"
      (two hosts of eight), "v5e:2x4"
      (a TPU slice of that topology), "v5e:2x4@2" (two such slices).
    chip: the chips' published figures.
    topology: a GPU's "1xHOSTSxN" or a TPU's "2x4" / "2x2x1".
    slices: TPU slices (1 for a GPU target).
  """

  name: str
  chip: Chip
  topology: str
  slices: int = 1

  @property
  def platform(self) -> str:
    return self.chip.platform

  @property
  def num_chips(self) -> int:
    return math.prod(int(d) for d in self.topology.split("x")) * self.slices

  @property
  def num_devices(self) -> int:
    """Devices JAX sees: one per chip, two per v4 chip (its two TensorCores)."""
    return len(_devices(self))

  def devices(self) -> list:
    """The target's devices (abstract: placing arrays on them allocates nothing)."""
    return list(_devices(self))

  def mesh(self, shape: Sequence[int] | None = None, axis_names=(DATA, MODEL)) -> Mesh:
    """A mesh of `shape` (default: every device along `model`) over the devices."""
    from specjax.distributed.mesh import resolve_shape

    devices = self.devices()
    shape = resolve_shape((1, -1) if shape is None else shape, len(devices))
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def get(name: str) -> Target:
  """The target called `name`: "h100", "h200", "a100" (one GPU; "h100x8": eight
  on one host; "h100x16": two hosts of eight) or a TPU topology "v4:2x2x1",
  "v5e:2x4", "v5p:2x2x1", "v6e:2x2" with an optional slice count ("v5e:16x16@2").

  Raises:
    ValueError: an unknown name, naming the forms allowed.
  """
  gpu = _GPU_NAME.match(name)
  if gpu:
    count = int(gpu.group(2) or 1)
    if count < 1 or (count > 8 and count % 8):
      raise ValueError(
        f"target {name!r}: a GPU target has 1 to 8 GPUs on one host, or hosts of 8 (a multiple "
        f"of 8), got {count}."
      )
    hosts = max(1, count // 8)
    return Target(name, CHIPS[gpu.group(1)], f"1x{hosts}x{count // hosts}")
  tpu = _TPU_NAME.match(name)
  if tpu:
    dims = tpu.group(2).split("x")
    slices = int(tpu.group(3) or 1)
    if slices < 1 or any(int(d) < 1 for d in dims):
      raise ValueError(f"target {name!r}: topology sizes and the slice count must be >= 1.")
    return Target(name, CHIPS[tpu.group(1)], tpu.group(2), slices)
  raise ValueError(
    f"target must be one of {', '.join(GPUS)} (optionally xN GPUs: up to 8 on a host, or hosts of "
    f"8, e.g. h100x8, h100x16) or a TPU "
    f"topology {'|'.join(TPUS)}:AxB[xC][@slices] (e.g. v5e:2x4, v5p:2x2x1, v6e:2x2@2); "
    f"got {name!r}."
  )


def gpu_target_config(chip: Chip) -> str:
  """A GPU chip's `GpuTargetConfigProto` text (the file in `gpu_specs/`)."""
  with open(os.path.join(_SPECS, chip.spec)) as f:
    return f.read()


@functools.cache
def _devices(target: Target) -> tuple:
  from jax.experimental import topologies

  try:
    if target.platform == "gpu":
      topology = topologies.get_topology_desc(
        platform="cuda", target_config=gpu_target_config(target.chip), topology=target.topology
      )
    else:
      dims = [int(d) for d in target.topology.split("x")] + [1]
      per_host = tuple(min(2, d) for d in dims[:2]) + (1,)
      topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=f"{target.chip.tpu_name}:{target.topology}",
        chip_config_name="default",
        chips_per_host_bounds=per_host,
        num_slices=target.slices,
      )
  except Exception as e:  # the plugin's own error types differ by version
    raise RuntimeError(
      f"cannot make devices for target {target.name!r} ({e}). Compiling for "
      f"{target.platform.upper()} needs {INSTALL_HINT} and JAX_PLATFORMS=cpu set before jax "
      "is imported."
    ) from e
  return tuple(topology.devices)


def device_kind(target: Target) -> str:
  """The device kind XLA reports for the target's devices."""
  return _devices(target)[0].device_kind


def check_host() -> None:
  """Raises where this process cannot compile for a target: JAX's platforms were
  not limited to the CPU (the CUDA plugin then refuses to start)."""
  platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
  if platforms != "cpu":
    raise RuntimeError(
      "compiling for a target without its device needs JAX_PLATFORMS=cpu in the environment "
      f"before jax is imported (got {platforms!r})."
    )

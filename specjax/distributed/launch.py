"""Multi-host start-up: `jax.distributed.initialize` from flags or the environment.

On Cloud TPU pod slices and SLURM/Open MPI clusters JAX finds the coordinator
itself (`initialize()` with no arguments); elsewhere pass the coordinator's
address, the number of processes and this process's id, or set
`SPECJAX_COORDINATOR`, `SPECJAX_NUM_PROCESSES`, `SPECJAX_PROCESS_ID`.
"""

from __future__ import annotations

import os

import jax
from absl import flags


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  heartbeat_timeout_seconds: int | None = None,
) -> None:
  """Joins this process to the job; arguments left None come from the environment
  (`SPECJAX_*`) or, failing that, JAX's own cluster detection.
  `heartbeat_timeout_seconds`: how soon the job ends once a process stops
  answering (default JAX's, 100 s; `SPECJAX_HEARTBEAT_TIMEOUT_S`)."""
  env = os.environ
  coordinator_address = coordinator_address or env.get("SPECJAX_COORDINATOR") or None
  if num_processes is None and "SPECJAX_NUM_PROCESSES" in env:
    num_processes = int(env["SPECJAX_NUM_PROCESSES"])
  if process_id is None and "SPECJAX_PROCESS_ID" in env:
    process_id = int(env["SPECJAX_PROCESS_ID"])
  if heartbeat_timeout_seconds is None and "SPECJAX_HEARTBEAT_TIMEOUT_S" in env:
    heartbeat_timeout_seconds = int(env["SPECJAX_HEARTBEAT_TIMEOUT_S"])
  extra = {}
  if heartbeat_timeout_seconds is not None:
    extra["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
  if jax.config.jax_platforms in (None, "", "cpu") and num_processes:
    # CPU devices talk over gloo; GPUs and TPUs bring their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    **extra,
  )


def define_flags() -> None:
  """--distributed, --coordinator_address, --num_processes, --process_id."""
  flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() before anything else (multi-host)."
  )
  flags.DEFINE_string(
    "coordinator_address",
    None,
    "host:port of process 0; default from SPECJAX_COORDINATOR or JAX's "
    "cluster detection (TPU pods, SLURM).",
  )
  flags.DEFINE_integer("num_processes", None, "Processes in the job (default: detected).")
  flags.DEFINE_integer("process_id", None, "This process's index (default: detected).")


def maybe_initialize() -> None:
  """Initializes when --distributed is set (call first thing in main)."""
  f = flags.FLAGS
  if f.distributed:
    initialize(f.coordinator_address, f.num_processes, f.process_id)

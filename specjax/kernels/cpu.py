"""What this CPU offers: its model name, its vector extensions, and which build of
the matmul kernel (`cpu_matmul.cc`) fits it.

Every kernel figure is written with the CPU model and its vector extensions
(`describe()`), and the kernel variant is chosen from the extensions the CPU
reports (`VARIANTS`), never from the machine it was tuned on.
"""

from __future__ import annotations

import functools
import os
import platform

# The kernel's builds, fastest first: the compiler flags that select each one's
# code in cpu_matmul.cc (by the macros they define) and the CPU flags each needs.
# Fixed x86-64 levels, not -march=native: a build runs wherever its level does,
# and the AVX2 build can be tried on an AVX-512 machine.
VARIANTS = {
  "avx512_bf16": (("-march=x86-64-v4", "-mavx512bf16"), ("avx512f", "avx512bw", "avx512_bf16")),
  "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
  "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2")),
  # Portable C++ whose __builtin_fmaf loops the compiler vectorises for the host
  # (NEON on ARM); -march=native where the compiler takes it.
  "generic": ((), ()),
}

# The extensions worth naming beside a figure (x86 and ARM spellings).
_NAMED = (
  "sse4_2",
  "avx",
  "avx2",
  "fma",
  "f16c",
  "avx512f",
  "avx512bw",
  "avx512vl",
  "avx512_vnni",
  "avx512_bf16",
  "avx512_fp16",
  "amx_tile",
  "amx_bf16",
  "amx_int8",
  "asimd",
  "asimdhp",
  "sve",
  "sve2",
  "bf16",
  "i8mm",
)


@functools.cache
def flags() -> frozenset[str]:
  """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


@functools.cache
def model() -> str:
  """The CPU's model name ("AMD EPYC", "Apple M2", ...), or the architecture."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("model name", "Model", "Hardware")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def vector_extensions() -> list[str]:
  """The CPU's vector extensions that matter for matmuls, e.g. ["avx2", "fma"]."""
  have = flags()
  return [name for name in _NAMED if name in have]


def supported_variants() -> list[str]:
  """The kernel variants this CPU can run, fastest first ("generic" always)."""
  is_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
  have = flags()
  return [
    name
    for name, (_, needs) in VARIANTS.items()
    if name == "generic" or (is_x86 and all(flag in have for flag in needs))
  ]


@functools.cache
def largest_cache_bytes() -> int:
  """The size of CPU 0's largest cache (sysfs), 32 MiB where it is not reported."""
  sizes = []
  base = "/sys/devices/system/cpu/cpu0/cache"
  try:
    for index in os.listdir(base):
      try:
        with open(os.path.join(base, index, "size")) as f:
          text = f.read().strip().upper()
      except OSError:
        continue
      scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
      digits = text.rstrip("KMG")
      if digits.isdigit():
        sizes.append(int(digits) * scale)
  except OSError:
    pass
  return max(sizes, default=32 << 20)


def describe() -> dict:
  """`{"cpu_model", "cpu_extensions", "cpu_count"}` for a result file."""
  return {
    "cpu_model": model(),
    "cpu_extensions": vector_extensions(),
    "cpu_count": len(os.sched_getaffinity(0))
    if hasattr(os, "sched_getaffinity")
    else os.cpu_count(),
  }

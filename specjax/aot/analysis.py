"""One compiled program for a target, read: kernels, host work, memory, collectives.

`compile_for(lower, target)` compiles a program lowered for a target (with the
thunk dump on GPU) and `read(compiled, target, ...)` reports, from the
compiled HLO (`specjax.bench.hlo`) and, on GPU, the thunk sequence
(`specjax.bench.thunks`): kernels per trip of the generation loop, what the
host does per trip, whole-cache copies in loop bodies, per-device memory
against the chip's, and the collectives per call.
"""

from __future__ import annotations

import tempfile
import time

import jax

from specjax.aot.targets import Target
from specjax.bench import hlo, thunks
from specjax.bench.compile import no_persistent_cache


def compile_for(lower, target: Target, options: dict | None = None) -> dict:
  """Lowers (`lower()`, a function returning a `jax.stages.Lowered`) and compiles
  for `target` with extra compile `options`.

  Returns:
    `{"compiled": Compiled | None, "error": str | None, "thunks": str | None,
    "lower_s", "compile_s"}`; a compiler error is returned, not raised (its first
    line: the report keeps going).
  """
  out = {"compiled": None, "error": None, "thunks": None, "lower_s": None, "compile_s": None}
  start = time.perf_counter()
  try:
    lowered = lower()
    out["lower_s"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as directory:
      extra = dict(options or {})
      if target.platform == "gpu":
        extra |= thunks.dump_options(directory)
      start = time.perf_counter()
      # A deviceless executable cannot be read back from JAX's persistent cache
      # (no client to load it), and the compile seconds are the compiler's own.
      with no_persistent_cache():
        compiled = lowered.compile(extra) if extra else lowered.compile()
      out["compile_s"] = time.perf_counter() - start
      out["thunks"] = thunks.read_dump(directory) if target.platform == "gpu" else None
    out["compiled"] = compiled
  except Exception as e:  # the compiler's own error types differ by backend and version
    message = str(e).strip().splitlines()
    out["error"] = f"{type(e).__name__}: {message[0] if message else ''}"[:500]
  return out


def memory(compiled, target: Target) -> dict:
  """Per-device bytes of a compiled program (`memory_analysis`): arguments,
  temporaries, outputs (less what aliases an argument), code, their total and
  its share of the chip's memory."""
  stats = compiled.memory_analysis()
  fields = dict(
    argument_bytes=int(stats.argument_size_in_bytes),
    temp_bytes=int(stats.temp_size_in_bytes),
    output_bytes=int(stats.output_size_in_bytes),
    alias_bytes=int(stats.alias_size_in_bytes),
    code_bytes=int(stats.generated_code_size_in_bytes),
  )
  total = (
    fields["argument_bytes"]
    + fields["temp_bytes"]
    + fields["output_bytes"]
    - fields["alias_bytes"]
    + fields["code_bytes"]
  )
  return dict(
    fields,
    total_bytes=total,
    device_bytes=target.chip.memory_bytes,
    fraction=total / target.chip.memory_bytes,
    fits=total <= target.chip.memory_bytes,
  )


def generation_loop(text: str) -> str | None:
  """The generation (or serving) loop's body in compiled HLO: the while body whose
  one trip launches the most kernels, nested loops counted per trip."""
  bodies = hlo.while_bodies(text)
  return max(bodies, key=lambda b: hlo.launches(text, b)["kernels"]) if bodies else None


def read(
  result: dict,
  target: Target,
  cache_layer_bytes: int | None = None,
) -> dict:
  """The report of one `compile_for` result: `compiled` (bool), `error`,
  compile seconds, and for a compiled program:

  - `kernels_per_trip`: kernels one trip of the generation loop launches (HLO,
    nested loops per known trip count; the entry's for a program with no loop),
    `unknown_trips` (nested loops counted once);
  - `thunks` (GPU): `specjax.bench.thunks.summary` (command buffers, loops on
    the device or the host, host launches per trip);
  - `cache_copies`: loop-body outputs that rewrite a buffer of at least
    `cache_layer_bytes` (one layer's K cache) whole, with their bytes;
  - `memory`: `memory(...)`; `collectives`: per opcode, count and bytes per call.
  """
  compiled = result["compiled"]
  out = {
    "compiled": compiled is not None,
    "error": result["error"],
    "lower_s": result["lower_s"],
    "compile_s": result["compile_s"],
  }
  if compiled is None:
    return out
  text = compiled.as_text()
  body = generation_loop(text)
  launched = hlo.launches(text, body)
  out.update(kernels_per_trip=launched["kernels"], unknown_trips=launched["unknown_trips"])
  if result["thunks"] is not None:
    out["thunks"] = thunks.summary(result["thunks"])
  if cache_layer_bytes:
    copies = hlo.cache_copies(text, cache_layer_bytes)
    out["cache_copies"] = len(copies)
    out["cache_copy_bytes"] = sum(op.bytes for op in copies)
  out["memory"] = memory(compiled, target)
  summary = hlo.collective_summary(hlo.collectives(text, target.num_devices))
  out["collectives"] = {
    k: {"count": int(v["count"]), "bytes": int(v["bytes"]), "link_bytes": float(v["link_bytes"])}
    for k, v in summary.items()
  }
  return out


def free(result: dict) -> None:
  """Drops the compiled executable of a `compile_for` result."""
  result["compiled"] = None
  jax.clear_caches()

"""The accelerator check: every program a user runs, compiled for a device this host lacks.

What `experiments/accelerator_check.py` runs (`check(config)`; the settings:
configs/accelerator_check.py; the guide: docs/accelerators.md). Per target
(`specjax.aot.targets`) and shape (`specjax.aot.shapes`), sections:
- "programs": each program (`specjax.aot.programs.PROGRAMS`) at full depth:
  compiled or the compiler's error, kernels per trip, what the host does per
  trip (GPU: the thunk sequence), whole-cache copies in loop bodies,
  per-device memory against the chip's, collectives per call, and the
  step-time estimate (`specjax.aot.estimate`, labelled as one);
- "layers": kernels per layer and per step of plain decoding and of a
  speculative iteration with the draft model (the target at 1 and 2 layers,
  as `specjax.bench.compile.step_launches` counts), the iteration's drafting
  and bookkeeping (its 1-layer count minus the plain step's), on GPU also with
  XLA's Triton GEMMs off (`--xla_gpu_enable_triton_gemm=false`);
- "fit": the largest batch at each context that fits one device
  (`specjax.aot.fit`), for decoding (`fit_programs`) and the server's step;
- "measured": what `experiments/gpu_check.py` measured on this chip, where a
  result file of it is kept under experiments/results/.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp

from specjax import heads
from specjax.aot import analysis, estimate, fit, programs, shapes, targets
from specjax.models.config import default_scan_layers
from specjax.results import markdown_table
from specjax.sampling import GREEDY, SamplingParams

SECTIONS = ("programs", "layers", "fit", "measured")
LAYOUTS = ("", "scanned", "unrolled")
# The target depths the fit's first guess compiles (a drafter such as EAGLE-3
# reads features from a few of the target's layers).
FIT_DEPTHS = (4, 6)
# The fit's probes at 8 and 16 rows per data shard: closer to the answer than 1
# and 2, where buffer reuse makes a row look costlier.
FIT_PROBE = 8
TRITON_OFF = {"xla_gpu_enable_triton_gemm": False}
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results")


def _mesh(target: targets.Target, shape: str):
  """The (data, model) mesh of `shape` ("1x8"; "" = every device along model)."""
  if not shape:
    return target.mesh()
  try:
    dims = tuple(int(d) for d in shape.split("x"))
  except ValueError:
    dims = ()
  if len(dims) != 2:
    raise ValueError(f"--config.mesh must be DATAxMODEL such as 1x8 or 2x4, got {shape!r}.")
  return target.mesh(dims)


def _layer_bytes(cfg, batch: int, context: int, model_devices: int) -> int:
  """Bytes of one layer's K cache one device holds (what a whole-cache copy rewrites)."""
  heads = cfg.n_kv_heads // model_devices if cfg.n_kv_heads % model_devices == 0 else cfg.n_kv_heads
  return batch * heads * context * cfg.resolved_head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def _sampling(config) -> SamplingParams:
  """The decode programs' sampling: greedy at temperature 0 (what gpu_check and the
  issue's kernel counts use), else that temperature."""
  if config.temperature < 0:
    raise ValueError(f"--config.temperature must be >= 0, got {config.temperature}.")
  return GREEDY if config.temperature == 0 else SamplingParams(temperature=config.temperature)


def _layout(cfg, target: targets.Target) -> str:
  """ "scanned" or "unrolled": `cfg`'s layer layout on `target`'s platform."""
  scanned = cfg.scan_layers if cfg.scan_layers is not None else default_scan_layers(target.platform)
  return "scanned" if scanned else "unrolled"


def program_rows(config, target, mesh, target_cfg, draft_cfg) -> list[dict]:
  """The "programs" section: one row per program (`analysis.read` plus the estimate)."""
  models = programs.build_models(target_cfg, draft_cfg, mesh)
  model_devices = mesh.shape.get("model", 1)
  layer = _layer_bytes(target_cfg, config.batch, config.context, model_devices)
  weights = estimate.device_param_bytes(models.target)
  cache = estimate.cache_read_bytes(target_cfg, config.batch, config.context // 2, model_devices)
  rows = []
  for name in config.programs:
    result = analysis.compile_for(
      lambda name=name: programs.lower(
        name, models, mesh, config.batch, config.context, config.gamma, sampling=_sampling(config)
      ),
      target,
    )
    row = {"program": name, **analysis.read(result, target, cache_layer_bytes=layer)}
    analysis.free(result)
    if row["compiled"]:
      row["estimate"] = estimate.step_ms(row, target, weights + cache)
    rows.append(row)
    print(_program_line(row), flush=True)
  return rows


def _program_line(row: dict) -> str:
  if not row["compiled"]:
    return f"{row['program']}: not compiled ({row['error']})"
  loop = (row.get("thunks") or {}).get("generation_loop") or {}
  where = "" if not loop else (" loop on device" if loop["on_device"] else " loop on host")
  return (
    f"{row['program']}: {row['kernels_per_trip']} kernels/trip,{where} "
    f"{row['memory']['total_bytes'] / 2**30:.2f} GiB/device, compiled in {row['compile_s']:.1f} s"
  )


def _trip_counts(target, mesh, target_cfg, draft_cfg, config, layers, options) -> dict:
  """Kernels per trip of `plain` and `draft_model` with the target cut to `layers`."""
  cfg = target_cfg.replace(n_layers=layers, local_layers=None)
  models = programs.build_models(cfg, draft_cfg, mesh, kinds=())
  out = {}
  for name in ("plain", "draft_model"):
    result = analysis.compile_for(
      lambda name=name: programs.lower(
        name, models, mesh, config.batch, config.context, config.gamma, sampling=_sampling(config)
      ),
      target,
      options,
    )
    if result["compiled"] is None:
      raise RuntimeError(f"{name} at {layers} target layers did not compile: {result['error']}")
    out[name] = analysis.read(result, target)
    analysis.free(result)
  return out


def layer_rows(config, target, mesh, target_cfg, draft_cfg) -> list[dict]:
  """The "layers" section: per GEMM setting, kernels per layer (an interior one:
  the 3-layer program minus the 2-layer one, since the first and last layers
  fuse with what surrounds them) and per step of plain decoding and per
  iteration of speculative decoding (the draft model, γ = config.gamma), the
  iteration's drafting and bookkeeping (its 1-layer count minus the plain
  step's, as issue 72 counts it), and the 2-layer programs' loop placement."""
  settings = [("triton_default", None), ("triton_off", TRITON_OFF)]
  if target.platform != "gpu":
    settings = [("xla", None)]
  n = target_cfg.n_layers
  depths = (1, 2, 3) if n >= 3 else (1, 2)
  rows = []
  for label, options in settings:
    counts = {
      d: _trip_counts(target, mesh, target_cfg, draft_cfg, config, d, options) for d in depths
    }
    row = {"gemm": label, "layers": n, "layout": _layout(target_cfg, target)}
    low, high = depths[-2], depths[-1]
    for name, key in (("plain", "ar"), ("draft_model", "spec")):
      trips = {d: counts[d][name]["kernels_per_trip"] for d in depths}
      per_layer = trips[high] - trips[low]
      # A compiler may unroll a short layer loop (XLA:TPU at 2 or 3 trips): then
      # the counts by depth do not grow by a layer's, and no per-layer count holds.
      grows = per_layer > 0 and all(trips[a] < trips[b] for a, b in zip(depths, depths[1:]))
      row[f"{key}_kernels_per_layer"] = per_layer if grows else None
      row[f"{key}_kernels_per_step"] = trips[low] + per_layer * (n - low) if grows else None
      row[f"{key}_kernels_by_depth"] = trips
      loop = (counts[2][name].get("thunks") or {}).get("generation_loop") or {}
      row[f"{key}_loop_on_device"] = loop.get("on_device")
      row[f"{key}_host_launches_per_trip"] = loop.get("host_launches_per_trip")
      row[f"{key}_command_buffers"] = (counts[2][name].get("thunks") or {}).get("command_buffers")
    row["drafting_and_bookkeeping"] = (
      counts[1]["draft_model"]["kernels_per_trip"] - counts[1]["plain"]["kernels_per_trip"]
    )
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def fit_rows(config, target, mesh, target_cfg, draft_cfg) -> list[dict]:
  """The "fit" section: per program of `config.fit_programs` and context of
  `config.fit_contexts`, the largest batch one device holds, searched at full
  depth (`fit.largest_batch`); with unrolled layers its first guess comes from
  the target at `FIT_DEPTHS` layers (`fit.predicted_batch`)."""
  kinds = tuple(p for p in config.fit_programs if p in heads.names())
  depths = tuple(min(d, target_cfg.n_layers) for d in FIT_DEPTHS)
  models = {
    depth: programs.build_models(
      target_cfg.replace(n_layers=depth, local_layers=None), draft_cfg, mesh, kinds=kinds
    )
    if depth != target_cfg.n_layers
    else programs.build_models(target_cfg, draft_cfg, mesh, kinds=kinds)
    for depth in sorted({*depths, target_cfg.n_layers})
  }
  step = mesh.shape.get("data", 1)
  rows = []
  for name in config.fit_programs:
    for context in config.fit_contexts:

      def lower(b, depth=target_cfg.n_layers, name=name, context=context):
        return programs.lower(
          name, models[depth], mesh, b, context, config.gamma, sampling=_sampling(config)
        )

      guess = None
      # Unrolled layers compile in time growing with the depth; scanned ones
      # barely, so there the full depth's own probes are as cheap.
      unrolled = _layout(target_cfg, target) == "unrolled"
      if unrolled and depths[0] < depths[1] < target_cfg.n_layers:
        guess = fit.predicted_batch(lower, target, target_cfg.n_layers, step, depths)
      found = fit.largest_batch(
        lower, target, step=step, limit=config.fit_limit, guess=guess, probe=FIT_PROBE
      )
      row = {"program": name, "context": context, "predicted": guess, **found}
      row["tokens"] = found["batch"] * context
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


# What a measured row keeps of gpu_check's result rows: the step and iteration times.
MEASURED_FIELDS = (
  "changes",
  "shape",
  "command_buffers",
  "kernels_per_layer",
  "ar_ms_per_token",
  "ar_step_ms",
  "floor_ms_per_step",
  "target_bandwidth_floor_ms",
  "ar_over_floor",
  "spec_ms_per_iteration",
  "target_verify_ms",
  "draft_call_ms",
  "speedup",
)


def measured_rows(target) -> list[dict]:
  """What `experiments/gpu_check.py` measured on this target's chip: its rows'
  step and iteration times (`MEASURED_FIELDS`), from result files under
  experiments/results/ whose device kind is the chip's."""
  rows = []
  for path in sorted(glob.glob(os.path.join(RESULTS, "**", "gpu_check*.json"), recursive=True)):
    with open(path) as f:
      data = json.load(f)
    if str(data.get("device_kind", "")).lower() != target.chip.kind.lower():
      continue
    for section in ("step", "scaled", "coupling"):
      for row in data.get(section) or []:
        kept = {k: row[k] for k in MEASURED_FIELDS if k in row}
        rows.append(
          {
            "file": os.path.relpath(path, RESULTS),
            "section": section,
            "date": data.get("date"),
            **kept,
          }
        )
  return rows


def names(value) -> tuple:
  """A config field of names as a tuple: a tuple, or one comma-separated string
  (`--config.programs=plain,eagle3`), each entry also split at commas."""
  items = (value,) if isinstance(value, str | int) else tuple(value)
  return tuple(part.strip() for item in items for part in str(item).split(",") if part.strip())


def check(config) -> dict:
  """Runs the sections of `config.sections` for `config.target` and `config.shape`
  (this process must run with JAX_PLATFORMS=cpu: `targets.check_host`)."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for field in ("sections", "programs", "fit_programs"):
      config[field] = names(config[field])
    config.fit_contexts = tuple(int(c) for c in names(config.fit_contexts))
  for section in config.sections:
    if section not in SECTIONS:
      raise ValueError(
        f"--config.sections: each must be one of {', '.join(SECTIONS)}, got {section!r}."
      )
  for name in (*config.programs, *config.fit_programs):
    if name not in programs.PROGRAMS:
      raise ValueError(
        f"--config.programs / fit_programs: each must be one of {', '.join(programs.PROGRAMS)}, "
        f"got {name!r}."
      )
  targets.check_host()
  target = targets.get(config.target)
  target_cfg, draft_cfg, note = shapes.shape_configs(config.shape, config.dtype)
  if config.layout not in LAYOUTS:
    raise ValueError(f"--config.layout must be one of {LAYOUTS}, got {config.layout!r}.")
  if config.layout:  # else the target platform's default (`default_scan_layers`)
    target_cfg = target_cfg.replace(scan_layers=config.layout == "scanned")
  mesh = _mesh(target, config.mesh)
  out = {
    "target": target.name,
    "device_kind": targets.device_kind(target),
    "devices": target.num_devices,
    "mesh": dict(mesh.shape),
    "shape": config.shape,
    "shape_note": note,
    "dtype": config.dtype,
    "layout": _layout(target_cfg, target),
    "batch": config.batch,
    "context": config.context,
    "gamma": config.gamma,
    "temperature": config.temperature,
    "chip": dict(target.chip.__dict__),
  }
  sections = {
    "programs": program_rows,
    "layers": layer_rows,
    "fit": fit_rows,
  }
  for section in config.sections:
    if section == "measured":
      out["measured"] = measured_rows(target)
    else:
      out[section] = sections[section](config, target, mesh, target_cfg, draft_cfg)
  return out


def _gib(nbytes) -> str:
  return f"{nbytes / 2**30:.2f}" if nbytes else ""


# The short tables' columns, per section (`markdown`).
COLUMNS = {
  "programs": [
    ("program", "{program}"),
    ("compiled", lambda r: "yes" if r["compiled"] else f"no: {r['error']}"),
    ("kernels/trip", lambda r: str(r.get("kernels_per_trip", ""))),
    ("loop", lambda r: _loop_cell(r)),
    ("host launches/trip", lambda r: str(_loop(r).get("host_launches_per_trip", ""))),
    ("cache copies", lambda r: str(r.get("cache_copies", ""))),
    ("GiB/device", lambda r: _gib(r["memory"]["total_bytes"]) if r["compiled"] else ""),
    (
      "collectives/call",
      lambda r: str(sum(v["count"] for v in (r.get("collectives") or {}).values())),
    ),
    (
      "estimate ms/trip",
      lambda r: f"{r['estimate']['step_ms']:.3f}" if r.get("estimate") else "",
    ),
  ],
  "layers": [
    ("GEMMs", "{gemm}"),
    ("layout", "{layout}"),
    ("plain kernels/layer", "{ar_kernels_per_layer}"),
    ("plain kernels/step", "{ar_kernels_per_step}"),
    ("spec kernels/iteration", "{spec_kernels_per_step}"),
    ("drafting + bookkeeping", "{drafting_and_bookkeeping}"),
    ("loop on device", "{ar_loop_on_device}"),
    ("host launches/trip", "{ar_host_launches_per_trip}"),
  ],
  "fit": [
    ("program", "{program}"),
    ("context", "{context}"),
    ("largest batch", "{batch}"),
    ("tokens", "{tokens}"),
    ("GiB/device", lambda r: _gib(r["bytes"])),
    ("compiles", "{compiles}"),
  ],
}


def markdown(result: dict) -> str:
  """The short tables of a `check` result: a heading line, then one table per
  section it ran (`COLUMNS`)."""
  parts = [
    f"{result['target']} ({result['device_kind']}, {result['devices']} devices, mesh "
    f"{result['mesh']}), {result['shape']} in {result['dtype']}, batch {result['batch']}, "
    f"context {result['context']}"
  ]
  for section, columns in COLUMNS.items():
    if result.get(section):
      parts.append(markdown_table(result[section], columns))
  return "\n\n".join(parts)


def _loop(row: dict) -> dict:
  return (row.get("thunks") or {}).get("generation_loop") or {}


def _loop_cell(row: dict) -> str:
  loop = _loop(row)
  if not loop:
    return "device (TPU)" if row.get("compiled") and "thunks" not in row else ""
  return "device" if loop["on_device"] else "host"

"""The serving engine's decode steps on meshes: the collectives each runs, and
the bytes they move (`experiments/mesh_collectives.py`).

For each `(data, model)` mesh, an engine on the bundled pair (or random tiny
models) is built on that mesh and each of its step programs (a plain step and a
drafting step at the full batch) is lowered and compiled, never run; its HLO is
read by `specjax.bench.hlo.collectives`. Counts are per decode step (loops'
trip counts multiplied in); bytes are the exchanged arrays' sizes, and what each
device sends with ring algorithms (the figure a link's bandwidth divides).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import pretrained
from specjax.bench import hlo
from specjax.jobs import serve
from specjax.models.transformer import Transformer
from specjax.results import markdown_table
from specjax.serving import Engine, EngineConfig
from specjax.serving import mesh as serving_mesh
from specjax.validation import check_int

SHORT = {
  "all-reduce": "AR",
  "all-gather": "AG",
  "reduce-scatter": "RS",
  "all-to-all": "A2A",
  "collective-permute": "CP",
  "collective-broadcast": "CB",
}


def parse_meshes(text: str, flag: str = "--meshes") -> list[tuple[int, int]]:
  """ "8x1,2x4,1x8" -> [(8, 1), (2, 4), (1, 8)] (data x model), or a ValueError naming `flag`."""
  meshes = []
  for part in (p.strip() for p in text.split(",")):
    match = re.fullmatch(r"(\d+)x(\d+)", part)
    if not match or "0" in (match.group(1), match.group(2)):
      raise ValueError(
        f"{flag} must be meshes DATAxMODEL separated by commas, each >= 1 (e.g. 8x1,2x4,1x8); "
        f"got {text!r}."
      )
    meshes.append((int(match.group(1)), int(match.group(2))))
  return meshes


def scaled_models(scale: str, layers: int, dtype=jnp.bfloat16):
  """`(target, draft)` of a scaled pair's shapes (`specjax.pretrained.SCALES`)
  with random weights and the target cut to its first `layers` layers: what a
  step exchanges depends on the shapes, not the weights, and each layer
  exchanges what the others do, so a few layers stand for all of them."""
  if scale not in pretrained.SCALES:
    raise ValueError(f"--scale must be one of {', '.join(pretrained.SCALES)}, got {scale!r}.")
  check_int("--layers", layers, 1)
  target_cfg, draft_cfg = pretrained.scaled_configs(scale, *pretrained.bundled_configs(), dtype)
  target_cfg = target_cfg.replace(n_layers=min(layers, target_cfg.n_layers))
  return Transformer(target_cfg, rngs=nnx.Rngs(0)), Transformer(draft_cfg, rngs=nnx.Rngs(1))


def measure(
  meshes: list[tuple[int, int]],
  model: str = "bundled",
  slots: int = 8,
  gamma: int = 4,
  dtype: str = "bfloat16",
  scale: str = "",
  layers: int = 2,
  vocab_placements: tuple[str, ...] = ("replicate",),
) -> list[dict]:
  """One row per mesh and step program (gamma 0: plain; `gamma`: drafting):
  the collectives per decode step by opcode, their count, and bytes.

  Args:
    meshes: `(data, model)` shapes, each checked against the devices before
      any model loads.
    model: "bundled" (the pair) or "tiny" (`specjax.jobs.serve.load_models`).
    scale: "" or a scaled pair's preset in place of `model` (`scaled_models`,
      its target's first `layers` layers).
    vocab_placements: the `EngineConfig.vocab_placement`s to compare.
  """
  for vocab in vocab_placements:
    if vocab not in serving_mesh.VOCAB_PLACEMENTS:
      raise ValueError(
        f"--vocab must name placements among {', '.join(serving_mesh.VOCAB_PLACEMENTS)}, "
        f"got {vocab!r}."
      )
  for shape in meshes:
    serving_mesh.resolve(shape)
    EngineConfig(slots=slots, mesh=shape)  # slots split over data
  if scale:
    target, draft = scaled_models(scale, layers)
  else:
    target, draft, _, _, _ = serve.load_models(model, dtype=dtype)
  rows = []
  for shape, vocab in ((s, v) for s in meshes for v in vocab_placements):
    config = EngineConfig(
      vocab_placement=vocab,
      slots=slots,
      gamma=gamma,
      prompt_buckets=(64,),
      max_new_tokens=64,
      widths=(slots,),
      mesh=shape,
    )
    engine = Engine(target, draft, config)
    devices = shape[0] * shape[1]
    for g in config.draft_lengths:
      ops = hlo.collectives(engine.lowered_step(g).compile().as_text(), devices)
      summary = hlo.collective_summary(ops)
      rows.append(
        {
          "mesh": f"{shape[0]}x{shape[1]}",
          "vocab": vocab,
          "target_layers": target.cfg.n_layers,
          "gamma": g,
          "by_opcode": {k: int(v["count"]) for k, v in summary.items()},
          "collectives": int(sum(v["count"] for v in summary.values())),
          "bytes": int(sum(v["bytes"] for v in summary.values())),
          "link_bytes": float(sum(v["link_bytes"] for v in summary.values())),
          "ops": [op._asdict() for op in ops],
        }
      )
    del engine
  return rows


def markdown(rows: list[dict]) -> str:
  """The rows as a table: mesh, draft length, collectives by kind, bytes."""

  def kinds(row):
    return ", ".join(f"{SHORT[k]} {n}" for k, n in sorted(row["by_opcode"].items())) or "none"

  return markdown_table(
    rows,
    [
      ("mesh (data x model)", "{mesh}"),
      ("vocabulary", "{vocab}"),
      ("step", lambda r: f"gamma={r['gamma']}" if r["gamma"] else "plain"),
      ("collectives / step", "{collectives}"),
      ("by kind", kinds),
      ("arrays exchanged", lambda r: _kib(r["bytes"])),
      ("sent per device", lambda r: _kib(r["link_bytes"])),
    ],
  )


def _kib(n: float) -> str:
  return f"{n / 1024:.1f} KiB"


def devices_note() -> str:
  """Which devices the table was compiled for."""
  d = jax.devices()
  return f"{len(d)} {d[0].platform} device(s) ({d[0].device_kind})"

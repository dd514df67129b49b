"""`reproduce(config, output_dir)`: every section of the report, in one call.

The launcher `experiments/reproduce.py` is this plus flags; configs/reproduce.py
documents every field. Steps: the closed forms and worked examples; the bundled
pair and `config.drafters` (the corpus-trained draft trained first if missing);
`measure`; the sections, report.md / report.json and figures. docs/reproduction.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from specjax import heads, pretrained
from specjax.data import Tokenizer
from specjax.data.corpus import copy_subset, corpus_files, read_source
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.drafting import (
  CrossTokenizerDrafter,
  count_drafter,
)
from specjax.jobs.drafters import build_drafter
from specjax.reproduce import examples, figures, papers, report
from specjax.reproduce.coupling import coupling_study
from specjax.reproduce.measure import Variant, measure
from specjax.reproduce.report import CORPUS, DISTILLED
from specjax.validation import check_positive_int, read_json_object

DRAFTERS = (
  "unigram",
  "bigram",
  CORPUS,
  DISTILLED,
  "prompt lookup",
  "layer skip",
  "EAGLE head",
  "Medusa heads",
  "early exit",
  "cross-tokenizer draft (TLI)",
)
# The report's sections, in order (their ids).
SECTIONS = (
  "leviathan_formulas",
  "leviathan_table3",
  "leviathan_table4",
  "chen",
  "sun",
  "distillspec",
  "worked_examples",
  "daliri",
)


def _bundled_head(title: str) -> str | None:
  """The bundled head kind a drafter title (`HeadKind.title`) names, or None."""
  return next((k.name for k in heads.kinds() if k.bundled and k.title == title), None)


def apply_quick(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with `config.quick`'s fields (nested ones too) written over the others."""

  def flat(fields: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in fields.items():
      if isinstance(value, dict):
        out.update(flat(value, f"{prefix}{key}."))
      else:
        out[f"{prefix}{key}"] = value
    return out

  config = config.copy_and_resolve_references()
  config.update_from_flattened_dict(flat(config.quick.to_dict()))
  return config


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field for a config `reproduce` cannot run."""
  for name in ("gamma", "num_prompts", "max_new_tokens", "num_runs", "samples", "layer_skip"):
    check_positive_int(f"config.{name}", config[name])
  for g in config.gammas:
    check_positive_int("config.gammas", g)
  unknown = [d for d in config.drafters if d not in DRAFTERS]
  if unknown:
    raise ValueError(f"config.drafters must be among {DRAFTERS}, got unknown {unknown}.")
  for needed in (CORPUS, DISTILLED):
    if needed not in config.drafters:
      raise ValueError(f"config.drafters must include {needed!r} (DistillSpec, Chen, Sun).")
  unknown = [d for d in config.coupled_drafters if d not in config.drafters]
  if unknown:
    raise ValueError(f"config.coupled_drafters must be among config.drafters, got {unknown}.")
  if not config.temperatures or any(t < 0 for t in config.temperatures):
    raise ValueError(f"config.temperatures must be non-empty and >= 0, got {config.temperatures}.")
  if config.count_files < 0:
    raise ValueError(
      f"config.count_files must be >= 0 (0: the whole split), got {config.count_files}."
    )


def corpus_documents(tokenizer, max_files: int = 0, root: str | None = None) -> list[np.ndarray]:
  """The training split's files as token id arrays (the first `max_files`; 0: all)."""
  files = corpus_files("train", root)
  if max_files:
    files = files[:max_files]
  encoded = tokenizer.encode_batch([read_source(f) for f in files])
  return [np.asarray(ids, np.int32) for ids in encoded]


def corpus_draft(config, output_dir: str, progress: Callable[[str], None]):
  """The corpus-trained draft: `config.corpus_draft.run` if it holds a trained
  run, else trained there (or in output_dir) first with `config.corpus_draft.train`."""

  from specjax.training import train
  from specjax.training.checkpoint import has_checkpoints, load_trained_model

  spec = config.corpus_draft
  run = spec.run or os.path.join(output_dir, "corpus_draft")
  if not has_checkpoints(run):
    train_config = spec.train.copy_and_resolve_references()
    steps = train_config.num_steps
    train_config.warmup_steps = min(train_config.warmup_steps, max(steps // 10, 1))
    train_config.eval_every = train_config.checkpoint_every = steps
    train_config.eval_batches = 2
    train_config.data.dir = train_config.data.dir or os.path.join(output_dir, "data")
    train_config.data.tokenizer = pretrained.TOKENIZER_FILE
    if spec.files_per_split:  # a small corpus (the quick run): the first files of each split
      root = os.path.join(output_dir, "corpus")
      splits = dict(zip(("train", "validation", "test"), spec.files_per_split))
      train_config.data.root = copy_subset(root, splits)
    progress(f"training the corpus-trained draft ({steps} steps) in {run}")
    train(train_config, run, echo=lambda line: progress(f"  {line}"))
  model, step = load_trained_model(run, dtype="float32")
  return model, {"run": run, "step": step}


def _drafters(config, target, draft, tokenizer, output_dir, progress) -> tuple[dict, dict]:
  """name -> drafter for `config.drafters`, and what the report records of them."""
  out, info = {}, {}
  v = target.cfg.vocab_size
  counts = [d for d in config.drafters if d in ("unigram", "bigram")]
  if counts:
    progress(f"counting the training split ({config.count_files or 'all'} files)")
    docs = corpus_documents(tokenizer, config.count_files)
    info["count_tokens"] = int(sum(len(d) for d in docs))
    for name in counts:
      out[name] = count_drafter(docs, v, 1 if name == "unigram" else 2, config.count_smoothing)
  for name in config.drafters:
    if name == CORPUS:
      out[name], info["corpus_draft"] = corpus_draft(config, output_dir, progress)
    elif name == DISTILLED:
      out[name] = draft
    elif name == "prompt lookup":
      out[name] = build_drafter("ngram", target, ngram=3)
    elif name == "layer skip":
      out[name] = build_drafter("layer_skip", target, layer_skip=config.layer_skip)
    elif _bundled_head(name):
      out[name] = build_drafter(_bundled_head(name), target)
    elif name.startswith("cross-tokenizer"):
      cross, cross_tokenizer = pretrained.load_cross_draft()
      target_tokenizer = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
      out[name] = CrossTokenizerDrafter(cross, cross_tokenizer, target_tokenizer)
  return out, info


def variants(config) -> list[Variant]:
  """Every drafter at config.gamma; the distilled draft at each γ of config.gammas,
  and with block verification at config.gamma and T > 0 (at T = 0 both rules
  accept exactly the argmax matches); `config.coupled_drafters` with the coupled
  verifier at T > 0 (Daliri et al.)."""
  out = [Variant(name, config.gamma) for name in config.drafters]
  out += [Variant(DISTILLED, g) for g in config.gammas if g != config.gamma]
  sampled = tuple(t for t in config.temperatures if t > 0)
  if sampled:
    out.append(Variant(DISTILLED, config.gamma, "block", sampled))
    out += [Variant(name, config.gamma, "coupled", sampled) for name in config.coupled_drafters]
  return out


def _header(config, result: dict[str, Any]) -> str:
  """The report's first line: what was measured, when, and how long it took."""
  return (
    f"Bundled pair (8.7M target, 0.92M distilled draft); held-out prompts: "
    f"{config.num_prompts} × {config.max_new_tokens} tokens, batch 1; timed runs per "
    f"variant (median): {config.num_runs}; {result.get('date', 'date not recorded')}, "
    f"{result['seconds']:.0f} s in all."
  )


def read_saved_report(path: str, name: str = "--render_from") -> dict[str, Any]:
  """The result a run saved as report.json, checked to be one (`write_report`
  renders it again); errors name `name`, the flag that gave `path`."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{name}: {path}: no such file (a report.json of a finished run)")
  if os.path.isdir(path):
    raise ValueError(
      f"{name}: {path} is a directory; name its report.json ({os.path.join(path, 'report.json')})"
    )
  try:
    result = read_json_object(path)
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from e
  missing = [key for key in ("config", "rows", "examples", "seconds") if key not in result]
  if missing:
    raise ValueError(
      f"{name}: {path} is not a report.json of experiments.reproduce: it lacks {missing}"
    )
  return result


def write_report(result: dict[str, Any], output_dir: str, figures_too: bool = True) -> dict:
  """Builds the sections and figures from `result`, writes report.md and
  report.json into `output_dir`, returns `result` with sections and figure names
  (also re-renders a saved report.json: `--render_from`)."""

  config = ml_collections.ConfigDict(result["config"])
  rows, ex = result["rows"], result["examples"]
  os.makedirs(output_dir, exist_ok=True)
  fixed = [r for r in rows if r["gamma"] == config.gamma and r["verifier"] == "auto"]
  sections = [
    report.formulas_section(),
    report.table3_section(rows, config.gamma),
    report.table4_section(fixed),
    report.chen_section(rows, DISTILLED),
    report.sun_section(ex["block_toy"], rows, DISTILLED, config.gamma),
    report.distillspec_section(rows, config.gamma),
    report.examples_section(ex["one_token"], ex["top1_shortcut"]),
    report.daliri_section(result.get("coupling", []), rows, config.gamma),
  ]
  made = []
  if figures_too:

    def out(name):
      return os.path.join(output_dir, name)

    sweep = [r for r in rows if r["drafter"] == DISTILLED]
    made = [
      figures.tokens_per_iteration(sweep, DISTILLED, out("leviathan_tokens_per_iteration.png")),
      figures.speedup_vs_gamma(sweep, DISTILLED, out("leviathan_speedup_vs_gamma.png")),
      figures.ops_factor(out("leviathan_ops_factor.png")),
      figures.predicted_vs_measured(fixed, out("leviathan_predicted_vs_measured.png")),
      figures.acceptance_by_position(sweep, DISTILLED, out("chen_acceptance_by_position.png")),
      figures.speedup_vs_k(sweep, DISTILLED, out("chen_speedup_vs_k.png")),
    ]
  else:
    for s in sections:
      s["figures"] = []
  result = {**result, "sections": sections, "figures": [os.path.basename(f) for f in made]}
  with open(os.path.join(output_dir, "report.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(os.path.join(output_dir, "report.md"), "w") as f:
    f.write(report.to_markdown(sections, _header(config, result)))
  return result


def reproduce(
  config: ml_collections.ConfigDict, output_dir: str, progress: Callable[[str], None] = print
) -> dict[str, Any]:
  """Runs every section, writes report.md, report.json and the figures into
  `output_dir`, and returns the report's JSON."""
  check_config(config)
  os.makedirs(output_dir, exist_ok=True)
  start = time.time()
  steps = 4

  def step(i, text):
    progress(f"[{i}/{steps}] {text} ({time.time() - start:.0f} s)")

  step(1, "closed forms and worked examples")
  worked = [
    examples.one_token_example(e["q"], e["p"], config.samples) for e in papers.WORKED_EXAMPLES
  ]
  toy = examples.block_toy(config.samples)
  shortcut = examples.top1_shortcut(
    papers.WORKED_EXAMPLES[0]["q"], papers.WORKED_EXAMPLES[0]["p"], config.samples
  )
  step(2, "the bundled pair and the drafters")
  target, draft, tokenizer = pretrained.load_pair()
  drafters, info = _drafters(config, target, draft, tokenizer, output_dir, progress)
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(config.num_prompts))
  step(3, "measuring (every variant compiles once, then timed runs)")
  rows = measure(
    target,
    drafters,
    variants(config),
    prompts,
    lengths,
    temperatures=tuple(config.temperatures),
    max_new_tokens=config.max_new_tokens,
    num_runs=config.num_runs,
    seed=config.seed,
    progress=progress,
  )
  coupling = []
  for t in (t for t in config.temperatures if t > 0):
    progress(f"T={t:g}: the coupled verifier with every drafter (Daliri et al.)")
    coupling.append(
      coupling_study(
        target,
        drafters,
        draft,
        prompts,
        lengths,
        temperature=t,
        gamma=config.gamma,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        progress=progress,
      )
    )
  step(4, "report and figures")
  result = {
    "coupling": coupling,
    "date": time.strftime("%Y-%m-%d"),
    "rows": rows,
    "examples": {"one_token": worked, "block_toy": toy, "top1_shortcut": shortcut},
    "drafters": info,
    "config": config.to_dict(),
    "seconds": time.time() - start,
  }
  result = write_report(result, output_dir, figures_too=config.figures)
  progress(f"done in {time.time() - start:.0f} s: {output_dir}/report.md")
  return result

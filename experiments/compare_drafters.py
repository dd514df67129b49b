"""Compare drafters, verifiers and adaptive draft lengths on the bundled pair.

  python -m experiments.compare_drafters [--config=configs/compare_drafters.py] \
      [--output_json=PATH] [--output_md=PATH]

For each temperature: autoregressive decoding (the baseline) and speculative
decoding with every drafter (the bundled draft model, prompt lookup, the
target's first k layers) x every verifier that applies (greedy only at
temperature 0), at gamma = config.gamma; then the draft model at each fixed
gamma of `gamma_sweep` and with both adaptive draft lengths; then token trees
(`config.trees`: the draft model, EAGLE and Medusa each drafting the best static
tree of each size for its per-rank acceptance, `specjax.trees.best`, no deeper
than `config.trees.max_depth`, by default gamma: the same depth as the chains). Each variant
decodes the same held-out test-split prompts one by one (batch 1); times are
medians of `num_runs` interleaved runs after a warm-up. Prints JSON and a
markdown table (the README's).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import flags, logging

import specjax
from experiments import common
from specjax import benchmarking, pretrained, theory, trees
from specjax.data import Tokenizer
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.drafting import (
  CrossTokenizerDrafter,
  EagleDrafter,
  EarlyExitDrafter,
  MedusaDrafter,
  NGramDrafter,
  TreeDrafter,
  layer_skip,
)
from specjax.models.kv_cache import cache_capacity
from specjax.validation import check_output_path, check_positive_int

# The README's table: one line per variant.
COLUMNS = (
  ("T", "{temperature:g}"),
  ("drafter", "{drafter}"),
  ("verifier", "{verifier}"),
  ("γ", "{gamma}"),
  ("draft length", "{adaptive}"),
  ("α", "{acceptance_rate:.3f}"),
  ("tokens/iter", "{tokens_per_iteration:.2f}"),
  ("c", "{c:.3f}"),
  ("predicted", "{predicted_speedup:.2f}"),
  ("ms/token", "{ms_per_token:.3f}"),
  ("speedup", "{speedup:.2f}"),
)
HEAD_DRAFTERS = {"eagle": EagleDrafter, "medusa": MedusaDrafter, "early_exit": EarlyExitDrafter}
HEAD_NAMES = {"eagle": "EAGLE head", "medusa": "Medusa heads", "early_exit": "early exit"}
# Rows of the bundled draft with its own tokenizer (pretrained.load_cross_draft).
TLI, SLEM = "cross-tokenizer draft, TLI", "cross-tokenizer draft, SLEM"


def _variants(config, target, draft, temperature):
  """(name fields, drafter, verifier, gamma, adaptive) for one temperature."""
  applicable = ("greedy", "token", "block") if temperature == 0 else ("token", "block")
  verifiers = [v for v in applicable if v in config.verifiers]
  drafters = [("draft model", draft)]
  if config.ngram:
    lookup = NGramDrafter(target.cfg.vocab_size, config.ngram)
    drafters.append((f"prompt lookup (n<={config.ngram})", lookup))
  drafters += [(f"layer skip k={k}", layer_skip(target, k)) for k in config.layer_skip]
  heads = {
    kind: HEAD_DRAFTERS[kind](target, pretrained.load_head(kind, target)) for kind in config.heads
  }
  drafters += [(HEAD_NAMES[kind], d) for kind, d in heads.items()]
  if config.fr_spec:  # the same heads drafting among the K most frequent ids
    ids = pretrained.frequent_token_ids(config.fr_spec)
    drafters += [
      (f"{HEAD_NAMES[kind]}, K={config.fr_spec}", d.with_vocab_subset(ids))
      for kind, d in heads.items()
    ]
  if config.cross_tokenizer:  # SLEM is a host loop, not a drafter: marked by its name
    cross, cross_tokenizer = pretrained.load_cross_draft()
    target_tokenizer = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
    drafters.append((TLI, CrossTokenizerDrafter(cross, cross_tokenizer, target_tokenizer)))
    drafters.append((SLEM, (cross, cross_tokenizer, target_tokenizer)))
  out = [(name, d, v, config.gamma, None) for name, d in drafters for v in verifiers]
  default = verifiers[0]
  for kind in heads:  # the heads' own draft lengths, e.g. early exit pays off at small gamma
    twins = [(n, d) for n, d in drafters if n.startswith(HEAD_NAMES[kind])]
    out += [
      (name, d, default, g, None)
      for g in config.head_gammas.get(kind, ())
      if g != config.gamma
      for name, d in twins
    ]
  out += [("draft model", draft, default, g, None) for g in config.gamma_sweep if g != config.gamma]
  out += [("draft model", draft, default, config.gamma_max, a) for a in config.adaptive]
  tree_drafters = {"draft model": draft, **{HEAD_NAMES[k]: d for k, d in heads.items()}}
  names = ("draft model", *HEAD_NAMES.values())
  for name, rates in config.trees.rank_acceptance.items():
    if name not in names:
      raise ValueError(f"config.trees.rank_acceptance keys must be among {names}, got {name!r}.")
    if name not in tree_drafters:  # a head config.heads leaves out
      continue
    drafter = tree_drafters[name]
    max_depth = config.trees.max_depth or config.gamma
    if name == HEAD_NAMES["medusa"]:
      max_depth = min(max_depth, drafter.heads.cfg.num_heads)
    for size in config.trees.sizes:
      tree = trees.best(rates, size, max_depth)
      label = f"{name}, tree N={size} depth {max(trees.tree_depths(tree))}"
      if name == "draft model":
        tree_drafter = TreeDrafter(draft, tree, tree_mode=config.trees.mode)
      else:
        tree_drafter = drafter.replace(tree=tree, tree_mode=config.trees.mode)
      out.append((label, tree_drafter, "tree", size, None))
  if "eagle" in heads:  # EAGLE-2: a tree per row, chosen by the head's confidence
    for size, depth, branch, expand in config.trees.eagle2:
      spec = trees.DynamicTree(size, depth, branch, expand)
      label = f"EAGLE-2, N={size} depth {depth} k={branch} m={expand}"
      drafter = heads["eagle"].replace(tree=spec, tree_mode=config.trees.mode)
      out.append((label, drafter, "tree", size, None))
  return out


def _costs(config, target, drafters, prompt, sampling) -> dict:
  """(name, gamma) -> (c, verify cost): drafting one token and scoring gamma + 1
  tokens, each over one target step, measured on `prompt` (batch 1); also
  "step_s" (one target step) and "verify" ({gamma: verify cost})."""
  capacity = cache_capacity(prompt[0].shape[1], config.max_new_tokens, config.gamma_max)
  call = functools.partial(
    benchmarking.call_seconds, target, *prompt, capacity=capacity, num_runs=config.num_runs
  )
  step_s = call(tokens_per_call=1)
  gammas = {g for _, g in drafters} | {config.gamma}
  verify = {g: call(tokens_per_call=g + 1) / step_s for g in gammas}
  out = {"step_s": step_s, "verify": verify}
  for (name, gamma), drafter in drafters.items():
    drafting_s = benchmarking.drafting_seconds(
      target,
      drafter,
      *prompt,
      gamma=gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      num_runs=config.num_runs,
    )
    out[(name, gamma)] = (drafting_s / gamma / step_s, verify[gamma])
  return out


def run(config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """Times every variant of `config` on the bundled pair; one JSON-ready row each."""
  for name in ("gamma", "max_new_tokens", "num_prompts", "gamma_max"):
    check_positive_int(f"config.{name}", config[name])
  unknown_heads = set(config.heads) - set(HEAD_DRAFTERS)
  if unknown_heads:
    raise ValueError(
      f"config.heads must be a subset of {tuple(HEAD_DRAFTERS)}, got {config.heads!r}."
    )
  unknown_heads = set(config.head_gammas) - set(HEAD_DRAFTERS)
  if unknown_heads:
    raise ValueError(
      f"config.head_gammas keys must be among {tuple(HEAD_DRAFTERS)}, got {sorted(unknown_heads)}."
    )
  for kind, gammas in config.head_gammas.items():
    for g in gammas:
      check_positive_int(f"config.head_gammas.{kind}", g)
  unknown = set(config.verifiers) - {"greedy", "token", "block"}
  if unknown or not config.verifiers:
    raise ValueError(
      f"config.verifiers must be a non-empty subset of (greedy, token, block), "
      f"got {tuple(config.verifiers)!r}."
    )
  check_positive_int("config.num_runs", config.num_runs, 3)
  if set(config.adaptive) - {"schedule", "confidence"}:
    raise ValueError(
      f"config.adaptive must be a subset of (schedule, confidence), got {config.adaptive!r}."
    )
  if config.trees.mode not in ("without_replacement", "iid"):
    raise ValueError(
      f"config.trees.mode must be 'without_replacement' or 'iid', got {config.trees.mode!r}."
    )
  for size in config.trees.sizes:
    check_positive_int("config.trees.sizes", size)
  if not isinstance(config.trees.max_depth, int) or config.trees.max_depth < 0:
    raise ValueError(
      f"config.trees.max_depth must be an int >= 0 (0: config.gamma), "
      f"got {config.trees.max_depth!r}."
    )
  target, draft, tokenizer = pretrained.load_pair()
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(config.num_prompts))

  def one(i):  # prompt i alone: every variant decodes batch 1
    return prompts[i : i + 1], lengths[i : i + 1]

  def tokens(outs):
    return sum(int(np.asarray(o.num_generated).sum()) for o in outs)

  rows = []
  for temperature in config.temperatures:
    sampling = specjax.SamplingParams(temperature=float(temperature))
    key = jax.random.key(config.seed)
    calls = {
      "ar": lambda sampling=sampling, key=key: [
        specjax.autoregressive_generate(
          target, *one(i), max_new_tokens=config.max_new_tokens, sampling=sampling, key=key
        )
        for i in range(len(lengths))
      ]
    }
    meta = {}
    drafters = {}
    for name, drafter, verifier, gamma, adaptive in _variants(config, target, draft, temperature):
      label = f"{name}|{verifier}|{gamma}|{adaptive}"
      meta[label] = dict(drafter=name, verifier=verifier, gamma=gamma, adaptive=adaptive or "fixed")
      if name == SLEM:
        calls[label] = lambda d=drafter, v=verifier, g=gamma, s=sampling, k=key: [
          specjax.string_level_generate(
            target,
            d[0],
            *d[1:],
            *one(i),
            gamma=g,
            max_new_tokens=config.max_new_tokens,
            sampling=s,
            key=k,
            verifier="auto" if v == "greedy" else v,
          )
          for i in range(len(lengths))
        ]
        continue
      drafters[(name, gamma)] = drafter
      calls[label] = lambda d=drafter, v=verifier, g=gamma, a=adaptive, s=sampling, k=key: [
        specjax.speculative_generate(
          target,
          d,
          *one(i),
          gamma=g,
          max_new_tokens=config.max_new_tokens,
          sampling=s,
          key=k,
          verifier="auto" if v == "tree" else v,
          adaptive=a,
          confidence_threshold=config.confidence_threshold,
        )
        for i in range(len(lengths))
      ]
    timings, outputs = benchmarking.time_calls(calls, config.num_runs)
    ar_ms = timings["ar"].median_s * 1e3 / tokens(outputs["ar"])
    costs = _costs(config, target, drafters, one(0), sampling)
    for label, fields in meta.items():
      outs = outputs[label]

      def s(field, outs=outs):
        return sum(float(np.asarray(getattr(o.stats, field)).sum()) for o in outs)

      ms = timings[label].median_s * 1e3 / tokens(outs)
      alpha = s("accepted") / max(s("evaluated"), 1)
      per_iteration = s("generated") / max(s("row_iterations"), 1)
      extra = {}
      if fields["drafter"] == SLEM:
        # c from the loop's own draft timings; the host's re-tokenisation is not in
        # the prediction, it is the gap between predicted and measured.
        draft_s = sum(o.timings["draft_seconds"] for o in outs)
        iterations = sum(o.timings["iterations"] for o in outs)
        c = draft_s / max(s("draft_calls"), 1) / costs["step_s"]
        verify_cost = costs["verify"][fields["gamma"]]
        predicted = per_iteration / (c * s("draft_calls") / max(iterations, 1) + verify_cost)
        extra["host_ms_per_iteration"] = (
          1e3 * sum(o.timings["host_seconds"] for o in outs) / max(iterations, 1)
        )
      elif fields["verifier"] == "tree":
        c, verify_cost = costs[(fields["drafter"], fields["gamma"])]
        # No closed form for a tree's accepted length: the measured tokens per
        # iteration over the iteration's cost, in target steps.
        predicted = per_iteration / (c * fields["gamma"] + verify_cost)
      else:
        c, verify_cost = costs[(fields["drafter"], fields["gamma"])]
        predicted = theory.predicted_speedup(min(alpha, 1.0), fields["gamma"], c, verify_cost)
      rows.append(
        {
          "temperature": float(temperature),
          **fields,
          "acceptance_rate": alpha,
          "c": c,
          "verify_cost": verify_cost,
          "predicted_speedup": predicted,
          "tokens_per_iteration": per_iteration,
          "proposed_per_iteration": s("proposed") / max(s("row_iterations"), 1),
          "ms_per_token": ms,
          "ar_ms_per_token": ar_ms,
          "speedup": ar_ms / ms,
          **extra,
        }
      )
  return rows


def markdown(rows: list[dict[str, Any]]) -> str:
  """The rows as the README's markdown table."""
  return common.markdown_table(rows, COLUMNS)


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  output_md = check_output_path("--output_md", flags.FLAGS.output_md)
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the output
  rows = run(flags.FLAGS.config)
  result = {"rows": rows, **benchmarking.environment_info()}
  print(json.dumps(result, indent=2))
  table = markdown(rows)
  print(table)
  common.write_json(output_json, result)
  common.write_text(output_md, table)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag(
    "Comparison configuration (configs/compare_drafters.py).", "compare_drafters.py"
  )
  common.define_output_flags(markdown=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)

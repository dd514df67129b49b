"""The drafter x verifier comparison on the bundled pair: what
`experiments/compare_drafters.py` runs (`run`).

For each temperature: autoregressive decoding (the baseline), every drafter x
every verifier that applies at gamma = config.gamma, the draft model at each
gamma of `gamma_sweep` and adaptively, then token trees (`config.trees`,
`specjax.trees.best`). Each variant decodes held-out prompts (or every prompt of
`config.prompt_file`, each row then adding `per_category`) at batch 1; times
are medians of `num_runs` runs, each paired with a baseline run. Each variant's
programs are freed before the next (the baseline is compiled ahead once per
temperature). `run` returns one JSON-ready row per variant; `COLUMNS` is the
README's table. The results: docs/drafters.md.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

import specjax
from specjax import bench, dtypes, pretrained, trees
from specjax import heads as head_kinds
from specjax.bench import gamma_choice
from specjax.data import Tokenizer
from specjax.data.prompts import by_category, encode_prompts, held_out_prompts, read_prompt_file
from specjax.drafting import CrossTokenizerDrafter, TreeDrafter, as_drafter
from specjax.jobs.drafters import build_drafter
from specjax.models.kv_cache import cache_capacity
from specjax.results import markdown_table
from specjax.validation import check_loop, check_positive_int

# The README's table: one line per variant.
COLUMNS = (
  ("T", "{temperature:g}"),
  ("drafter", "{drafter}"),
  ("verifier", "{verifier}"),
  ("γ", "{gamma}"),
  ("draft length", "{adaptive}"),
  ("α", "{acceptance_rate:.3f}"),
  ("tokens/iter", "{tokens_per_iteration:.2f}"),
  ("verified/iter", "{proposed_per_iteration:.2f}"),
  ("draft calls/iter", "{draft_calls_per_iteration:.2f}"),
  ("c", "{c:.3f}"),
  ("predicted", "{predicted_speedup:.2f}"),
  ("ms/token", "{ms_per_token:.3f}"),
  ("speedup", "{speedup:.2f}"),
)
# With config.prompt_file: one line per variant and category.
CATEGORY_COLUMNS = (
  ("T", "{temperature:g}"),
  ("drafter", "{drafter}"),
  ("verifier", "{verifier}"),
  ("γ", "{gamma}"),
  ("draft length", "{adaptive}"),
  ("category", "{category}"),
  ("prompts", "{prompts}"),
  ("α", "{acceptance_rate:.3f}"),
  ("tokens/iter", "{tokens_per_iteration:.2f}"),
  ("ms/token", "{ms_per_token:.3f}"),
  ("speedup", "{speedup:.2f}"),
)


def _title(kind: str) -> str:
  """How the table names the bundled head of `kind`."""
  return head_kinds.kind(kind).title


# Rows of the bundled draft with its own tokenizer (pretrained.load_cross_draft).
TLI, SLEM = "cross-tokenizer draft, TLI", "cross-tokenizer draft, SLEM"


class Variant(NamedTuple):
  """One row of the comparison.

  Attributes:
    name: the drafter's label in the table.
    drafter: what `speculative_generate` takes; for SLEM the tuple (cross
      draft, its tokenizer, the target's tokenizer).
    verifier: "greedy", "token", "block", or "tree".
    gamma: drafted tokens per iteration (a tree's nodes).
    adaptive: None, "schedule" or "confidence".
  """

  temperature: float
  name: str
  drafter: Any
  verifier: str
  gamma: int
  adaptive: str | None = None

  @property
  def label(self) -> str:
    gamma = self.gamma or "measured"  # 0: measured at start-up (`_choose_gamma`)
    return f"T={self.temperature:g} {self.name} | {self.verifier} | γ={gamma} | " + (
      self.adaptive or "fixed"
    )


def variants(config, target, draft, temperature: float) -> list[Variant]:
  """The variants of `config` at one temperature, in the table's order.

  Args:
    target, draft: the pair's `Transformer`s.
    temperature: greedy verification only at 0.
  """
  applicable = ("greedy", "token", "block") if temperature == 0 else ("token", "block")
  verifiers = [v for v in applicable if v in config.verifiers]
  head_dtype = dtypes.to_dtype(config.draft_dtype or config.dtype, "config.draft_dtype")
  heads = {kind: build_drafter(kind, target, dtype=head_dtype) for kind in config.heads}
  drafters = _chain_drafters(config, target, draft, heads)
  out = [(name, d, v, config.gamma, None) for name, d in drafters for v in verifiers]
  default = verifiers[0]
  for kind in heads:  # the heads' own draft lengths, e.g. early exit pays off at small gamma
    twins = [(n, d) for n, d in drafters if n.startswith(_title(kind))]
    out += [
      (name, d, default, g, None)
      for g in config.head_gammas.get(kind, ())
      if g != config.gamma
      for name, d in twins
    ]
  for label, path in head_dirs(config):  # heads of your own, by label
    own = build_drafter("model", target, head=path, dtype=head_dtype, flag="config.head_dirs")
    out.append((label, own, default, config.gamma, None))
  out += [("draft model", draft, default, g, None) for g in config.gamma_sweep if g != config.gamma]
  out += [("draft model", draft, default, config.gamma_max, a) for a in config.adaptive]
  out += _tree_variants(config, draft, heads)
  return [Variant(float(temperature), *fields) for fields in out]


def _chain_drafters(config, target, draft, heads: dict[str, Any]) -> list[tuple[str, Any]]:
  """(label, drafter) of every chain drafter of `config`, in the table's order."""

  drafters = [("draft model", draft)]
  if config.ngram:
    lookup = build_drafter("ngram", target, ngram=config.ngram)
    drafters.append((f"prompt lookup (n<={config.ngram})", lookup))
  drafters += [
    (f"layer skip k={k}", build_drafter("layer_skip", target, layer_skip=k))
    for k in config.layer_skip
  ]
  drafters += [(_title(kind), d) for kind, d in heads.items()]
  if config.fr_spec:  # the same heads drafting among the K most frequent ids
    ids = pretrained.frequent_token_ids(config.fr_spec)
    drafters += [
      (f"{_title(kind)}, K={config.fr_spec}", d.with_vocab_subset(ids)) for kind, d in heads.items()
    ]
  if config.cross_tokenizer:  # SLEM is a host loop, not a drafter: marked by its name
    cross, cross_tokenizer = pretrained.load_cross_draft()
    target_tokenizer = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
    drafters.append((TLI, CrossTokenizerDrafter(cross, cross_tokenizer, target_tokenizer)))
    drafters.append((SLEM, (cross, cross_tokenizer, target_tokenizer)))
  return drafters


def _tree_variants(config, draft, heads: dict[str, Any]) -> list[tuple]:
  """The token-tree variants' fields: static trees (`config.trees`), then EAGLE-2's."""

  tree_drafters = {"draft model": draft, **{_title(k): d for k, d in heads.items()}}
  names = ("draft model", *(_title(k) for k in head_kinds.bundled()))
  out = []
  for name, rates in config.trees.rank_acceptance.items():
    if name not in names:
      raise ValueError(f"config.trees.rank_acceptance keys must be among {names}, got {name!r}.")
    if name not in tree_drafters:  # a head config.heads leaves out
      continue
    drafter = tree_drafters[name]
    if name != "draft model" and not as_drafter(drafter).takes_tree:
      raise ValueError(f"config.trees.rank_acceptance: the {name} draft no token trees.")
    max_depth = config.trees.max_depth or config.gamma
    # Drafters whose one call gives a fixed number of per-depth laws (Medusa's
    # heads, the block drafter's positions) draft trees no deeper than that.
    bound = as_drafter(drafter).max_tree_depth
    max_depth = max_depth if bound is None else min(max_depth, bound)
    for size in config.trees.sizes:
      tree = trees.best(rates, size, max_depth)
      label = f"{name}, tree N={size} depth {max(trees.tree_depths(tree))}"
      if name == "draft model":
        tree_drafter = TreeDrafter(draft, tree, tree_mode=config.trees.mode)
      else:
        tree_drafter = drafter.replace(tree=tree, tree_mode=config.trees.mode)
      out.append((label, tree_drafter, "tree", size, None))
  for kind, head in heads.items():  # dynamic trees: a tree per row (EAGLE-2's)
    title = head_kinds.kind(kind).dynamic_trees
    for size, depth, branch, expand in config.trees.eagle2 if title else ():
      spec = trees.DynamicTree(size, depth, branch, expand)
      label = f"{title}, N={size} depth {depth} k={branch} m={expand}"
      drafter = head.replace(tree=spec, tree_mode=config.trees.mode)
      out.append((label, drafter, "tree", size, None))
  return out


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the first invalid field of `config`."""
  if config.scale and config.scale not in pretrained.SCALES:
    raise ValueError(
      f"config.scale must be '' (the bundled pair as trained) or one of "
      f"{', '.join(pretrained.SCALES)}; got {config.scale!r}."
    )
  dtypes.to_dtype(config.dtype, "config.dtype")
  if config.draft_dtype:
    dtypes.to_dtype(config.draft_dtype, "config.draft_dtype")
  for name in ("gamma", "max_new_tokens", "num_prompts", "gamma_max"):
    check_positive_int(f"config.{name}", config[name])
  bundled = head_kinds.bundled()
  if set(config.heads) - set(bundled):
    raise ValueError(f"config.heads must be a subset of {bundled}, got {config.heads!r}.")
  unknown_heads = set(config.head_gammas) - set(bundled)
  if unknown_heads:
    raise ValueError(
      f"config.head_gammas keys must be among {bundled}, got {sorted(unknown_heads)}."
    )
  head_dirs(config)
  for kind, gammas in config.head_gammas.items():
    for g in gammas:
      if g == 0 and kind in config.heads and not _is_block(kind):
        raise ValueError(
          f"config.head_gammas.{kind} may hold 0 (measured at start-up) only for a block "
          f"drafter, got {tuple(gammas)!r}."
        )
      if g != 0:
        check_positive_int(f"config.head_gammas.{kind}", g)
  unknown = set(config.verifiers) - {"greedy", "token", "block"}
  if unknown or not config.verifiers:
    raise ValueError(
      f"config.verifiers must be a non-empty subset of (greedy, token, block), "
      f"got {tuple(config.verifiers)!r}."
    )
  check_positive_int("config.num_runs", config.num_runs, 3)
  check_loop(config.loop, config.loop_chunk, "config.")
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
  if config.prompt_file:  # read here, before any model loads
    read_prompt_file(config.prompt_file, "config.prompt_file")


def _target_costs(config, target, prompt, gammas) -> tuple[float, dict[int, float]]:
  """(one target step, {gamma: scoring gamma + 1 tokens}) in seconds, measured on
  `prompt` (batch 1)."""
  capacity = cache_capacity(prompt[0].shape[1], config.max_new_tokens, config.gamma_max)
  call = functools.partial(
    bench.call_seconds, target, *prompt, capacity=capacity, num_runs=config.num_runs
  )
  return call(tokens_per_call=1), {g: call(tokens_per_call=g + 1) for g in sorted(gammas)}


def _generate(config, target, variant: Variant, prompts: list, key) -> Callable[[], list]:
  """The variant's decoding of each of `prompts` (`(tokens [1, P], lengths [1])`)."""
  v, sampling = variant, specjax.SamplingParams(temperature=variant.temperature)
  if v.name == SLEM:
    return lambda: [
      specjax.string_level_generate(
        target,
        v.drafter[0],
        *v.drafter[1:],
        *prompt,
        gamma=v.gamma,
        max_new_tokens=config.max_new_tokens,
        sampling=sampling,
        key=key,
        verifier="auto" if v.verifier == "greedy" else v.verifier,
      )
      for prompt in prompts
    ]
  return lambda: [
    specjax.speculative_generate(
      target,
      v.drafter,
      *prompt,
      gamma=v.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      key=key,
      verifier="auto" if v.verifier == "tree" else v.verifier,
      adaptive=v.adaptive,
      confidence_threshold=config.confidence_threshold,
      loop=config.loop,
      loop_chunk=config.loop_chunk,
    )
    for prompt in prompts
  ]


def _conditional(outs) -> list[float]:
  """Per draft position i: the rows' iterations that accepted position i over those
  that accepted i - 1 (position 0: over the iterations that proposed it)."""
  at = sum(np.asarray(o.stats.accepted_at_position, np.float64) for o in outs)
  first = sum(float(np.asarray(o.stats.row_iterations).sum()) for o in outs)
  before = np.concatenate([[first], at[:-1]])
  return [round(float(a / b), 4) if b else None for a, b in zip(at, before)]


def _tokens(outs) -> int:
  return sum(int(np.asarray(o.num_generated).sum()) for o in outs)


def _category_rows(timings, outputs, groups: dict[str, list]) -> dict[str, dict[str, Any]]:
  """category -> its prompts' figures: α, tokens per iteration, ms/token both ways
  and speedup, from the calls `ar/<category>` and `variant/<category>`."""

  def s(outs, field):
    return sum(float(np.asarray(getattr(o.stats, field)).sum()) for o in outs)

  out = {}
  for category, prompts in groups.items():
    ar, outs = outputs[f"ar/{category}"], outputs[f"variant/{category}"]
    ar_ms = timings[f"ar/{category}"].median_s * 1e3 / _tokens(ar)
    ms = timings[f"variant/{category}"].median_s * 1e3 / _tokens(outs)
    out[category] = {
      "prompts": len(prompts),
      "acceptance_rate": s(outs, "accepted") / max(s(outs, "evaluated"), 1),
      "tokens_per_iteration": s(outs, "generated") / max(s(outs, "row_iterations"), 1),
      "ms_per_token": ms,
      "ar_ms_per_token": ar_ms,
      "speedup": ar_ms / ms,
    }
  return out


def _pooled(timings, outputs, groups: dict[str, list]):
  """(timings, outputs) of "ar" and "variant" over every category: each timed
  round's times summed over the categories (the rounds interleave them), the
  outputs in category order."""
  pooled_timings, pooled_outputs = {}, {}
  for name in ("ar", "variant"):
    parts = [timings[f"{name}/{c}"] for c in groups]
    pooled_timings[name] = bench.Timing(
      first_s=sum(t.first_s for t in parts),
      runs_s=tuple(map(sum, zip(*(t.runs_s for t in parts)))),
    )
    pooled_outputs[name] = [o for c in groups for o in outputs[f"{name}/{c}"]]
  return pooled_timings, pooled_outputs


def _row(v: Variant, timings, outputs, step_s: float, verify_s: dict, drafting_s) -> dict:
  """The variant's JSON row from its paired timings and outputs; `drafting_s` is
  its drafter's seconds per iteration (None for SLEM, whose own timings give it)."""
  outs = outputs["variant"]

  def s(field):
    return sum(float(np.asarray(getattr(o.stats, field)).sum()) for o in outs)

  ar_ms = timings["ar"].median_s * 1e3 / _tokens(outputs["ar"])
  ms = timings["variant"].median_s * 1e3 / _tokens(outs)
  alpha = s("accepted") / max(s("evaluated"), 1)
  per_iteration = s("generated") / max(s("row_iterations"), 1)
  # Model calls of the drafter per iteration, its prefill's left out (SLEM: a host
  # loop whose stats count its own calls).
  prefill = 0 if v.name == SLEM else len(outs) * as_drafter(v.drafter).prefill_calls
  calls_per_iteration = (s("draft_calls") - prefill) / max(s("iterations"), 1)
  costs = dict(gamma=v.gamma, target_step_s=step_s, verify_s=verify_s[v.gamma])
  extra = {}
  if v.name == SLEM:
    # c per draft call, from the loop's own draft timings; the host's
    # re-tokenisation is not in the prediction, it is the gap between predicted
    # and measured.
    iterations = max(sum(o.timings["iterations"] for o in outs), 1)
    prediction = bench.predict_speedup(
      **costs,
      drafting_s=sum(o.timings["draft_seconds"] for o in outs) / iterations,
      tokens_per_iteration=per_iteration,
      draft_steps=max(s("draft_calls"), 1) / iterations,
    )
    extra["host_ms_per_iteration"] = 1e3 * sum(o.timings["host_seconds"] for o in outs) / iterations
  elif v.verifier == "tree":
    # No closed form for a tree's accepted length: the measured tokens per
    # iteration over the iteration's cost, in target steps.
    prediction = bench.predict_speedup(
      **costs, drafting_s=drafting_s, tokens_per_iteration=per_iteration
    )
  else:
    prediction = bench.predict_speedup(**costs, drafting_s=drafting_s, alpha=alpha)
  return {
    "temperature": v.temperature,
    "drafter": v.name,
    "verifier": v.verifier,
    "gamma": v.gamma,
    "adaptive": v.adaptive or "fixed",
    "acceptance_rate": alpha,
    **prediction,  # c, verify_cost, predicted_speedup
    "tokens_per_iteration": per_iteration,
    # Drafted tokens (a tree: nodes) scored per row and iteration: the target's rows
    # beyond s[-1].
    "proposed_per_iteration": s("proposed") / max(s("row_iterations"), 1),
    # A chain's acceptance at position i given positions < i were accepted.
    "conditional_acceptance": _conditional(outs) if v.verifier != "tree" else None,
    "draft_calls_per_iteration": calls_per_iteration,
    "ms_per_token": ms,
    "ar_ms_per_token": ar_ms,
    "speedup": ar_ms / ms,
    **extra,
  }


def sweep(
  config: ml_collections.ConfigDict,
  target,
  plan: Sequence[Variant],
  prompts,
  lengths,
  *,
  progress: Callable[[str], None] | None = None,
  categories: Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
  """Times each variant of `plan` in turn (batch 1, a warm-up, then
  `config.num_runs` runs paired with the baseline's), freeing its compiled
  programs before the next. Drafting costs are measured once per (drafter,
  gamma) and temperature.

  Args:
    plan: the variants, e.g. `variants(...)` at each temperature.
    prompts: `[N, P]` int32 prompts; lengths `[N]`.
    progress: a `print`-like function, called with a variant's label as it
      starts (end=" ") and with the rest of its line as it ends; None: quiet.
    categories: `[N]` each prompt's category (`config.prompt_file`'s): each
      category's prompts are then timed as calls of their own (paired with the
      baseline's on the same prompts) and each row adds `per_category`
      (`_category_rows`); the row's own figures pool the categories.

  Yields:
    One JSON-ready row per variant, in `plan`'s order, its programs freed; its
    `memory_maps` the process's mappings then (`memory_maps_before`: before
    the temperature's first variant).
  """
  say = progress or (lambda *args, **kwargs: None)
  one = [(prompts[i : i + 1], lengths[i : i + 1]) for i in range(len(lengths))]
  groups = None  # category -> its prompts, in order of first appearance
  if categories is not None:
    groups = {c: [one[i] for i in rows] for c, rows in by_category(categories).items()}
  clock = _Progress(say, len(plan))
  gammas = {g for v in plan for g in (_candidates(v) if v.gamma == 0 else (v.gamma,))}
  say(f"target costs: one step and scoring γ+1 tokens for γ in {sorted(gammas)}")
  step_s, verify_s = _target_costs(config, target, one[0], gammas)
  bench.free_compiled_programs()
  for temperature in dict.fromkeys(v.temperature for v in plan):
    sampling = specjax.SamplingParams(temperature=temperature)
    key = jax.random.key(config.seed)
    ar = _baseline(config, target, one, sampling, key)
    # With the baseline compiled, before the temperature's variants: each
    # variant's count comes back near it once the variant is freed.
    maps_before = bench.memory_map_count()
    if maps_before is not None:
      say(f"T={temperature:g}: {maps_before} memory maps (vm.max_map_count: 65530 by default)")
    drafting_s = {}  # (name, gamma) -> seconds per iteration at this temperature
    for v in [v for v in plan if v.temperature == temperature]:
      clock.start(v)
      measured = v.gamma == 0  # a block drafter's gamma, measured here as decode does
      if measured:
        choice = _choose_gamma(config, target, v, one, ar, key)
        v = v._replace(gamma=choice.gamma)
      if groups is None:
        calls = {"ar": functools.partial(ar, one)}
        calls["variant"] = _generate(config, target, v, one, key)
      else:
        calls = {}
        for c, group in groups.items():
          calls[f"ar/{c}"] = functools.partial(ar, group)
          calls[f"variant/{c}"] = _generate(config, target, v, group, key)
      timings, outputs = bench.time_calls(calls, config.num_runs)
      per_category = None
      if groups is not None:
        per_category = _category_rows(timings, outputs, groups)
        timings, outputs = _pooled(timings, outputs, groups)
      if v.name != SLEM and (v.name, v.gamma) not in drafting_s:
        drafting_s[v.name, v.gamma] = _drafting_seconds(config, target, v, one[0], sampling)
      row = _row(v, timings, outputs, step_s, verify_s, drafting_s.get((v.name, v.gamma)))
      if per_category is not None:
        row["per_category"] = per_category
      if measured:
        row.update(gamma_policy="measured at start-up", **choice.report())
      # The loops both ways (string-level exact match: its baseline's; its own is a host loop).
      row["loop"] = config.loop
      row["loop_chunk"] = config.loop_chunk if config.loop == "chunked" else None
      del calls, timings, outputs
      bench.free_compiled_programs()
      # Lines of /proc/self/maps once the variant is freed (None off Linux).
      row["memory_maps"] = bench.memory_map_count()
      row["memory_maps_before"] = maps_before
      clock.done(row)
      yield row
    del ar
    bench.free_compiled_programs()


def head_dirs(config) -> list[tuple[str, str]]:
  """`config.head_dirs`' (label, directory) pairs, from its "label=DIR" strings;
  ValueError naming the field for one that is not "label=" an existing directory."""
  out = []
  for entry in config.get("head_dirs", ()):
    label, _, path = str(entry).partition("=")
    if not label or not os.path.isdir(path):
      raise ValueError(
        "config.head_dirs must be 'label=DIR' strings, DIR a head's directory (a training "
        f"run or an export), got {entry!r}."
      )
    out.append((label, path))
  return out


def _is_block(kind: str) -> bool:
  """Whether head kind `kind` drafts a block per call (a gamma of 0 is measured)."""
  return issubclass(head_kinds.kind(kind).drafter, head_kinds.dflash.DFlashDrafter)


def _candidates(v: Variant) -> tuple[int, ...]:
  """The gammas a measured row tries: its block drafter's (`gamma_choice`)."""
  return gamma_choice.candidate_gammas(as_drafter(v.drafter).block_size - 1)


def _choose_gamma(config, target, v: Variant, one: list, ar, key) -> gamma_choice.GammaChoice:
  """A gamma-0 row's gamma, measured on the first prompt as `jobs.decode` measures it
  (`specjax.bench.gamma_choice`): the fastest candidate against plain decoding."""

  def spec(gamma: int):
    call = _generate(config, target, v._replace(gamma=gamma), one[:1], key)
    return lambda: call()[0]

  return gamma_choice.choose_gamma(spec, lambda: ar(one[:1])[0], _candidates(v))


def _baseline(config, target, prompts: list, sampling, key) -> Callable[[list], list]:
  """Autoregressive decoding of each of the prompts it is given (`(tokens [1, P],
  lengths [1])`, of `prompts`' width), compiled ahead (`bench.compile_ahead`) on
  `prompts[0]`."""

  program = bench.compile_ahead(
    functools.partial(
      specjax.autoregressive_generate,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      loop=config.loop,
      loop_chunk=config.loop_chunk,
    ),
    target,
    *prompts[0],
    key=key,
  )
  return lambda some: [program(target, *prompt, key=key) for prompt in some]


def _drafting_seconds(config, target, v: Variant, prompt, sampling) -> float:
  """`bench.drafting_seconds` of variant `v`'s drafter on `prompt` (batch 1)."""
  return bench.drafting_seconds(
    target,
    v.drafter,
    *prompt,
    gamma=v.gamma,
    max_new_tokens=config.max_new_tokens,
    sampling=sampling,
    num_runs=config.num_runs,
  )


class _Progress:
  """`sweep`'s progress lines: a variant's label as it starts, its figures as it ends."""

  def __init__(self, say: Callable[..., None], total: int):
    self.say, self.total, self.count = say, total, 0
    self.began = self.first = time.perf_counter()

  def start(self, v: Variant) -> None:
    self.count += 1
    self.began = time.perf_counter()
    self.say(f"[{self.count:{len(str(self.total))}d}/{self.total}] {v.label} ...", end=" ")

  def done(self, row: dict[str, Any]) -> None:
    now = time.perf_counter()
    maps = "" if row["memory_maps"] is None else f", {row['memory_maps']} memory maps"
    self.say(
      f"{now - self.began:.1f} s, α {row['acceptance_rate']:.3f}, "
      f"{row['ms_per_token']:.3f} ms/token, speedup {row['speedup']:.2f}{maps} "
      f"({now - self.first:.0f} s in all)"
    )


def run(config: ml_collections.ConfigDict, *, progress: bool = False) -> list[dict[str, Any]]:
  """Times every variant of `config` on the bundled pair; one JSON-ready row each.

  `progress`: a line on stderr per variant.
  """

  check_config(config)
  draft_dtype = dtypes.to_dtype(config.draft_dtype or config.dtype, "config.draft_dtype")
  target, draft, tokenizer = pretrained.load_pair(
    dtypes.to_dtype(config.dtype, "config.dtype"),
    scale=config.scale or None,
    draft_dtype=draft_dtype,
  )
  categories = None
  if config.prompt_file:
    file_prompts = read_prompt_file(config.prompt_file, "config.prompt_file")
    texts, categories = [p.text for p in file_prompts], [p.category for p in file_prompts]
    prompts, lengths = encode_prompts(tokenizer, texts, name="config.prompt_file")
  else:
    prompts, lengths = encode_prompts(tokenizer, held_out_prompts(config.num_prompts))
  plan = [v for t in config.temperatures for v in variants(config, target, draft, float(t))]
  say = functools.partial(print, file=sys.stderr, flush=True) if progress else None
  if say:
    grown = f" grown to {config.scale}" if config.scale else ""
    say(
      f"{len(plan)} variants on the bundled pair{grown} ({config.dtype}), "
      f"each {len(lengths)} prompts x "
      f"{config.max_new_tokens} tokens, batch 1, {config.num_runs} timed runs"
    )
  return list(sweep(config, target, plan, prompts, lengths, progress=say, categories=categories))


def markdown(rows: list[dict]) -> str:
  """The rows as the README's markdown table; with `per_category` (a prompt
  file), a second table below it: one line per variant and category."""
  table = markdown_table(rows, COLUMNS)
  lines = [
    {**row, **figures, "category": category}
    for row in rows
    for category, figures in row.get("per_category", {}).items()
  ]
  return table + ("\n\n" + markdown_table(lines, CATEGORY_COLUMNS) if lines else "")

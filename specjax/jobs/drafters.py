"""The drafter a job's config names, and its default draft length: one function of each
for every job (`decode`, `serve`, `compare_drafters`, the reproduction).

  drafter = build_drafter("eagle", target)                     # the bundled EAGLE head
  drafter = build_drafter("eagle", target, head="runs/eagle")  # a trained or hub head
  gamma = resolve_gamma(0, drafter, batch_size=1)              # its default draft length

What a drafter name may be: "model" (the draft model), "ngram" (prompt lookup),
"layer_skip" (the target's first layers), or the drafter of a registered head kind
(`head_drafters()`: its `drafts_as`, e.g. "eagle", which EAGLE-3 heads draft as too).
Everything a job needs to know about the drafter it asks the drafter (`Drafter`:
`block_size`, `takes_tree`, `max_tree_depth`, `preferred_gamma`), never its class.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from specjax import heads
from specjax.drafting import as_drafter

# gamma + 1 tokens per row costs about one step while the target is memory-bound
# (batch 1), but nearly gamma + 1 steps once the batch makes it compute-bound, so
# a large batch drafts less (the measurements: docs/performance.md). Batches in
# between were not measured and keep 4. {smallest batch: gamma}.
GAMMA_BY_BATCH = {1: 4, 8: 1}
OTHER_DRAFTERS = ("model", "ngram", "layer_skip")


def head_drafters() -> tuple[str, ...]:
  """The drafter names of the registered head kinds (`HeadKind.drafts_as`), in order."""
  return tuple(dict.fromkeys(k.drafts_as for k in heads.kinds()))


def default_gamma(drafter, batch_size: int = 1) -> int:
  """The draft length a `gamma` of 0 means for `drafter` (a `Drafter` or a draft
  `Transformer`) and `batch_size` rows: `GAMMA_BY_BATCH`'s, capped by the drafter's
  `preferred_gamma`. A block drafter (`block_size` B > 0) drafts its whole block in one
  call whatever gamma is, so while scoring costs about one step (the batches of gamma
  4) it drafts all B - 1 tokens; larger batches keep their shorter gamma."""
  d = as_drafter(drafter)
  by_batch = GAMMA_BY_BATCH[max(b for b in GAMMA_BY_BATCH if b <= batch_size)]
  if d.block_size:
    most = d.block_size - 1
    return most if by_batch == GAMMA_BY_BATCH[1] else min(by_batch, most)
  return min(by_batch, d.preferred_gamma or by_batch)


def is_block(drafter) -> bool:
  """Whether `drafter` drafts a chain's block in one call (its gamma of 0 is measured
  at start-up by the launchers, `specjax.bench.gamma_choice`)."""
  d = as_drafter(drafter)
  return bool(d.block_size) and d.tree is None


def resolve_gamma(gamma: int, drafter, batch_size: int = 1, name: str = "config.gamma") -> int:
  """`gamma`, or `default_gamma` for 0; a block drafter refuses a gamma past its
  block_size - 1 (ValueError naming `name`)."""
  d = as_drafter(drafter)
  if gamma == 0:
    return default_gamma(d, batch_size)
  if d.block_size and not 1 <= gamma <= d.block_size - 1:
    most = d.block_size - 1
    raise ValueError(
      f"{name} must be in [1, {most}] for a block drafter of block_size {d.block_size} "
      f"(one call drafts block_size - 1 tokens; 0: {most}), got {gamma}."
    )
  return gamma


def check_drafter_name(drafter: str, name: str = "config.drafter", allowed=None) -> None:
  """ValueError naming `name` unless `drafter` is a name `build_drafter` builds (or one
  of `allowed`, a job's own subset)."""
  allowed = allowed or (*OTHER_DRAFTERS, *head_drafters())
  if drafter not in allowed:
    raise ValueError(
      f"{name} must be one of {', '.join(allowed)} (EAGLE-3 heads: eagle), got {drafter!r}."
    )


def build_drafter(
  drafter: str,
  target,
  *,
  draft=None,
  head: str = "",
  own_target: str = "",
  dtype=None,
  vocab_subset: int = 0,
  ngram: int = 3,
  layer_skip: int = 2,
  flag: str = "config",
):
  """The drafter named `drafter` for `target`.

  Args:
    drafter: "model" (returns `draft`), "ngram", "layer_skip", or a head kind's
      drafter name (`head_drafters()`).
    draft: the draft model, for "model".
    head: a head's directory (a training run, an export or a hub layout, as
      `specjax.hf.load_head` reads them) of the kind `drafter` names (any kind for
      "model": the head then drafts); "" for the bundled head of that kind.
    own_target: "" for the bundled pair's target (whose heads the bundled ones read),
      else how messages name the user's target (e.g. "your own config.target"): a
      head must then come from `head`.
    dtype: the head's dtype (default float32).
    vocab_subset: K > 0: a head drafts among the bundled tokenizer's K most frequent
      ids (FR-Spec); needs the bundled target.
    ngram, layer_skip: their drafters' settings.
    flag: how messages name the config (`config`, `--config`).

  Raises:
    ValueError: naming the field that does not fit, before any model loads where
      it can.
  """
  from specjax import pretrained

  dtype = jnp.float32 if dtype is None else dtype
  if head:
    import specjax.hf

    module = specjax.hf.load_head(head, target, dtype)
    kind = heads.of(module.cfg).drafts_as
    if drafter not in ("model", kind):
      raise ValueError(f"{flag}.head holds a {kind} head; {flag}.drafter is {drafter!r}.")
    out = heads.drafter(target, module)
  elif drafter == "model":
    return draft
  elif drafter in ("ngram", "layer_skip"):
    settings = dict(max_ngram=ngram) if drafter == "ngram" else dict(num_layers=layer_skip)
    return pretrained.load_drafter(drafter, target, **settings)
  else:
    check_bundled_head(drafter, own_target, flag)
    out = pretrained.load_drafter(drafter, target, dtype=dtype)
  if vocab_subset:
    if own_target:
      raise ValueError(
        f"{flag}.vocab_subset ranks the bundled tokenizer's ids; it needs the bundled target."
      )
    out = out.with_vocab_subset(pretrained.frequent_token_ids(vocab_subset))
  return out


def check_bundled_head(drafter: str, own_target: str = "", flag: str = "config") -> None:
  """Raises unless a bundled head drafts as `drafter` for the target (before any
  model loads): the bundled heads read the bundled target (`own_target`: "", or how
  messages name the user's)."""
  from specjax import pretrained

  if own_target:
    raise ValueError(
      f"{flag}.drafter={drafter!r} with {own_target} needs {flag}.head, a head trained "
      "for that target (the bundled heads read the bundled target)."
    )
  if drafter not in heads.bundled():
    raise ValueError(
      f"{flag}.drafter={drafter!r}: no {drafter} head is bundled "
      f"({os.path.relpath(pretrained.HEADS_DIR)}); set {flag}.head to a trained one (a run, "
      "an export or a hub layout)."
    )


def head_dir(drafter: str, head: str = "") -> str:
  """Where the head `drafter` drafts with comes from: `head`, or the bundled head's
  directory."""
  from specjax import pretrained

  return head or os.path.join(pretrained.HEADS_DIR, drafter)

"""The EAGLE head (Li et al. 2024, arXiv 2401.15077), everything it is: its settings
(`EagleConfig`), its module (`EagleHead`; `HubEagleHead`, the published EAGLE-1/2
layout's), its drafter (`EagleDrafter`, which EAGLE-3's head drafts through too), the
EAGLE repository's hub layout in and out, its training objective and its record.

Drafting: a head that autoregresses over the target's features.

The head keeps its own one-layer KV cache (static capacity, per-row lengths).
Its cache slot p holds the pair (feature at position p, token p + 1), and
`next_feature` is what the head predicts for the position of s[-1].

  propose: q_1 = head_logits(next_feature); then, for i = 1..g-1, the pair
    (predicted feature, x_i) goes through the head, which predicts the next
    feature and so q_{i+1}: g - 1 one-token head calls.
  commit:  the verification call's true features F_0..F_g (at s[-1], x_1..x_g)
    and the emitted tokens e_0..e_g overwrite the drafted pairs from slot
    len(s) - 1 in one head call over g + 1 positions; a row that kept n + 1
    tokens advances by n + 1 and takes the prediction at pair n as its next
    feature. Rolling back is bookkeeping, as for every cache.

q is exactly the law each token was drawn from, so token and block
verification are exact at any temperature; at temperature 0 the draft is the
argmax and the output equals the target's greedy decoding.

With a `tree` (static, breadth-first, `specjax.trees`) the head drafts one depth
per call: each node's pair (its parent's predicted feature, its token) goes
through the head with tree attention over its own cache, which predicts the
node's feature and so its children's q (EAGLE's tree drafting with a static
topology). The commit is unchanged: it rewrites the accepted path's pairs with
the target's true features, consecutively.

With `tree=trees.DynamicTree(size, depth, branch, expand)` it drafts EAGLE-2's
dynamic trees: each depth expands the `expand` most valuable nodes with `branch`
children, and the `size` most valuable of all candidates become the row's tree
(`trees.Tree.per_row`, one per row, verified as any tree). A node's value is its
parent's plus the log of the parent's rank-th largest draft probability: the
cumulative draft log-probability at temperature 0, as in the paper, and a
quantity that does not depend on the node's own drawn token when sampling. If it
did (e.g. the drawn token's own probability), a kept node would no longer be a
draw from q, and sampled verification would be biased.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import losses, trees
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  Commit,
  ConfidenceLength,
  DraftConstraint,
  Proposal,
  VocabSubset,
  check_confidence,
  draft_loop,
  draw_chain_token,
)
from specjax.drafting.tree import (
  check_tree_gamma,
  check_tree_mode,
  children,
  depth_keys,
  draft_tree,
)
from specjax.dtypes import dtype_name
from specjax.heads import hub
from specjax.heads.base import (
  HeadConfig,
  HeadKind,
  Identity,
  LossSettings,
  TrainingRules,
  linear,
  one_layer_cache,
  own_logits,
)
from specjax.models import hub_names
from specjax.models.hub_config import llama_config
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Block, Norm, Transformer, run_blocks
from specjax.sampling import RowSampling, SamplingParams
from specjax.vocab import fit_ids


@dataclasses.dataclass(frozen=True)
class EagleConfig(HeadConfig):
  """An EAGLE head's settings (besides `HeadConfig`'s).

  `feature_layers`: EAGLE reads the residual stream after these target layer counts;
  `()` means the last layer only (EAGLE-1). Several layers fuse lower-level features
  as in EAGLE-3. `d_ff`: the MLP width of its decoder layer (0: the target's).

  Switches for the EAGLE repository's published layout (defaults: specjax's head):
    normed_features: read the target's features after its final norm and draft
      through its own lm_head with no norm (published EAGLE-1).
    embed_first: the fc reads `[embed; feature]`, not `[feature; embed]`.
    input_norm: the layer normalises its input (the EAGLE repo's does not).
  """

  kind = "eagle"

  normed_features: bool = False
  embed_first: bool = False
  input_norm: bool = True

  def check_settings(self, layers):
    self._check_bools("normed_features", "embed_first", "input_norm")
    return layers


class EagleHead(nnx.Module):
  """EAGLE's draft head: autoregression over the target's features.

  Position t reads `fc([f_t; embed(x_{t+1})])` (the embedding is the target's
  own) and one decoder layer predicts the feature f_{t+1}, which the target's
  final norm and head turn into q(x_{t+2}). f lives in the target's last-layer
  feature space (D wide): the target's own features there, or the head's
  predictions while drafting. With several `feature_layers` (EAGLE-3 fusion),
  `fuse` first maps the target's concatenated features to D.
  """

  def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, EagleConfig):
      raise ValueError(f"EagleHead needs an EagleConfig, got {type(cfg).__name__}.")
    self.cfg = cfg
    d = cfg.target.d_model
    if cfg.num_features > 1:
      self.fuse = linear(cfg.target, cfg.num_features * d, d, rngs=rngs)
    self.fc = linear(cfg.target, 2 * d, d, rngs=rngs)
    self.block = Block(cfg.block_config, rngs=rngs)
    if not cfg.input_norm:  # the EAGLE repository's layer 0 has no input_layernorm
      self.block.attn_norm = Identity()

  def feature_space(self, target_features: jax.Array) -> jax.Array:
    """The target's features `[..., F]` (from `forward_cached(return_hidden=...)`)
    as head inputs `[..., D]`: unchanged for one layer, fused for several."""
    if self.cfg.num_features > 1:
      return self.fuse(target_features)
    return target_features

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty cache of its one decoder layer."""
    return one_layer_cache(self.cfg, batch, capacity)

  def _inputs(self, target: Transformer, features: jax.Array, next_tokens: jax.Array):
    emb = target.embed(next_tokens).astype(features.dtype)
    pair = [emb, features] if self.cfg.embed_first else [features, emb]
    return self.fc(jnp.concatenate(pair, axis=-1))

  def __call__(self, target: Transformer, features: jax.Array, next_tokens: jax.Array):
    """Training form, causal over T without a cache.

    Args:
      features: `[B, T, D]` features at positions 0..T-1 (`feature_space`).
      next_tokens: `[B, T]` int32, the token at position t + 1.

    Returns:
      `[B, T, D]` predicted features at positions 1..T.
    """
    b, t = next_tokens.shape
    cache = self.init_cache(b, t)
    return self.forward_cached(target, features, next_tokens, cache)[0]

  def forward_cached(
    self,
    target: Transformer,
    features: jax.Array,
    next_tokens: jax.Array,
    cache: KVCache,
    tree: tuple[tuple[int, ...], int] | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """As `__call__`, after each row's cached prefix: `([B, T, D], cache)`; with
    `tree`, the T pairs are nodes of a token tree (`run_blocks`)."""
    x = self._inputs(target, features, next_tokens)
    x, cache, _ = run_blocks([self.block], x, cache, tree=tree)
    return x, cache


class HubEagleHead(EagleHead):
  """`EagleHead` with `normed_features` (EAGLE-1/2 as published): it reads
  `feature_norm(f)` and drafts through `lm_head` with no norm (copies of the
  target's final norm and head)."""

  def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    t = cfg.target
    self.feature_norm = Norm(t)
    self.lm_head = linear(t, t.d_model, t.vocab_size, rngs=rngs, bias=False)

  def feature_space(self, target_features: jax.Array) -> jax.Array:
    return self.feature_norm(super().feature_space(target_features))

  def logits(self, h: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """Predicted features `[..., D]` -> float32 logits `[..., V]`."""
    return own_logits(self.lm_head(h), vocab_subset)


def make_head(cfg: EagleConfig, *, rngs: nnx.Rngs) -> EagleHead:
  """A fresh EAGLE head (`HubEagleHead` with `normed_features`)."""
  return (HubEagleHead if cfg.normed_features else EagleHead)(cfg, rngs=rngs)


# -- drafting


@struct.dataclass
class EagleState:
  """The EAGLE head's cache (holds s[:-1]) and its predicted feature `[B, D]` at s[-1]."""

  cache: KVCache
  next_feature: jax.Array


class _Group(NamedTuple):
  """The candidates one depth of EAGLE-2's dynamic tree adds: `branch` children of
  each of m nodes, `[B, m * branch]` each (laws: `[B, m, V]`).

  Attributes:
    tokens: the drawn children.
    values: each child's value (its parent's plus the log of the parent's
      rank-th largest draft probability).
    parents: the parent's candidate index (-1: the root).
    law_ids: the index, among all groups' laws, of the law it was drawn from.
    beams: which of the m nodes it continues.
    laws: the m laws q (the logits at temperature 0).
    states: None, or under a constraint the state each child's path reaches.
  """

  tokens: jax.Array
  values: jax.Array
  parents: jax.Array
  law_ids: jax.Array
  beams: jax.Array
  laws: jax.Array
  states: jax.Array | None = None


def _best_tree(groups: list[_Group], spec: trees.DynamicTree, sampling) -> Proposal:
  """The proposal of each row's `spec.size` most valuable candidates, as its tree.

  A parent outranks its children and an elder sibling the younger (values never
  grow along a path or a sibling list; ties go to the lower index), so the best
  N are a tree whose parents come first.
  """
  token, value, parent, law_id = (
    jnp.concatenate([getattr(g, name) for g in groups], 1)
    for name in ("tokens", "values", "parents", "law_ids")
  )
  b = token.shape[0]
  order = jnp.argsort(-value, axis=1, stable=True)[:, : spec.size]
  rows = jnp.arange(b)[:, None]
  position = jnp.full(token.shape, -1, jnp.int32).at[rows, order].set(jnp.arange(spec.size))
  chosen_parent = jnp.take_along_axis(parent, order, 1)
  tree_parents = jnp.where(
    chosen_parent < 0, -1, jnp.take_along_axis(position, jnp.maximum(chosen_parent, 0), 1)
  )
  probs = None
  if not sampling.greedy:
    table = jnp.concatenate([g.laws for g in groups], 1)  # [B, L, V]
    probs = jnp.take_along_axis(table, jnp.take_along_axis(law_id, order, 1)[:, :, None], 1)
  return Proposal(
    jnp.take_along_axis(token, order, 1),
    probs,
    jnp.full((b,), spec.size, jnp.int32),
    jnp.int32(spec.depth),  # depth - 1 head calls, then the commit's
    trees.Tree.per_row(tree_parents.astype(jnp.int32), spec.depth),
  )


@struct.dataclass
class EagleDrafter(ConfidenceLength, VocabSubset):
  """Drafts with an `EagleHead` over the target's features (see the module docstring).

  Attributes:
    target: the target itself (its embedding, final norm and head are shared).
    head: the trained `EagleHead` (or `eagle3.Eagle3Head`) for this target's shape.
    confidence: stop drafting a row when q's top probability falls below this.
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec; `with_vocab_subset`).
    tree: None (a chain of gamma tokens), a static breadth-first token tree
      (`specjax.trees`; gamma is its number of nodes), or a
      `trees.DynamicTree` (EAGLE-2; gamma is its size).
    tree_mode: how a tree's siblings are drawn, "without_replacement" or "iid".
  """

  target: Transformer
  head: nnx.Module  # an EagleHead, or EAGLE-3's head
  confidence: float = struct.field(pytree_node=False, default=0.0)
  vocab_subset: jax.Array | None = None
  tree: tuple[int, ...] | trees.DynamicTree | None = struct.field(pytree_node=False, default=None)
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")

  prefill_calls = 1
  constrained_drafts = True
  takes_tree = True  # static trees, and EAGLE-2's dynamic ones (`trees.DynamicTree`)

  def __post_init__(self):
    self.head.cfg.check_target(self.target.cfg)
    check_confidence(self.confidence)
    check_tree_mode(self.tree_mode)
    if self.tree is not None:
      if not isinstance(self.tree, trees.DynamicTree):
        object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
      if self.confidence > 0:
        raise ValueError("confidence must be 0 with a tree (a tree is drafted whole).")

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def target_features(self) -> bool | tuple[int, ...]:
    return self.head.cfg.target_features

  def _logits(self, features: jax.Array) -> jax.Array:
    if hasattr(self.head, "logits"):  # EAGLE-3: its own head over its draft ids
      return self.head.logits(features, self.vocab_subset)
    return VocabSubset._logits(self, features)

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    if isinstance(self.tree, trees.DynamicTree):
      spec = self.tree
      if gamma != spec.size:
        raise ValueError(f"gamma must equal the dynamic tree's size, {spec.size}, got {gamma}.")
      if (spec.depth - 1) * spec.expand > gamma + 1:
        raise ValueError(
          f"DynamicTree: (depth - 1) * expand = {(spec.depth - 1) * spec.expand} drafted "
          f"pairs must fit the head cache's slack of size + 1 = {gamma + 1}."
        )
    elif self.tree is not None:
      check_tree_gamma(self.tree, gamma)
    check_capacity("eagle head", self.target.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def _pairs(
    self,
    cache: KVCache,
    features: jax.Array,
    tokens: jax.Array,
    tree: tuple[trees.Tree | tuple[int, ...], int] | None = None,
  ) -> tuple[jax.Array, KVCache]:
    return self.head.forward_cached(
      self.target, features, fit_ids(tokens, self.vocab_size), cache, tree
    )

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> EagleState:
    if hidden is None:
      raise ValueError("EagleDrafter.init needs the target's features at the prompt (hidden).")
    b, p = prompts.shape
    slots = jnp.arange(p)[None, :]
    # Pair t reads the feature at t and token t + 1 of s = prompt + first.
    shifted = jnp.pad(prompts[:, 1:], ((0, 0), (0, 1)))
    next_tokens = jnp.where(slots == (prompt_lengths - 1)[:, None], first[:, None], shifted)
    predicted, cache = self._pairs(
      self.head.init_cache(b, capacity), self.head.feature_space(hidden), next_tokens
    )
    last = jnp.take_along_axis(predicted, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return EagleState(cache.with_lengths(prompt_lengths), last)

  def propose(
    self,
    state: EagleState,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, EagleState]:
    del recent  # the head's state already continues s
    if isinstance(self.tree, trees.DynamicTree):
      return self._propose_dynamic(state, key, sampling, constraint)
    if self.tree is not None:
      return self._propose_tree(state, key, sampling, constraint)
    b, g = limit.shape[0], gamma
    greedy = sampling.greedy
    draw_token = None if greedy else chain_draws(key, g, b)

    def draw(i, feature, tokens, probs, active, rule):
      active = active & (i < limit)
      token, q, rule = draw_chain_token(i, self._logits(feature), rule, sampling, draw_token)
      if q is not None:
        probs = probs.at[:, i].set(q)
        if self.confidence > 0:
          active = active & (jnp.max(q, axis=-1) >= self.confidence)
      return token, tokens.at[:, i].set(token), probs, active, rule

    tokens = jnp.zeros((b, g), jnp.int32)
    probs = None if greedy else jnp.zeros((b, g, self.vocab_size), jnp.float32)
    token, tokens, probs, active, rule = draw(
      0, state.next_feature, tokens, probs, jnp.ones((b,), bool), constraint
    )

    def body(i, carry):
      token, (cache, feature), tokens, probs, active, lengths, rule = carry
      new_feature, cache = self._pairs(cache, feature[:, None], token[:, None])
      token, tokens, probs, active, rule = draw(i, new_feature[:, 0], tokens, probs, active, rule)
      return token, (cache, new_feature[:, 0]), tokens, probs, active, lengths + active, rule

    carry = (state.cache, state.next_feature)
    i, (_, (cache, _), tokens, probs, _, lengths, _) = draft_loop(
      body,
      (token, carry, tokens, probs, active, active.astype(jnp.int32), rule),
      1,
      g,
      lambda c: jnp.any(c[4]),
    )
    # The commit's head call is this iteration's last draft call.
    return Proposal(tokens, probs, lengths, calls=i), state.replace(cache=cache)

  def _propose_tree(
    self,
    state: EagleState,
    key: jax.Array,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ):
    features = {-1: state.next_feature}  # node -> the head's feature at its position
    cache, tree = {"cache": state.cache}, trees.Tree.static(self.tree)

    def read(start, stop, tokens):
      parents = jnp.stack([features[self.tree[c]] for c in range(start, stop)], axis=1)
      predicted, cache["cache"] = self._pairs(cache["cache"], parents, tokens, (tree, start))
      features.update({c: predicted[:, c - start] for c in range(start, stop)})
      return self._logits(predicted)

    root = self._logits(state.next_feature)
    tokens, probs = draft_tree(self.tree, self.tree_mode, sampling, key, root, read, constraint)
    b, calls = tokens.shape[0], len(trees.levels(self.tree)) - 1
    lengths = jnp.full((b,), len(self.tree), jnp.int32)
    # As for a chain, the commit's head call is this iteration's last draft call.
    proposal = Proposal(tokens, probs, lengths, jnp.int32(calls + 1), tree)
    return proposal, state.replace(cache=cache["cache"])

  def _propose_dynamic(
    self,
    state: EagleState,
    key: jax.Array,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ):
    """EAGLE-2 (`trees.DynamicTree`): expand the most valuable nodes depth by depth,
    then keep the best N of all candidates as this row's tree (`Tree.per_row`).

    Candidates are numbered depth by depth, one `_Group` per depth. The expanded
    nodes ("beams") go through the head with tree attention over a scratch tree in
    its cache (their ancestors are earlier beams); the commit rewrites the
    accepted path as for a chain.
    """
    spec, b = self.tree, state.next_feature.shape[0]
    keys = depth_keys(key, spec.depth)
    root = self._logits(state.next_feature)[:, None]  # [B, 1, V]
    rule = None if constraint is None else constraint.at(constraint.state[:, None])
    groups = [
      self._group(
        root, jnp.zeros((b, 1)), jnp.full((b, 1), -1, jnp.int32), 0, keys[0], sampling, rule
      )
    ]
    scratch = jnp.full((b, (spec.depth - 1) * spec.expand), -1, jnp.int32)  # the beams' tree
    cache, start, last_slots = state.cache, 0, None
    predicted = state.next_feature[:, None]  # [B, m, D] of the last beams (root: 1)
    for step in range(1, spec.depth):
      newest = groups[-1]
      m = min(spec.expand, newest.tokens.shape[1])
      pick = jax.lax.top_k(newest.values, m)[1]  # [B, m], local to the newest group
      beam = jnp.take_along_axis(newest.beams, pick, 1)  # their parents among the last beams
      if last_slots is not None:
        scratch = scratch.at[:, start : start + m].set(jnp.take_along_axis(last_slots, beam, 1))
      predicted, cache = self._pairs(
        cache,
        jnp.take_along_axis(predicted, beam[:, :, None], 1),
        jnp.take_along_axis(newest.tokens, pick, 1),
        (trees.Tree.per_row(scratch, spec.depth - 1), start),
      )
      group_start = sum(g.tokens.shape[1] for g in groups[:-1])  # the newest's first index
      groups.append(
        self._group(
          self._logits(predicted),
          jnp.take_along_axis(newest.values, pick, 1),
          group_start + pick,
          sum(g.laws.shape[1] for g in groups),
          keys[step],
          sampling,
          None if rule is None else rule.at(jnp.take_along_axis(newest.states, pick, 1)),
        )
      )
      last_slots = start + jnp.broadcast_to(jnp.arange(m)[None], (b, m))
      start += m
    return _best_tree(groups, spec, sampling), state.replace(cache=cache)

  def _group(
    self, logits, parent_values, parent_ids, first_law, key, sampling, rule=None
  ) -> _Group:
    """The `branch` children of each of m nodes, from their next-token `logits [B, m, V]`;
    `parent_values`, `parent_ids` `[B, m]`, `first_law` the index of their first law;
    `rule` None or the constraint at the m nodes' states `[B, m]` (their laws masked)."""
    (b, m, v), k = logits.shape, self.tree.branch
    if rule is not None:
      logits = rule.logits(logits)
    if isinstance(sampling, RowSampling):  # each row's warp on its m nodes
      sampling = sampling.repeat(m)
    drawn, q = children(key, logits.reshape(b * m, v), k, sampling, self.tree_mode)
    # A child's value reads its parent's law only: the rank-th largest probability.
    ranked = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)[0]  # [B, m, k]

    def flat(x):  # [B or 1, m, k or 1] -> [B, m * k]
      return jnp.broadcast_to(x, (b, m, k)).reshape(b, m * k)

    return _Group(
      tokens=drawn.reshape(b, m * k),
      values=flat(parent_values[:, :, None] + ranked),
      parents=flat(parent_ids[:, :, None]),
      law_ids=flat(first_law + jnp.arange(m)[None, :, None]),
      beams=flat(jnp.arange(m)[None, :, None]),
      laws=logits if q is None else q.reshape(b, m, v),
      states=None
      if rule is None
      else rule.at(jnp.repeat(rule.state, k, axis=1)).after(drawn.reshape(b, m * k)).state,
    )

  def commit(self, state: EagleState, commit: Commit) -> EagleState:
    start = commit.old_length - 1  # slot of s[-1]
    predicted, cache = self._pairs(
      state.cache.with_lengths(start), self.head.feature_space(commit.hidden), commit.emitted
    )
    kept = commit.new_length - commit.old_length  # n + 1
    feature = jnp.take_along_axis(predicted, (kept - 1)[:, None, None], axis=1)[:, 0]
    return EagleState(
      cache.with_lengths(jnp.where(commit.goes_on, start + kept, start)),
      jnp.where(commit.goes_on[:, None], feature, state.next_feature),
    )


# -- the EAGLE repository's hub layout


def _eagle_names(cfg: EagleConfig) -> dict:
  """EAGLE-1 hub names -> targets: fc, and the Llama layer 0 as `block`."""
  names = {"fc.weight": [(("fc", "kernel"), hub_names.transpose, None)]}
  names["fc.bias"] = [(("fc", "bias"), hub_names.same, None)]
  for name, targets in hub_names.llama_names(cfg.block_config).items():
    if name.startswith("model.layers.0.") and (cfg.input_norm or "input_layernorm" not in name):
      names[name[len("model.") :]] = [(("block", *p[2:]), f, part) for p, f, part in targets]
  return names


def _is_eagle1(config: dict, file: str, keys: Collection[str]) -> bool:
  del config, file  # a Llama config: any head layout with an fc that no other claims
  return "fc.weight" in keys


def _eagle1(config: dict, tensors: dict, target, dtype) -> nnx.Module:
  t, name = target.cfg, dtype_name(dtype)
  hub.check_llama(t)
  kv = (t.n_kv_heads, config.get("num_attention_heads"))
  want = dict(hidden_size=t.d_model, vocab_size=t.vocab_size, num_attention_heads=t.n_heads)
  want = {k: (v, None) for k, v in want.items()} | dict(num_key_value_heads=kv)
  want |= dict(num_hidden_layers=(1, None), rms_norm_eps=(t.norm_eps, 1e-6))
  want |= dict(rope_theta=(t.rope_theta, 1e4), rope_scaling=(None, None))
  hub.check_fields(config, want | dict(hidden_act=("silu", "silu"), add_para_norm=(False, False)))
  if t.d_model // t.n_heads != t.resolved_head_dim:
    raise ValueError(f"the target's head_dim {t.resolved_head_dim} is not hidden_size / heads.")
  embed = tensors.pop("embed_tokens.weight", None)
  own = np.asarray(target.embed.embedding[...], np.float32)
  if embed is not None and not (embed.shape == own.shape and np.allclose(embed, own, 1e-2, 1e-3)):
    raise ValueError("tensor embed_tokens.weight is not the target's embedding (shared here).")
  published = dict(normed_features=True, embed_first=True, input_norm=False)
  cfg = EagleConfig(t, d_ff=int(config.get("intermediate_size", t.d_ff)), **published)
  return hub.build_head(cfg, name, _eagle_names(cfg), tensors, hub.target_copies(target))


def _write_eagle1(head, target) -> tuple[dict, dict]:
  """A hub EAGLE-1 head as the EAGLE repository's (a Llama config, fc with a bias)."""
  cfg = head.cfg
  if not (cfg.normed_features and cfg.embed_first and not cfg.input_norm):
    raise ValueError(hub.NO_LAYOUT.format(kind=cfg.kind))  # specjax's reads pre-norm features
  c, dtype = cfg.block_config, str(jnp.dtype(cfg.target.param_dtype))
  config = llama_config(c, dtype)
  config |= {"num_hidden_layers": 1, "bias": True, "qkv_bias": c.qkv_bias}
  return config, hub.write_names(head, _eagle_names(cfg), target)


# -- training


def eagle_objective(head, target, batch, key, *, loss, settings):
  """EAGLE: f = feature_space(features) (+ N(0, feature_noise^2) in training); the head
  reads (f_t, x_{t+1}) and predicts the feature at t + 1, whose law is compared with the
  target's at t + 1 (t = 0..T-2), plus feature_weight * smooth-L1 toward the target's
  last-layer feature there (one feature layer only: fused features have no regression
  target)."""
  inputs = batch[:, :-1]
  p_logits, features = losses.target_outputs(target, inputs, head.cfg.target_features)
  f = head.feature_space(features)
  if key is not None and settings.feature_noise > 0:
    f = f + settings.feature_noise * jax.random.normal(key, f.shape, f.dtype)
  pred = head(target, f[:, :-1], inputs[:, 1:])  # [B, T - 1, D]: positions 1..T-1
  metrics = losses.law_metrics(loss, p_logits[:, 1:], target.features_to_logits(pred), batch[:, 2:])
  value = metrics["distill"]
  if head.cfg.num_features == 1:  # fused features have no regression target
    metrics["feature"] = losses.smooth_l1(pred, features[:, 1:])
    value = value + settings.feature_weight * metrics["feature"]
  return value, metrics


@dataclasses.dataclass(frozen=True)
class EagleLoss(LossSettings):
  """EAGLE's objective settings (`config.head`).

  Attributes:
    feature_weight: weight of the smooth-L1 regression toward the target's last-layer
      features (one feature layer only).
    feature_noise: standard deviation of the Gaussian noise added to the input features
      in training (robustness to its own errors); never added without a key (evaluation).
  """

  feature_weight: float = 0.0
  feature_noise: float = 0.0

  @property
  def keyed(self) -> bool:
    return self.feature_noise > 0  # the noise is the only draw

  @classmethod
  def from_config(cls, head) -> EagleLoss:
    return cls(
      feature_weight=float(head.get("feature_weight", cls.feature_weight)),
      feature_noise=float(head.get("feature_noise", cls.feature_noise)),
    )


KIND = HeadKind(
  name="eagle",
  title="EAGLE head",
  config=EagleConfig,
  make=make_head,
  drafter=EagleDrafter,
  holds="head",
  objective=eagle_objective,
  hub=hub.HubLayout(
    "EAGLE-1/2 (the EAGLE repository's)", hub.LLAMA_FILES, _is_eagle1, _eagle1, _write_eagle1
  ),
  # EAGLE-1's layout is any head file with an `fc.weight` (DFlash's has one too): last.
  read_priority=3,
  dynamic_trees="EAGLE-2",
  training=TrainingRules(fields=("feature_layers", "d_ff"), loss=EagleLoss),
)

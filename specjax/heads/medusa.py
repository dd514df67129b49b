"""Medusa heads (Cai et al. 2024, arXiv 2401.10774), everything they are: settings
(`MedusaConfig`), module (`MedusaHeads`; `HubMedusaHeads`, the published layout's),
drafter (`MedusaDrafter`), the Medusa repository's and vLLM's hub layout, training
objective and record.

Drafting: K heads on the last feature.

The state is the target's feature at the position that predicted s[-1] (from
the prefill, then from each verification call). Head k maps it to a feature
for the token k positions after s[-1], read through the target's own final
norm and head: x_k ~ q_k, all g tokens from one call, each independent of the
earlier drafted tokens given the prefix. Verification uses q_k itself, so
token and block verification are exact at any temperature (a q that ignores
x_1..x_{k-1} is still a law for x_k given everything before it).

With a `tree` (Medusa's sparse tree, `specjax.trees.from_paths`) a node at depth
d has its children drawn from head d's law, the same whatever the node (the heads
read s only): the top-k of each head at temperature 0, as in the paper, and
sampled top-k (or i.i.d. draws) otherwise, fresh per node. Still one head call.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import losses, trees
from specjax.coupling import Coupling, chain_draws
from specjax.drafting.base import (
  Commit,
  ConfidenceLength,
  DraftConstraint,
  Proposal,
  VocabSubset,
  check_confidence,
)
from specjax.drafting.tree import (
  check_tree_depth,
  check_tree_gamma,
  check_tree_mode,
  draft_depth_tree,
)
from specjax.dtypes import dtype_name
from specjax.heads import hub
from specjax.heads.base import (
  HeadConfig,
  HeadConfigError,
  HeadKind,
  TrainingRules,
  linear,
  own_logits,
)
from specjax.models import hub_names
from specjax.models.transformer import Norm, Transformer
from specjax.sampling import SamplingParams, sample_with_uniform, warp_probs
from specjax.validation import is_int

_MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclasses.dataclass(frozen=True)
class MedusaConfig(HeadConfig):
  """Medusa heads' settings (besides `HeadConfig`'s).

  Attributes:
    num_heads: K in [1, 16] (head k drafts token k + 1 of the iteration; the draft
      length gamma is at most K).
    medusa_layers: residual layers per head, in [1, 8].
    normed_features: read the target's features after its final norm and draft
      through each head's own lm_head with no norm (Medusa as published).
  """

  kind = "medusa"

  num_heads: int = 4
  medusa_layers: int = 1
  normed_features: bool = False

  def check_settings(self, layers):
    if not is_int(self.num_heads) or not 1 <= self.num_heads <= 16:
      raise HeadConfigError(f"num_heads must be an int in [1, 16], got {self.num_heads!r}.")
    if not is_int(self.medusa_layers) or not 1 <= self.medusa_layers <= 8:
      raise HeadConfigError(f"medusa_layers must be an int in [1, 8], got {self.medusa_layers!r}.")
    self._check_bools("normed_features")
    return layers

  @property
  def target_features(self) -> bool:
    return True  # the heads read the last layer's features


class MedusaHeads(nnx.Module):
  """Medusa-1 heads: head k maps the feature at t to one for the token at t + k + 1.

  Each head is a residual block `f + silu(W_k f + b_k)`, zero-initialised (a
  fresh head reproduces the target's next-token law), read through the target's
  final norm and head.
  """

  def __init__(self, cfg: MedusaConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, MedusaConfig):
      raise ValueError(f"MedusaHeads needs a MedusaConfig, got {type(cfg).__name__}.")
    self.cfg = cfg
    d, n = cfg.target.d_model, cfg.medusa_layers

    def layers():
      one = [linear(cfg.target, d, d, rngs=rngs, zero=True) for _ in range(n)]
      return one[0] if n == 1 else nnx.List(one)

    self.heads = nnx.List([layers() for _ in range(cfg.num_heads)])

  def __call__(self, features: jax.Array, num_heads: int | None = None) -> jax.Array:
    """`[..., D]` features -> `[..., K, D]` (the first `num_heads` heads, static)."""
    out = []
    for head in self.heads[: num_heads or self.cfg.num_heads]:
      x = features
      for layer in head if self.cfg.medusa_layers > 1 else [head]:
        x = x + jax.nn.silu(layer(x))
      out.append(x)
    return jnp.stack(out, axis=-2)


class HubMedusaHeads(MedusaHeads):
  """`MedusaHeads` with `normed_features` (Medusa as published): the heads read
  `feature_norm(f)` (a copy of the target's final norm); head k drafts through
  its own `lm_heads[k]`, with no norm."""

  def __init__(self, cfg: MedusaConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    t, k = cfg.target, cfg.num_heads
    self.feature_norm = Norm(t)
    self.lm_heads = nnx.List(
      [linear(t, t.d_model, t.vocab_size, rngs=rngs, bias=False) for _ in range(k)]
    )

  def __call__(self, features: jax.Array, num_heads: int | None = None) -> jax.Array:
    return super().__call__(self.feature_norm(features), num_heads)

  def logits(self, h: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """Head outputs `[..., k, D]` (heads 0..k-1) -> float32 logits `[..., k, V]`."""
    out = [self.lm_heads[i](h[..., i, :]) for i in range(h.shape[-2])]
    return own_logits(jnp.stack(out, axis=-2), vocab_subset)


def make_head(cfg: MedusaConfig, *, rngs: nnx.Rngs) -> MedusaHeads:
  """Fresh Medusa heads (`HubMedusaHeads` with `normed_features`)."""
  return (HubMedusaHeads if cfg.normed_features else MedusaHeads)(cfg, rngs=rngs)


# -- drafting


@struct.dataclass
class MedusaDrafter(ConfidenceLength, VocabSubset):
  """Drafts g <= K tokens with `MedusaHeads` in one call (see the module docstring).

  Attributes:
    target: the target (its final norm and head are shared, not copied).
    heads: trained `MedusaHeads` for this target's shape.
    confidence: a row's draft ends at the first head whose top probability
      falls below this (0 disables it).
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec; `with_vocab_subset`).
    tree: None (a chain of gamma tokens), or a static breadth-first token tree
      of depth <= K (`specjax.trees`); then gamma is its number of nodes.
    tree_mode: how a tree's siblings are drawn, "without_replacement" or "iid".
  """

  target: Transformer
  heads: MedusaHeads
  confidence: float = struct.field(pytree_node=False, default=0.0)
  vocab_subset: jax.Array | None = None
  tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")

  prefill_calls = 0  # the prefill's target features are all it needs
  target_features = True
  constrained_drafts = True
  takes_tree = True

  def __post_init__(self):
    self.heads.cfg.check_target(self.target.cfg)
    check_confidence(self.confidence)
    check_tree_mode(self.tree_mode)
    if self.tree is not None:
      object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
      check_tree_depth(self.tree, self.max_tree_depth, "one Medusa head")
      if self.confidence > 0:
        raise ValueError("confidence must be 0 with a tree (a tree is drafted whole).")

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def max_tree_depth(self) -> int:
    """The deepest tree it drafts: one head per depth."""
    return self.heads.cfg.num_heads

  def _logits(self, features: jax.Array) -> jax.Array:
    if hasattr(self.heads, "logits"):  # hub heads draft through their own lm_heads
      return self.heads.logits(features, self.vocab_subset)
    return VocabSubset._logits(self, features)

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    del prompt_width, max_new_tokens  # no cache of its own
    if self.tree is not None:
      return check_tree_gamma(self.tree, gamma)
    k = self.heads.cfg.num_heads
    if gamma > k:
      raise ValueError(f"gamma must be in [1, {k}] for {k} Medusa heads, got {gamma}.")

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> jax.Array:
    if hidden is None:
      raise ValueError("MedusaDrafter.init needs the target's features at the prompt (hidden).")
    return jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

  def propose(
    self,
    feature: jax.Array,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, jax.Array]:
    del recent
    if self.tree is not None:
      return self._propose_tree(feature, key, sampling, constraint), feature
    b, g = limit.shape[0], gamma
    logits = self._logits(self.heads(feature, num_heads=g))  # [B, g, V]
    proposed = jnp.arange(g)[None, :] < limit[:, None]
    if constraint is not None:  # head i's law masked by the state tokens 1..i-1 reach
      return self._propose_constrained(logits, proposed, key, sampling, constraint), feature
    if sampling.greedy:
      tokens, probs = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    else:
      probs = warp_probs(logits, sampling)
      if isinstance(key, Coupling):
        draw_token = chain_draws(key, g, b)
        tokens = jnp.stack([draw_token(i, probs[:, i]) for i in range(g)], axis=1)
      else:
        tokens = sample_with_uniform(jax.random.uniform(key, (b, g), jnp.float32), probs)
      if self.confidence > 0:
        proposed &= jnp.max(probs, axis=-1) >= self.confidence
    return Proposal(tokens, probs, _leading(proposed), calls=jnp.int32(1)), feature

  def _propose_constrained(self, logits, proposed, key, sampling, rule: DraftConstraint):
    """The chain under a constraint: the heads' laws are masked one position at a
    time, since each position's state depends on the tokens drawn before it."""
    b, g = proposed.shape
    if not sampling.greedy:
      if isinstance(key, Coupling):
        draw_token = chain_draws(key, g, b)
      else:  # the unconstrained chain's uniforms, position by position
        uniforms = jax.random.uniform(key, (b, g), jnp.float32)
        draw_token = lambda i, q: sample_with_uniform(uniforms[:, i], q)
    tokens, probs = [], []
    for i in range(g):
      masked = rule.logits(logits[:, i])
      if sampling.greedy:
        token = jnp.argmax(masked, axis=-1).astype(jnp.int32)
      else:
        q = warp_probs(masked, sampling)
        token = draw_token(i, q)
        probs.append(q)
        if self.confidence > 0:
          confident = jnp.max(q, axis=-1) >= self.confidence
          proposed = proposed.at[:, i].set(proposed[:, i] & confident)
      tokens.append(token)
      rule = rule.after(token)
    probs = jnp.stack(probs, axis=1) if probs else None
    return Proposal(jnp.stack(tokens, axis=1), probs, _leading(proposed), calls=jnp.int32(1))

  def _propose_tree(
    self,
    feature: jax.Array,
    key: jax.Array,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ):
    depth = len(trees.levels(self.tree))
    logits = self._logits(self.heads(feature, num_heads=depth))  # [B, depth, V]: head d
    return draft_depth_tree(self.tree, self.tree_mode, sampling, key, logits, constraint)

  def commit(self, feature: jax.Array, commit: Commit) -> jax.Array:
    kept = commit.new_length - commit.old_length  # n + 1; hidden[n] predicted s'[-1]
    new = jnp.take_along_axis(commit.hidden, (kept - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(commit.goes_on[:, None], new, feature)


def _leading(proposed: jax.Array) -> jax.Array:
  """`[B]` a row's draft length: its leading run of proposed heads (`proposed [B, g]`)."""
  return jnp.sum(jnp.cumprod(proposed, axis=1), axis=1).astype(jnp.int32)


# -- the hub layouts (the Medusa repository's, vLLM's)


def _medusa_names(cfg: MedusaConfig, vllm: bool, shared: str | None = None) -> dict:
  """Medusa's (`{i}.{j}.linear`, `{i}.{L}`) or vLLM's (`blocks.{i}.layers.{j}`,
  `lm_heads.{i}`; `shared`: one lm_head) names -> targets."""
  names, n, tr = {}, cfg.medusa_layers, hub_names.transpose
  for i in range(cfg.num_heads):
    for j in range(n):
      path = ("heads", i) + ((j,) if n > 1 else ())
      hub = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
      names[hub + "weight"] = [(path + ("kernel",), tr, None)]
      names[hub + "bias"] = [(path + ("bias",), hub_names.same, None)]
    hub = shared or (f"lm_heads.{i}.weight" if vllm else f"{i}.{n}.weight")
    names.setdefault(hub, []).append((("lm_heads", i, "kernel"), tr, None))
  return names


def _is_medusa(config: dict, file: str, keys: Collection[str]) -> bool:
  if file in _MEDUSA_FILES or "medusa_num_heads" in config:  # the Medusa repository's
    return True
  return "num_heads" in config and any(k.startswith(("blocks.", "medusa_")) for k in keys)


def _medusa(config: dict, tensors: dict, target, dtype) -> nnx.Module:
  t, vllm, name = target.cfg, "medusa_num_heads" not in config, dtype_name(dtype)
  tensors = {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
  if vllm:
    v = (t.vocab_size, t.vocab_size)
    hub.check_fields(
      config, dict(hidden_size=(t.d_model,) * 2, vocab_size=v, truncated_vocab_size=v)
    )
    tensors.pop("token_map", None)
  layers = int(config.get("num_hidden_layers" if vllm else "medusa_num_layers", 1))
  pattern = r"blocks\.(\d+)\." if vllm else r"(\d+)\.0\.linear"
  k = 1 + max((int(m.group(1)) for n in tensors if (m := re.match(pattern, n))), default=-1)
  if not 1 <= k <= 16:  # the file's heads: published configs sometimes say fewer
    raise ValueError(f"found {k} Medusa heads in the file; specjax reads 1 to 16.")
  cfg = MedusaConfig(t, num_heads=k, medusa_layers=layers, normed_features=True)
  shared = None
  if config.get("original_lm_head"):  # vLLM: one lm_head for all heads
    shared = "lm_heads.0.weight" if "lm_heads.0.weight" in tensors else "lm_head.weight"
  copies = hub.target_copies(target)
  copies.pop(("lm_head", "kernel"))
  return hub.build_head(cfg, name, _medusa_names(cfg, vllm, shared), tensors, copies)


def _write_medusa(head, target) -> tuple[dict, dict]:
  """A hub Medusa head as vLLM's (`MedusaModel`)."""
  cfg = head.cfg
  if not cfg.normed_features:
    raise ValueError(hub.NO_LAYOUT.format(kind=cfg.kind))  # specjax's reads pre-norm features
  t, dtype = cfg.target, str(jnp.dtype(cfg.target.param_dtype))
  config = dict(architectures=["MedusaModel"], model_type="medusa", hidden_size=t.d_model)
  config |= dict(vocab_size=t.vocab_size, truncated_vocab_size=t.vocab_size, torch_dtype=dtype)
  config |= dict(num_heads=cfg.num_heads, num_hidden_layers=cfg.medusa_layers, medusa_fc_bias=True)
  return config, hub.write_names(head, _medusa_names(cfg, vllm=True), target)


# -- training


def medusa_objective(head, target, batch, key, *, loss, settings):
  """Medusa-1: head k (0-based) at position t against the target's law at t + k + 1
  (positions whose target lies past the window are left out); heads weigh equally."""
  del key, settings  # no noise, no feature target
  inputs = batch[:, :-1]
  t = inputs.shape[1]
  p_logits, features = losses.target_outputs(target, inputs, True)
  drafted = head(features)  # [B, T, K, D]
  per_head = []
  for k in range(head.cfg.num_heads):
    # Positions 0..T-k-2 have their target law (at t + k + 1) inside the window;
    # the vocabulary projection runs on those only.
    n = t - k - 1
    q_logits = target.features_to_logits(drafted[:, :n, k])
    per_head.append(losses.law_metrics(loss, p_logits[:, k + 1 :], q_logits, batch[:, k + 2 :]))
  metrics = {name: jnp.mean(jnp.stack([m[name] for m in per_head])) for name in per_head[0]}
  for k, m in enumerate(per_head):
    metrics[f"alpha_t0_head{k}"] = m["alpha_t0"]
    metrics[f"alpha_t1_head{k}"] = m["alpha_t1"]
  return metrics["distill"], metrics


def _check_training(config) -> None:
  head = config.head
  if not is_int(head.num_heads) or not 1 <= head.num_heads <= 16:
    raise ValueError(f"config.head.num_heads must be an int in [1, 16], got {head.num_heads!r}.")
  if not head.num_heads < config.seq_len:
    raise ValueError(
      f"config.head.num_heads must be < config.seq_len={config.seq_len} (the last head needs "
      f"a target position in the window), got {head.num_heads!r}."
    )


KIND = HeadKind(
  name="medusa",
  title="Medusa heads",
  config=MedusaConfig,
  make=make_head,
  drafter=MedusaDrafter,
  holds="heads",
  objective=medusa_objective,
  hub=hub.HubLayout(
    "Medusa (the Medusa repository's; vLLM's MedusaModel)",
    _MEDUSA_FILES + hub.LLAMA_FILES,
    _is_medusa,
    _medusa,
    _write_medusa,
  ),
  read_priority=0,
  training=TrainingRules(fields=("num_heads", "feature_layers", "d_ff"), check=_check_training),
)

"""Draft heads: small trainable modules that read the target's features.

Each head drafts through the target's own (frozen, shared, never copied) final
norm and output head, `Transformer.features_to_logits`; only the head's own
parameters train.

  EagleHead         one decoder layer at the feature level (EAGLE, Li et al.
                    2024): fc([feature_t; embed(x_{t+1})]) -> feature_{t+1}
  MedusaHeads       K residual blocks on the last feature (Medusa, Cai et al.
                    2024): head k predicts the token k + 1 positions ahead
  ExitAdapter       one decoder layer after the target's first k layers
                    (early exit, Kangaroo: Liu et al. 2024)
  Eagle3Head        EAGLE-3 (Li et al. 2025): fused low/middle/high features, a
                    2D-input layer, its own head over a draft vocabulary (its hub
                    layout and warm start: `specjax.models.eagle3`)

Each kind's record (module, drafter, objective, files) is `specjax.heads.kind(name)`;
this file holds the modules, `HEAD_MODULES` the one table of kind -> module class.

`HeadConfig` records the kind, its settings and the target shape the head was
trained for; a head is refused for a target of another shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import MLP, Attention, Block, Linear, Norm, Transformer, run_blocks
from specjax.validation import is_int

# A head's files in a specjax run or export (its `HeadConfig`, its parameters): the one
# spelling of each name (`specjax.heads.CONFIG_FILE`, `WEIGHTS_FILE` re-export them).
HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "model.safetensors"
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")  # EAGLE-3's layer
# The target fields a head depends on: a head trained for one target works with
# another only when all of them agree.
TARGET_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """What a draft head is, and the target shape it reads.

  Attributes:
    kind: one of `HEAD_KINDS`.
    target: the `ModelConfig` of the target the head was built for.
    num_heads: Medusa heads K (head k drafts token k + 1 of the iteration;
      the draft length gamma is at most K).
    exit_layer: early exit after this many target layers, in [1, n_layers).
    feature_layers: EAGLE reads the residual stream after these target layer
      counts (static); `()` means the last layer only (EAGLE-1). Several layers
      fuse lower-level features as in EAGLE-3.
    d_ff: MLP width of the head's decoder layer (EAGLE, early exit); 0 means
      the target's.
    draft_vocab_size: EAGLE-3's draft vocabulary K in [1, V]; 0 means V.
    draft_ids: EAGLE-3's K target ids, ascending (`eagle3.draft_vocab_ids`);
      `()`: the identity (K = V), or not yet counted.

  Switches for the hub's layouts (`specjax.hf.heads`; defaults: specjax's heads):
    normed_features: eagle, medusa: read the target's features after its final
      norm, draft through own lm_head(s) with no norm (published EAGLE-1, Medusa).
    embed_first: EAGLE's fc reads `[embed; feature]`, not `[feature; embed]`.
    input_norm: EAGLE's layer normalises its input (the EAGLE repo's does not).
    medusa_layers: residual layers per Medusa head, in [1, 8].

  EAGLE-3 reads exactly three `feature_layers`; `()` picks vLLM's (2, L//2, L-3)
  when those are three increasing counts (L >= 7), else (1, (L+1)//2, L).
  """

  kind: str
  target: ModelConfig
  num_heads: int = 4
  exit_layer: int = 2
  feature_layers: tuple[int, ...] = ()
  d_ff: int = 0
  draft_vocab_size: int = 0
  draft_ids: tuple[int, ...] = ()
  normed_features: bool = False
  embed_first: bool = False
  input_norm: bool = True
  medusa_layers: int = 1

  def __post_init__(self):
    if self.kind not in HEAD_KINDS:
      raise ValueError(f"kind must be one of {HEAD_KINDS}, got {self.kind!r}.")
    n = self.target.n_layers
    # Each kind's own settings are checked; the others keep their defaults.
    if self.kind == "medusa" and (not is_int(self.num_heads) or not 1 <= self.num_heads <= 16):
      raise ValueError(f"num_heads must be an int in [1, 16], got {self.num_heads!r}.")
    if self.kind == "early_exit" and (not is_int(self.exit_layer) or not 1 <= self.exit_layer < n):
      raise ValueError(
        f"exit_layer must be an int in [1, {n - 1}] (the target has {n} layers), "
        f"got {self.exit_layer!r}."
      )
    layers = tuple(self.feature_layers)
    if self.kind == "eagle3":
      layers = _check_eagle3(self, layers, n)
    if any(not is_int(i) or not 1 <= i <= n for i in layers) or len(set(layers)) != len(layers):
      raise ValueError(
        f"feature_layers must be distinct layer counts in [1, {n}], got {self.feature_layers!r}."
      )
    object.__setattr__(self, "feature_layers", layers)
    if not is_int(self.d_ff) or self.d_ff < 0:
      raise ValueError(f"d_ff must be an int >= 0 (0: the target's), got {self.d_ff!r}.")
    switches = (self.normed_features, self.embed_first, self.input_norm)
    if not all(isinstance(x, bool) for x in switches):
      raise ValueError(f"normed_features, embed_first, input_norm must be bools: {switches}.")
    if self.normed_features and self.kind not in HUB_MODULES:
      raise ValueError(f"normed_features applies to eagle and medusa, not {self.kind!r}.")
    if not is_int(self.medusa_layers) or not 1 <= self.medusa_layers <= 8:
      raise ValueError(f"medusa_layers must be an int in [1, 8], got {self.medusa_layers!r}.")

  @property
  def draft_vocab(self) -> int:
    """EAGLE-3's draft vocabulary size K."""
    return self.draft_vocab_size or self.target.vocab_size

  @property
  def block_config(self) -> ModelConfig:
    """The config of the head's own decoder layer: the target's, one layer
    (global attention when the target alternates local and global layers)."""
    local = None if self.target.local_layers is None else ()
    return self.target.replace(n_layers=1, d_ff=self.d_ff or self.target.d_ff, local_layers=local)

  @property
  def target_features(self) -> bool | tuple[int, ...]:
    """What the head reads from the target's calls (`forward_cached`'s `return_hidden`)."""
    if self.kind in ("eagle", "eagle3") and self.feature_layers:
      return self.feature_layers
    return self.kind != "early_exit"  # early exit runs the target's layers itself

  @property
  def num_features(self) -> int:
    """How many D-wide features the head reads per position."""
    return len(self.feature_layers) or 1

  def check_target(self, target: ModelConfig, name: str = "target") -> None:
    """ValueError naming every shape field where `target` differs from the trained one."""
    diffs = [
      f"{field} {getattr(target, field)} (head trained for {getattr(self.target, field)})"
      for field in TARGET_SHAPE_FIELDS
      if getattr(target, field) != getattr(self.target, field)
    ]
    if diffs:
      raise ValueError(f"this {self.kind} head was trained for another {name}: {'; '.join(diffs)}.")

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["feature_layers"] = list(self.feature_layers)
    out["draft_ids"] = list(self.draft_ids)
    return out

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> HeadConfig:
    fields = dict(fields)
    target = dict(fields.pop("target"))
    if target.get("rope_scaling"):
      from specjax.models.config import RopeScaling

      target["rope_scaling"] = RopeScaling(**target["rope_scaling"])
    fields["feature_layers"] = tuple(fields.get("feature_layers", ()))
    fields["draft_ids"] = tuple(fields.get("draft_ids", ()))
    return cls(target=ModelConfig(**target), **fields)


def _check_eagle3(cfg: HeadConfig, layers: tuple, n: int) -> tuple[int, ...]:
  """EAGLE-3's feature layers (defaulted) after checking its draft vocabulary."""
  v, k, ids = cfg.target.vocab_size, cfg.draft_vocab_size, tuple(cfg.draft_ids)
  if not is_int(k) or not 0 <= k <= v:
    raise ValueError(f"draft_vocab_size must be an int in [0, {v}] (0: {v}), got {k!r}.")
  if ids and (
    len(ids) != (k or v) or list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < v
  ):
    raise ValueError(
      f"draft_ids must be draft_vocab_size={k or v} ascending distinct ids in [0, {v})."
    )
  object.__setattr__(cfg, "draft_ids", tuple(map(int, ids)) if len(ids) < v else ())
  if not layers:
    layers = (2, n // 2, n - 3) if n >= 7 else (1, (n + 1) // 2, n)
  if len(layers) != 3:
    raise ValueError(f"feature_layers must be 3 layer counts for eagle3, got {layers!r}.")
  return layers


def _linear(cfg: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs, zero=False, bias=True):
  init = nnx.initializers.zeros if zero else nnx.initializers.normal(cfg.init_std)
  return Linear(
    d_in,
    d_out,
    use_bias=bias,
    kernel_init=nnx.with_partitioning(init, (None, "embed"), eager_sharding=False),
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    rngs=rngs,
  )


class EagleHead(nnx.Module):
  """EAGLE's draft head: autoregression over the target's features.

  Position t reads `fc([f_t; embed(x_{t+1})])` (the embedding is the target's
  own) and one decoder layer predicts the feature f_{t+1}, which the target's
  final norm and head turn into q(x_{t+2}). f lives in the target's last-layer
  feature space (D wide): the target's own features there, or the head's
  predictions while drafting. With several `feature_layers` (EAGLE-3 fusion),
  `fuse` first maps the target's concatenated features to D.
  """

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    if cfg.kind != "eagle":
      raise ValueError(f"EagleHead needs kind='eagle', got {cfg.kind!r}.")
    self.cfg = cfg
    d = cfg.target.d_model
    if cfg.num_features > 1:
      self.fuse = _linear(cfg.target, cfg.num_features * d, d, rngs=rngs)
    self.fc = _linear(cfg.target, 2 * d, d, rngs=rngs)
    self.block = Block(cfg.block_config, rngs=rngs)
    if not cfg.input_norm:  # the EAGLE repository's layer 0 has no input_layernorm
      self.block.attn_norm = _Identity()

  def feature_space(self, target_features: jax.Array) -> jax.Array:
    """The target's features `[..., F]` (from `forward_cached(return_hidden=...)`)
    as head inputs `[..., D]`: unchanged for one layer, fused for several."""
    if self.cfg.num_features > 1:
      return self.fuse(target_features)
    return target_features

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    c = self.cfg.block_config
    return KVCache.zeros(
      n_layers=1,
      batch=batch,
      capacity=capacity,
      n_kv_heads=c.n_kv_heads,
      head_dim=c.resolved_head_dim,
      dtype=c.compute_dtype,
    )

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


class MedusaHeads(nnx.Module):
  """Medusa-1 heads: head k maps the feature at t to one for the token at t + k + 1.

  Each head is a residual block `f + silu(W_k f + b_k)`, zero-initialised (a
  fresh head reproduces the target's next-token law), read through the target's
  final norm and head.
  """

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    if cfg.kind != "medusa":
      raise ValueError(f"MedusaHeads needs kind='medusa', got {cfg.kind!r}.")
    self.cfg = cfg
    d, n = cfg.target.d_model, cfg.medusa_layers

    def layers():
      one = [_linear(cfg.target, d, d, rngs=rngs, zero=True) for _ in range(n)]
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


class ExitAdapter(nnx.Module):
  """Early exit: one decoder layer maps the residual stream after the target's
  first `exit_layer` layers to an estimate of its last-layer features."""

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    if cfg.kind != "early_exit":
      raise ValueError(f"ExitAdapter needs kind='early_exit', got {cfg.kind!r}.")
    self.cfg = cfg
    self.block = Block(cfg.block_config, rngs=rngs)

  init_cache = EagleHead.init_cache

  def __call__(self, features: jax.Array) -> jax.Array:
    """Training form: `[B, T, D]` layer-k features -> `[B, T, D]`, causal, no cache."""
    b, t, _ = features.shape
    return self.forward_cached(features, self.init_cache(b, t))[0]

  def forward_cached(self, features: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    x, cache, _ = run_blocks([self.block], features, cache)
    return x, cache


class _Identity(nnx.Module):
  def __call__(self, x):
    return x


def _own_logits(x: jax.Array, vocab_subset: jax.Array | None) -> jax.Array:
  """Logits `x [..., V]` as float32, -inf off `vocab_subset` (FR-Spec) when given."""
  x = x.astype(jnp.float32)
  if vocab_subset is None:
    return x
  return jnp.where(jnp.zeros(x.shape[-1], bool).at[vocab_subset].set(True), x, -jnp.inf)


class HubEagleHead(EagleHead):
  """`EagleHead` with `normed_features` (EAGLE-1/2 as published): it reads
  `feature_norm(f)` and drafts through `lm_head` with no norm (copies of the
  target's final norm and head)."""

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    t = cfg.target
    self.feature_norm = Norm(t)
    self.lm_head = _linear(t, t.d_model, t.vocab_size, rngs=rngs, bias=False)

  def feature_space(self, target_features: jax.Array) -> jax.Array:
    return self.feature_norm(super().feature_space(target_features))

  def logits(self, h: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """Predicted features `[..., D]` -> float32 logits `[..., V]`."""
    return _own_logits(self.lm_head(h), vocab_subset)


class HubMedusaHeads(MedusaHeads):
  """`MedusaHeads` with `normed_features` (Medusa as published): the heads read
  `feature_norm(f)` (a copy of the target's final norm); head k drafts through
  its own `lm_heads[k]`, with no norm."""

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    t, k = cfg.target, cfg.num_heads
    self.feature_norm = Norm(t)
    self.lm_heads = nnx.List(
      [_linear(t, t.d_model, t.vocab_size, rngs=rngs, bias=False) for _ in range(k)]
    )

  def __call__(self, features: jax.Array, num_heads: int | None = None) -> jax.Array:
    return super().__call__(self.feature_norm(features), num_heads)

  def logits(self, h: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """Head outputs `[..., k, D]` (heads 0..k-1) -> float32 logits `[..., k, V]`."""
    out = [self.lm_heads[i](h[..., i, :]) for i in range(h.shape[-2])]
    return _own_logits(jnp.stack(out, axis=-2), vocab_subset)


class Eagle3Layer(nnx.Module):
  """`[embed; h]` `[B, T, 2D]` -> h' `[B, T, D]`, called as a `Block` by `run_blocks`."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h = cfg.d_model, cfg.resolved_head_dim
    for name in _NORMS:
      setattr(self, name, Norm(cfg))
    self.attn = Attention(cfg.replace(d_model=2 * d, head_dim=h), rngs=rngs)
    # Back to D wide; a bias only where the target's blocks have one (the hub layout's
    # attention_bias), as vLLM's and SGLang's LlamaForCausalLMEagle3 build it.
    self.attn.o_proj = _linear(cfg, cfg.n_heads * h, d, rngs=rngs, bias=cfg.out_bias)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, masks, layer_cache, starts, inv_freq=None, contiguous=True):
    emb, h = jnp.split(x, 2, axis=-1)
    x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
    out, layer_cache = self.attn(x, positions, masks, layer_cache, starts, inv_freq, contiguous)
    h = h + out
    return h + self.mlp(self.post_attention_layernorm(h)), layer_cache


class Eagle3Head(nnx.Module):
  """EAGLE-3, for `EagleDrafter` as `EagleHead` is, with its own `logits`."""

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    if cfg.kind != "eagle3":
      raise ValueError(f"Eagle3Head needs kind='eagle3', got {cfg.kind!r}.")
    if len(cfg.draft_ids or range(cfg.target.vocab_size)) != cfg.draft_vocab:
      raise ValueError(f"cfg.draft_ids must hold {cfg.draft_vocab} ids (draft_vocab_ids).")
    self.cfg = cfg
    c = cfg.block_config
    # No fc or lm_head bias: the published layout has none, so a trained head
    # exports whole (specjax.hf.eagle3).
    self.fc = _linear(c, 3 * c.d_model, c.d_model, rngs=rngs, bias=False)
    self.midlayer = Eagle3Layer(c, rngs=rngs)
    self.norm = Norm(c)
    self.lm_head = _linear(c, c.d_model, cfg.draft_vocab, rngs=rngs, bias=False)

  init_cache = EagleHead.init_cache

  def feature_space(self, target_features: jax.Array) -> jax.Array:
    """The target's three features `[..., 3D]` -> h `[..., D]`."""
    return self.fc(target_features)

  def layer_input(self, target: Transformer, h: jax.Array, next_tokens: jax.Array):
    """`[embed(next_tokens); h]` `[B, T, 2D]`, the layer's input."""
    return jnp.concatenate([target.embed(next_tokens).astype(h.dtype), h], axis=-1)

  def forward_cached(self, target, features, next_tokens, cache: KVCache, tree=None):
    """h `[B, T, D]` and tokens `[B, T]` after each row's cached prefix (`tree`:
    nodes of a token tree, `run_blocks`) -> `(h' [B, T, D], cache)`."""
    x = self.layer_input(target, features, next_tokens)
    x, cache, _ = run_blocks([self.midlayer], x, cache, tree=tree)
    return x, cache

  def draft_logits(self, h: jax.Array) -> jax.Array:
    """h' `[..., D]` -> float32 logits `[..., K]` over the draft ids."""
    return self.lm_head(self.norm(h)).astype(jnp.float32)

  def logits(self, h: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """h' `[..., D]` -> float32 logits `[..., V]`: -inf off the draft ids (and off
    `vocab_subset` when given), so q is 0 there and verification stays exact."""
    x = self.draft_logits(h)
    if self.cfg.draft_ids:
      full = jnp.full((*x.shape[:-1], self.cfg.target.vocab_size), -jnp.inf, x.dtype)
      x = full.at[..., jnp.asarray(self.cfg.draft_ids)].set(x)
    return _own_logits(x, vocab_subset)


# The module of each head kind: the one table the model layer dispatches on.
HEAD_MODULES = {
  "eagle": EagleHead,
  "medusa": MedusaHeads,
  "early_exit": ExitAdapter,
  "eagle3": Eagle3Head,
}
HUB_MODULES = {"eagle": HubEagleHead, "medusa": HubMedusaHeads}
HEAD_KINDS = tuple(HEAD_MODULES)  # the kinds' names, in `HEAD_MODULES`' order


def make_head(cfg: HeadConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """A fresh head of `cfg.kind` (`HubEagleHead`, `HubMedusaHeads` with `normed_features`)."""
  return (HUB_MODULES if cfg.normed_features else HEAD_MODULES)[cfg.kind](cfg, rngs=rngs)

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
  DFlashHead        a block drafter (DFlash, arXiv 2602.06036): a few layers
                    that denoise a block [s[-1], mask, ..., mask] in one call,
                    reading the target's fused features as keys and values

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
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.transformer import (
  MLP,
  Attention,
  Block,
  Linear,
  Norm,
  Transformer,
  apply_rope,
  attend,
  rope_inv_freq,
  run_blocks,
)
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

  Block drafter (DFlash) settings:
    block_size: B in [2, 64]: one call drafts the B - 1 tokens after s[-1].
    draft_layers: the drafter's decoder layers, in [1, 16].
    mask_token_id: the id whose embedding fills the block's B - 1 slots, in
      [0, V) (a tokenizer's spare id, as the hub checkpoints use), or -1: a
      learned embedding of the drafter's own (a tokenizer with no spare id).

  EAGLE-3 reads exactly three `feature_layers`; `()` picks vLLM's (2, L//2, L-3)
  when those are three increasing counts (L >= 7), else (1, (L+1)//2, L). A
  block drafter's `()` picks `dflash_feature_layers(L, draft_layers)`.
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
  block_size: int = 16
  draft_layers: int = 1
  mask_token_id: int = -1

  def __post_init__(self):
    if self.kind not in HEAD_KINDS:
      raise ValueError(f"kind must be one of {HEAD_KINDS}, got {self.kind!r}.")
    n = self.target.n_layers
    # Each kind's module checks its own settings (the others keep their defaults)
    # and gives its feature layers, defaulted.
    layers = HEAD_MODULES[self.kind].check_settings(self, tuple(self.feature_layers))
    if any(not is_int(i) or not 1 <= i <= n for i in layers) or len(set(layers)) != len(layers):
      raise ValueError(
        f"feature_layers must be distinct layer counts in [1, {n}], got {self.feature_layers!r}."
      )
    # Ascending: `forward_cached` returns the layers' features in depth order, whatever
    # order they are asked in, so the config (and every layout written from it) says so.
    object.__setattr__(self, "feature_layers", tuple(sorted(layers)))
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
    if self.kind in ("eagle", "eagle3", "dflash") and self.feature_layers:
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


def dflash_feature_layers(n_layers: int, draft_layers: int) -> tuple[int, ...]:
  """The layer counts a block drafter of `draft_layers` layers reads on a target of
  `n_layers` (DFlash's rule, as counts: layer id i is count i + 1): one layer reads
  the middle; several read ids spread evenly from 1 to L - 3, rounded. On targets
  too shallow for that (L < 5), counts spread evenly over [1, L], distinct."""
  n, k = n_layers, draft_layers
  if k == 1:
    return (n // 2 + 1,)
  if n >= 5:
    ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    return tuple(sorted({i + 1 for i in ids}))
  return tuple(sorted({int(round(1 + i * (n - 1) / (k - 1))) for i in range(k)}))


def _check_dflash(cfg: HeadConfig, layers: tuple, n: int) -> tuple[int, ...]:
  """A block drafter's settings checked; its feature layers (defaulted)."""
  v = cfg.target.vocab_size
  if not is_int(cfg.block_size) or not 2 <= cfg.block_size <= 64:
    raise ValueError(f"block_size must be an int in [2, 64], got {cfg.block_size!r}.")
  if not is_int(cfg.draft_layers) or not 1 <= cfg.draft_layers <= 16:
    raise ValueError(f"draft_layers must be an int in [1, 16], got {cfg.draft_layers!r}.")
  if not is_int(cfg.mask_token_id) or not -1 <= cfg.mask_token_id < v:
    raise ValueError(
      f"mask_token_id must be an int in [0, {v}) or -1 (a learned mask embedding), "
      f"got {cfg.mask_token_id!r}."
    )
  return layers or dflash_feature_layers(n, cfg.draft_layers)


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

  @staticmethod
  def check_settings(cfg: HeadConfig, layers: tuple) -> tuple:
    """The kind's own settings of `cfg` checked (ValueError naming the field); its
    feature layers, defaulted (`HeadConfig.__post_init__` calls this)."""
    return layers

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

  @staticmethod
  def check_settings(cfg: HeadConfig, layers: tuple) -> tuple:
    if not is_int(cfg.num_heads) or not 1 <= cfg.num_heads <= 16:
      raise ValueError(f"num_heads must be an int in [1, 16], got {cfg.num_heads!r}.")
    return layers

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

  @staticmethod
  def check_settings(cfg: HeadConfig, layers: tuple) -> tuple:
    n = cfg.target.n_layers
    if not is_int(cfg.exit_layer) or not 1 <= cfg.exit_layer < n:
      raise ValueError(
        f"exit_layer must be an int in [1, {n - 1}] (the target has {n} layers), "
        f"got {cfg.exit_layer!r}."
      )
    return layers

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

  @staticmethod
  def check_settings(cfg: HeadConfig, layers: tuple) -> tuple:
    return _check_eagle3(cfg, layers, cfg.target.n_layers)

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


class DFlashLayer(nnx.Module):
  """One block-drafter layer: the block's queries read the context's keys and values
  (the fused target features, projected by this layer) and the whole block's own,
  bidirectionally; pre-norm attention with per-head q/k norms, then an MLP.

  Context and block keys go through the same `k_proj` and `k_norm` and RoPE at
  their own positions, so a cache of the context's keys (`context_kv`) serves
  every later block (`DFlashHead`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h = cfg.d_model, cfg.resolved_head_dim
    self.input_layernorm = Norm(cfg)
    self.q_proj = _linear(cfg, d, cfg.n_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.k_proj = _linear(cfg, d, cfg.n_kv_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.v_proj = _linear(cfg, d, cfg.n_kv_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.o_proj = _linear(cfg, cfg.n_heads * h, d, rngs=rngs, bias=cfg.out_bias)
    self.q_norm = Norm(cfg, h, "head_dim")
    self.k_norm = Norm(cfg, h, "head_dim")
    self.post_attention_layernorm = Norm(cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def context_kv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """Keys and values `[B, K, T, H]` of inputs `x [B, T, D]` at `positions [B, T]`."""
    (b, t, _), c = x.shape, self.cfg
    k = self.k_norm(self.k_proj(x).reshape(b, t, c.n_kv_heads, c.resolved_head_dim))
    k = apply_rope(k, positions, inv_freq)
    v = self.v_proj(x).reshape(b, t, c.n_kv_heads, c.resolved_head_dim)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def __call__(self, x, positions, context_k, context_v, mask, inv_freq):
    """Block `x [B, N, D]` at `positions [B, N]` -> `[B, N, D]`; it reads the context's
    `context_k, context_v [B, K, S, H]` and its own N keys, as `mask [B, N, S + N]`
    allows."""
    (b, n, _), c = x.shape, self.cfg
    normed = self.input_layernorm(x)
    q = self.q_norm(self.q_proj(normed).reshape(b, n, c.n_heads, c.resolved_head_dim))
    q = apply_rope(q, positions, inv_freq)
    k, v = self.context_kv(normed, positions, inv_freq)
    keys = jnp.concatenate([context_k.astype(k.dtype), k], axis=2)
    values = jnp.concatenate([context_v.astype(v.dtype), v], axis=2)
    out = attend(q, keys, values, mask, c.attn_scale)
    x = x + self.o_proj(out.reshape(b, n, c.n_heads * c.resolved_head_dim))
    return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nnx.Module):
  """A block drafter (DFlash): drafts the B - 1 tokens after s[-1] in one call.

  The target's features after `cfg.feature_layers` layers, concatenated `[.., F]`,
  become the context `hidden_norm(fc(f))` `[.., D]`; each layer keeps its own keys
  and values of the context (a `KVCache`, slot p: position p). The block is
  `[s[-1], m, ..., m]` at positions len(s) - 1 .. len(s) + B - 2 (m: the mask
  token's embedding); after the layers, `norm` and the target's own head give
  the law of the token at each of the B - 1 mask positions. Embeddings and head
  are the target's (shared, frozen); only this module trains.
  """

  @staticmethod
  def check_settings(cfg: HeadConfig, layers: tuple) -> tuple:
    return _check_dflash(cfg, layers, cfg.target.n_layers)

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    if cfg.kind != "dflash":
      raise ValueError(f"DFlashHead needs kind='dflash', got {cfg.kind!r}.")
    self.cfg = cfg
    c = self.layer_config
    d = c.d_model
    self.fc = _linear(c, cfg.num_features * d, d, rngs=rngs, bias=False)
    self.hidden_norm = Norm(c)
    self.layers = nnx.List([DFlashLayer(c, rngs=rngs) for _ in range(cfg.draft_layers)])
    self.norm = Norm(c)
    if cfg.mask_token_id < 0:  # no spare id in the target's vocabulary: a learned one
      init = nnx.initializers.normal(c.init_std)
      self.mask_embedding = nnx.Param(init(rngs.params(), (d,), c.weight_dtype))

  @property
  def layer_config(self) -> ModelConfig:
    """The layers' config: the target's widths, `cfg.d_ff`, RoPE at the target's
    base (for any target: the block's order comes from RoPE), global attention."""
    t = self.cfg.target
    local = None if t.local_layers is None else ()
    return t.replace(
      n_layers=self.cfg.draft_layers, d_ff=self.cfg.d_ff or t.d_ff, local_layers=local
    )

  def _inv_freq(self) -> jax.Array:
    c = self.layer_config
    return rope_inv_freq(c.resolved_head_dim, c.rope_theta, c.rope_scaling)

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty context cache: one layer of keys and values per drafter layer."""
    c = self.layer_config
    return KVCache.zeros(
      n_layers=self.cfg.draft_layers,
      batch=batch,
      capacity=capacity,
      n_kv_heads=c.n_kv_heads,
      head_dim=c.resolved_head_dim,
      dtype=c.compute_dtype,
    )

  def context(self, features: jax.Array) -> jax.Array:
    """The target's features `[..., F]` -> the context `[..., D]`."""
    return self.hidden_norm(self.fc(features.astype(self.fc.kernel.dtype)))

  def write_context(self, features: jax.Array, cache: KVCache, starts: jax.Array) -> KVCache:
    """`cache` with the context of `features [B, T, F]` (positions starts..starts+T-1)
    written at slots `starts [B]` of every layer; lengths unchanged (the caller's)."""
    x, t = self.context(features), features.shape[1]
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    inv_freq, new_k, new_v = self._inv_freq(), [], []
    for layer, k, v in zip(self.layers, cache.k, cache.v):
      ck, cv = layer.context_kv(x, positions, inv_freq)
      k, v, _ = write_layer((k, v), ck, cv, starts)
      new_k.append(k)
      new_v.append(v)
    return cache.replace(k=tuple(new_k), v=tuple(new_v))

  def block_inputs(self, target: Transformer, last: jax.Array, num_blocks: int = 1):
    """`[B, num_blocks * B_size, D]`: each block `[embed(last[:, j]), m, ..., m]`
    for `last [B, num_blocks]` (or `[B]`)."""
    last = last.reshape(last.shape[0], -1)
    b, a = last.shape
    first = target.embed(last)  # [B, A, D]
    if self.cfg.mask_token_id >= 0:
      mask = target.embed(jnp.asarray(self.cfg.mask_token_id, jnp.int32))
    else:
      mask = self.mask_embedding[...]
    n, d = self.cfg.block_size, first.shape[-1]
    mask = jnp.broadcast_to(mask.astype(first.dtype), (b, a, n - 1, d))
    return jnp.concatenate([first[:, :, None], mask], axis=2).reshape(b, a * n, d)

  def run(self, x, positions, context_kv, mask) -> jax.Array:
    """The layers on blocks `x [B, N, D]` at `positions [B, N]` reading each layer's
    `context_kv` pair as `mask [B, N, S + N]` allows -> normed `[B, N, D]`."""
    inv_freq = self._inv_freq()
    for layer, (k, v) in zip(self.layers, context_kv):
      x = layer(x, positions, k, v, mask, inv_freq)
    return self.norm(x)

  def logits(self, target: Transformer, h: jax.Array, vocab_subset=None) -> jax.Array:
    """Normed outputs `[..., D]` -> float32 logits `[..., V]` by the target's head
    (-inf off `vocab_subset [K]` when given: FR-Spec)."""
    return target.head_logits(h, vocab_subset)

  def draft_logits(
    self, target: Transformer, cache: KVCache, last: jax.Array, vocab_subset=None, count=None
  ) -> jax.Array:
    """Drafting: the block after each row's cached context (`cache.lengths` =
    len(s) - 1) and `last [B]` = s[-1] -> logits `[B, count, V]` of the tokens at
    positions len(s) .. len(s) + count - 1 (static `count`, default B_size - 1:
    the head projects only those)."""
    b, n = last.shape[0], self.cfg.block_size
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    context = slots[None, None, :] < cache.lengths[:, None, None]
    context = jnp.broadcast_to(context, (b, n, slots.size))
    mask = jnp.concatenate([context, jnp.ones((b, n, n), bool)], axis=2)
    h = self.run(self.block_inputs(target, last), positions, zip(cache.k, cache.v), mask)
    return self.logits(target, h[:, 1 : 1 + (count or n - 1)], vocab_subset)

  def __call__(self, target: Transformer, features, tokens, anchors) -> jax.Array:
    """Training form: A blocks per row in one call, each exactly as drafting sees it.

    Args:
      features: `[B, T, F]` the target's features at positions 0..T-1.
      tokens: `[B, T]` the tokens at those positions.
      anchors: `[B, A]` int32 in [1, T): block j starts with `tokens[:, a_j]` at
        position a_j and reads the context at positions < a_j.

    Returns:
      `[B, A, B_size - 1, V]` logits of the tokens at a_j + 1 .. a_j + B_size - 1.
    """
    (b, t), a, n = tokens.shape, anchors.shape[1], self.cfg.block_size
    x = self.context(features)
    inv_freq = self._inv_freq()
    ctx_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    context_kv = [layer.context_kv(x, ctx_positions, inv_freq) for layer in self.layers]
    last = jnp.take_along_axis(tokens, anchors, axis=1)
    positions = (anchors[:, :, None] + jnp.arange(n, dtype=jnp.int32)).reshape(b, a * n)
    block_of = jnp.repeat(jnp.arange(a), n)
    reads_context = jnp.arange(t)[None, None, :] < jnp.repeat(anchors, n, axis=1)[:, :, None]
    same_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (b, a * n, a * n))
    mask = jnp.concatenate([reads_context, same_block], axis=2)
    h = self.run(self.block_inputs(target, last, a), positions, context_kv, mask)
    return self.logits(target, h.reshape(b, a, n, -1)[:, :, 1:])


# The module of each head kind: the one table the model layer dispatches on.
HEAD_MODULES = {
  "eagle": EagleHead,
  "medusa": MedusaHeads,
  "early_exit": ExitAdapter,
  "eagle3": Eagle3Head,
  "dflash": DFlashHead,
}
HUB_MODULES = {"eagle": HubEagleHead, "medusa": HubMedusaHeads}
HEAD_KINDS = tuple(HEAD_MODULES)  # the kinds' names, in `HEAD_MODULES`' order


def make_head(cfg: HeadConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """A fresh head of `cfg.kind` (`HubEagleHead`, `HubMedusaHeads` with `normed_features`)."""
  return (HUB_MODULES if cfg.normed_features else HEAD_MODULES)[cfg.kind](cfg, rngs=rngs)

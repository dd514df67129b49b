"""Function-preserving expansion (Net2Net-style): a larger model computing the same function.

  cfg = expanded_config(model.cfg, d_model=2048, n_layers=22, n_kv_heads=8, ...)
  big = expand(model, cfg)          # big(tokens) == model(tokens) up to float rounding
  big_head = specjax.heads.expand_head(head, cfg)  # a draft head of `model`, for `big`

Used to measure speculative decoding at a real model's shape with a small
trained pair's acceptance (`pretrained.load_pair(scale=...)`). How each size
grows, the derived fields and the memory peak: docs/scaled_pairs.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.scan import unscan_model, with_layout
from specjax.models.transformer import Transformer
from specjax.validation import is_int

# Sizes that may grow (never shrink); head_dim is compared resolved.
SIZE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "head_dim")
# Fields whose new value follows from the base and the sizes (`expanded_config`).
DERIVED_FIELDS = ("norm_eps", "rope_theta", "rope_local_theta", "attn_scale", "local_layers")
# Fields that do not change the function: free to take any value.
FREE_FIELDS = ("dtype", "param_dtype", "init_std", "norm_offset", "scan_layers", "attention")
# Every other ModelConfig field must keep the base's value (`check_expansion`).
FIXED_FIELDS = tuple(
  f.name
  for f in dataclasses.fields(ModelConfig)
  if f.name not in SIZE_FIELDS + DERIVED_FIELDS + FREE_FIELDS
)
_REL_TOL = 1e-9  # float fields (eps, theta, scale) derived in float64


def layer_map(n_old: int, n_new: int) -> tuple[int, ...]:
  """Where each of `n_old` layers goes among `n_new >= n_old`: layer i to
  round(i * (n_new - 1) / (n_old - 1)) (halves up; first and last stay so), or 0
  for one layer."""
  for name, value in (("n_old", n_old), ("n_new", n_new)):
    if not is_int(value) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
  if n_new < n_old:
    raise ValueError(f"n_new ({n_new}) must be >= n_old ({n_old}): layers are never removed.")
  if n_old == 1:
    return (0,)
  # Integer arithmetic: round-half-up of i * (n_new - 1) / (n_old - 1).
  return tuple((2 * i * (n_new - 1) + n_old - 1) // (2 * (n_old - 1)) for i in range(n_old))


def expanded_layer_count(count: int, n_old: int, n_new: int) -> int:
  """A layer count of the old model ("after `count` layers", 1-based: EAGLE's
  feature_layers, early exit's exit_layer, layer skip's num_layers) -> the count
  after which the expanded model's residual stream is the same."""
  if not is_int(count) or not 1 <= count <= n_old:
    raise ValueError(f"count must be an integer in [1, {n_old}], got {count!r}.")
  return layer_map(n_old, n_new)[count - 1] + 1


def _effective_attn_scale(cfg: ModelConfig) -> float:
  return cfg.attn_scale if cfg.attn_scale is not None else cfg.resolved_head_dim**-0.5


def _derived(base: ModelConfig, d_model: int, head_dim: int, n_layers: int) -> dict:
  """The derived fields of an expansion of `base` to these sizes."""
  ratio = head_dim / base.resolved_head_dim
  derived = dict(
    norm_eps=base.norm_eps * base.d_model / d_model,
    rope_theta=base.rope_theta**ratio,
    rope_local_theta=None if base.rope_local_theta is None else base.rope_local_theta**ratio,
    attn_scale=base.attn_scale,
    local_layers=base.local_layers,
  )
  if head_dim != base.resolved_head_dim:
    derived["attn_scale"] = _effective_attn_scale(base)  # H^-0.5 would change with H
  if base.local_layers is not None and n_layers >= base.n_layers:
    moved = layer_map(base.n_layers, n_layers)
    derived["local_layers"] = tuple(moved[i] for i in base.local_layers)
  elif base.local_layers is not None:  # fewer layers: refused by check_expansion, by name
    derived["local_layers"] = None
  return derived


def expanded_config(base: ModelConfig, **fields) -> ModelConfig:
  """`base.replace(**fields)` (sizes and free fields) with the derived fields
  (`DERIVED_FIELDS`) set as an exact expansion needs.

  Raises:
    ValueError: a derived field passed in `fields`, or a config `check_expansion`
      refuses (naming the field).
  """
  given = sorted(set(fields) & set(DERIVED_FIELDS))
  if given:
    raise ValueError(
      f"expanded_config derives {', '.join(given)} from the base; do not pass "
      f"{'it' if len(given) == 1 else 'them'}."
    )
  # local_layers off while the sizes change: the base's may not fit a shrunk
  # n_layers (which check_expansion then names).
  sized = base.replace(**fields, local_layers=None)
  cfg = sized.replace(**_derived(base, sized.d_model, sized.resolved_head_dim, sized.n_layers))
  check_expansion(base, cfg)
  return cfg


def _field_error(field: str, message: str) -> ValueError:
  return ValueError(f"ModelConfig.{field}: {message}")


def check_expansion(base: ModelConfig, cfg: ModelConfig) -> None:
  """Raises ValueError, naming the ModelConfig field, unless `expand` can turn a
  model of `base` into one of `cfg` computing the same function."""
  for field in FIXED_FIELDS:
    old, new = getattr(base, field), getattr(cfg, field)
    if old != new:
      raise _field_error(field, f"an expansion keeps it ({old!r}), got {new!r}.")
  sizes = {f: getattr(base, f) for f in SIZE_FIELDS} | {"head_dim": base.resolved_head_dim}
  for field, old in sizes.items():
    new = cfg.resolved_head_dim if field == "head_dim" else getattr(cfg, field)
    if new < old:
      raise _field_error(field, f"an expansion never shrinks it: {old} -> {new}.")
  g_old, g_new = base.n_heads // base.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
  if g_new < g_old:
    raise _field_error(
      "n_heads",
      f"{cfg.n_heads} query heads over {cfg.n_kv_heads} kv heads make groups of {g_new}, "
      f"fewer than the base's {g_old} (n_heads must be >= {g_old} * n_kv_heads).",
    )
  d_old, d_new = base.d_model, cfg.d_model
  h_old, h_new = base.resolved_head_dim, cfg.resolved_head_dim
  if d_new != d_old and base.norm == "layernorm":
    raise _field_error(
      "norm",
      f"a layernorm model keeps d_model ({d_old}, got {d_new}): its mean-centering "
      "over the wider residual stream would subtract the old mean scaled by D/D'.",
    )
  if d_new != d_old and base.scale_embeddings:
    raise _field_error(
      "scale_embeddings",
      f"with scale_embeddings d_model stays {d_old} (got {d_new}): embeddings are "
      "multiplied by sqrt(d_model).",
    )
  if base.qk_norm and h_new * d_old != h_old * d_new:
    raise _field_error(
      "head_dim",
      f"with qk_norm, head_dim and d_model grow by the same factor (the q/k norms share "
      f"norm_eps, which scales by d_model): d_model {d_old} -> {d_new} needs head_dim "
      f"{h_old * d_new / d_old:g}, got {h_new}.",
    )
  _check_derived(base, cfg)


def _check_derived(base: ModelConfig, cfg: ModelConfig) -> None:
  """The derived fields of `cfg` are those of `expanded_config` (the local
  layers: each old layer's window at its new place; identities are free)."""
  want = _derived(base, cfg.d_model, cfg.resolved_head_dim, cfg.n_layers)
  for field in ("norm_eps", "rope_theta", "rope_local_theta"):
    old, new = want[field], getattr(cfg, field)
    if (old is None) != (new is None) or (
      old is not None and not math.isclose(old, new, rel_tol=_REL_TOL)
    ):
      raise _field_error(
        field, f"this expansion needs {old!r}, got {new!r} (expanded_config sets it)."
      )
  scale = _effective_attn_scale(base)
  if not math.isclose(_effective_attn_scale(cfg), scale, rel_tol=_REL_TOL):
    raise _field_error(
      "attn_scale",
      f"this expansion needs an effective score scale of {scale!r} (the base's), got "
      f"{cfg.attn_scale!r} with head_dim {cfg.resolved_head_dim} (expanded_config sets it).",
    )
  moved = layer_map(base.n_layers, cfg.n_layers)
  for i, j in enumerate(moved):
    if base.layer_window(i) != cfg.layer_window(j):
      raise _field_error(
        "local_layers",
        f"base layer {i} (window {base.layer_window(i)}) becomes layer {j}, whose window "
        f"is {cfg.layer_window(j)}; this expansion needs {want['local_layers']!r} "
        "(expanded_config sets it).",
      )


# -- building the new parameters


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The old and new sizes of each axis letter: V vocab, D d_model, S max_seq_len,
  K kv heads, G queries per kv head, H head dim, F d_ff; E EAGLE fc's 2D rows, X
  its `fuse`'s nf * D rows; J a kv head's G + 2 qkv_proj slots (queries, key,
  value), P gate_up_proj's (gate, up) pair."""

  old: ModelConfig
  new: ModelConfig
  num_features: int = 1

  def axis(self, letter: str) -> tuple[int, int, tuple[tuple[int, int, int], ...]]:
    """`(old size, new size, segments)`: each segment `(old start, length, new
    start)` is a contiguous run of old entries and where it goes."""
    o, n = self.old, self.new
    if letter in "EX":
      blocks = 2 if letter == "E" else self.num_features
      segments = tuple((b * o.d_model, o.d_model, b * n.d_model) for b in range(blocks))
      return blocks * o.d_model, blocks * n.d_model, segments
    if letter == "J":  # the queries grow at the end of the group; key and value follow
      g, g2 = o.n_heads // o.n_kv_heads, n.n_heads // n.n_kv_heads
      return g + 2, g2 + 2, ((0, g, 0), (g, 2, g2))
    if letter == "P":
      return 2, 2, ((0, 2, 0),)
    if letter == "H":
      h, h2 = o.resolved_head_dim, n.resolved_head_dim
      if o.positions != "rope":  # no rotation: the old dims go first (H may be odd)
        return h, h2, ((0, h, 0),)
      # Rotate-half RoPE pairs dim i with i + H/2: the halves move apart together.
      return h, h2, ((0, h // 2, 0), (h // 2, h // 2, h2 // 2))
    sizes = {
      "V": (o.vocab_size, n.vocab_size),
      "D": (o.d_model, n.d_model),
      "S": (o.max_seq_len, n.max_seq_len),
      "K": (o.n_kv_heads, n.n_kv_heads),
      "G": (o.n_heads // o.n_kv_heads, n.n_heads // n.n_kv_heads),
      "F": (o.d_ff, n.d_ff),
    }
    old, new = sizes[letter]
    return old, new, ((0, old, 0),)

  def norm_ratio(self, letter: str) -> float:
    """sqrt(old / new width): what an RMSNorm's multiplier is scaled by."""
    old, new, _ = self.axis(letter)
    return math.sqrt(old / new)


# Each parameter's axes, by its path inside a decoder block (the fused
# projections' columns as `specjax.models.fused` lays them out).
BLOCK_AXES = {
  ("attn", "qkv_proj", "kernel"): "DKJH",
  ("attn", "qkv_proj", "bias"): "KJH",
  ("attn", "o_proj", "kernel"): "KGHD",
  ("attn", "o_proj", "bias"): "D",
  ("attn", "q_norm", "scale"): "H",
  ("attn", "k_norm", "scale"): "H",
  ("mlp", "gate_up_proj", "kernel"): "DFP",
  ("mlp", "gate_up_proj", "bias"): "FP",
  ("mlp", "up_proj", "kernel"): "DF",  # GELU MLPs
  ("mlp", "up_proj", "bias"): "F",
  ("mlp", "down_proj", "kernel"): "FD",
  ("mlp", "down_proj", "bias"): "D",
}
for _norm in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
  BLOCK_AXES[(_norm, "scale")] = BLOCK_AXES[(_norm, "bias")] = "D"
# ... in a Transformer, outside its blocks, and in a draft head (besides its block).
_MODEL_AXES = {
  ("embed", "embedding"): "VD",
  ("pos_embed", "embedding"): "SD",
  ("lm_head",): "DV",
  ("final_norm", "scale"): "D",
  ("final_norm", "bias"): "D",
}
HEAD_AXES = {
  ("fc", "kernel"): "ED",
  ("fc", "bias"): "D",
  ("fuse", "kernel"): "XD",
  ("fuse", "bias"): "D",
  ("heads", "kernel"): "DD",  # residual head k's path is ("heads", k, ...): k dropped
  ("heads", "bias"): "D",
}


@functools.partial(jax.jit, static_argnames=("old_view", "new_view", "segments", "shape", "dtype"))
def _place(old, scale, shift, fill, *, old_view, new_view, segments, shape, dtype):
  """`old` viewed as `old_view`, times `scale` plus `shift`, placed by `segments`
  (per axis) into a `new_view` array filled with `fill`, in `dtype`, as `shape`."""
  values = old.reshape(old_view).astype(jnp.float32) * scale + shift
  new = jnp.full(new_view, fill, dtype)
  blocks = [((), ())]
  for axis_segments in segments:  # every combination of one segment per axis
    blocks = [
      (src + (slice(o, o + n),), dst + (d,)) for src, dst in blocks for o, n, d in axis_segments
    ]
  for src, dst in blocks:
    new = jax.lax.dynamic_update_slice(new, values[src].astype(dtype), dst)
  return new.reshape(shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _filled(value, *, shape, dtype):
  return jnp.full(shape, value, dtype)


def _grow(plan: _Plan, letters: str, old: jax.Array, shape, dtype, is_scale: bool) -> jax.Array:
  """One parameter of axes `letters`, grown from `old` to `shape` in `dtype`. A
  norm scale's multiplier (offset + scale) is multiplied by sqrt(old / new width),
  new entries included (they only multiply zeros)."""
  # "=": an axis that keeps its size (a head's own rank)
  axes = [
    (old.shape[i],) * 2 + (((0, old.shape[i], 0),),) if letter == "=" else plan.axis(letter)
    for i, letter in enumerate(letters)
  ]
  scale, shift, fill = 1.0, 0.0, 0.0
  if is_scale:
    ratio = plan.norm_ratio(letters)
    old_offset, new_offset = plan.old.norm_offset, plan.new.norm_offset
    scale, shift, fill = ratio, old_offset * ratio - new_offset, ratio - new_offset
  return _place(
    old,
    jnp.float32(scale),
    jnp.float32(shift),
    jnp.float32(fill),
    old_view=tuple(a[0] for a in axes),
    new_view=tuple(a[1] for a in axes),
    segments=tuple(a[2] for a in axes),
    shape=tuple(shape),
    dtype=jnp.dtype(dtype),
  )


def _identity(path: tuple, shape, dtype, offset: float) -> jax.Array:
  """A parameter of an identity block: zero, norm scales the identity (1 - offset)."""
  return _filled(
    jnp.float32(1.0 - offset if path[-1] == "scale" else 0.0), shape=shape, dtype=dtype
  )


def _fill(abstract: nnx.Module, value) -> nnx.Module:
  """`abstract` (from nnx.eval_shape) with each parameter `value(path, shape, dtype)`,
  built one at a time."""
  graphdef, state = nnx.split(abstract)
  flat = []
  for path, variable in nnx.to_flat_state(state):
    if not isinstance(variable, nnx.Param):
      raise TypeError(f"expansion handles parameters only; {path} is a {type(variable).__name__}.")
    spec = variable.get_value()
    flat.append((path, variable.replace(value(tuple(path), spec.shape, spec.dtype))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _old_params(module: nnx.Module) -> dict[tuple, jax.Array]:
  return {
    tuple(path): variable.get_value()
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param))
  }


def _block_param(plan: _Plan, rest: tuple, old: jax.Array, shape, dtype) -> jax.Array:
  """Parameter `rest` (its path inside a decoder block) grown from `old`."""
  if rest not in BLOCK_AXES:
    raise NotImplementedError(f"no expansion rule for block parameter {'.'.join(rest)}.")
  return _grow(plan, BLOCK_AXES[rest], old, shape, dtype, rest[-1] == "scale")


def expand(model: Transformer, cfg: ModelConfig) -> Transformer:
  """A new `Transformer` of config `cfg` (normally `expanded_config(model.cfg,
  **sizes)`) computing `model`'s function, up to float rounding. Old layer i is
  new layer `layer_map(L, L')[i]`.

  Raises:
    ValueError: `check_expansion(model.cfg, cfg)` fails (names the field).
  """
  check_expansion(model.cfg, cfg)
  # Grown in the unrolled layout (one path per layer), then stacked if cfg scans.
  model, scanned, cfg = unscan_model(model), cfg.scanned, cfg.replace(scan_layers=False)
  plan = _Plan(model.cfg, cfg)
  old = _old_params(model)
  source = {j: i for i, j in enumerate(layer_map(model.cfg.n_layers, cfg.n_layers))}

  def value(path, shape, dtype):
    if path[0] == "layers":
      i, rest = source.get(path[1]), path[2:]
      if i is None:
        return _identity(path, shape, dtype, cfg.norm_offset)
      return _block_param(plan, rest, old[("layers", i, *rest)], shape, dtype)
    if path not in _MODEL_AXES:
      raise NotImplementedError(f"no expansion rule for parameter {'.'.join(map(str, path))}.")
    return _grow(plan, _MODEL_AXES[path], old[path], shape, dtype, path[-1] == "scale")

  new = _fill(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), value)
  return with_layout(new, scanned)


# -- draft heads


def expand_head(head: nnx.Module, new_cfg, make, axes_of=None) -> nnx.Module:
  """A draft head's parameters grown to `new_cfg` (its config for the expanded target;
  `specjax.heads.expand_head` moves the layer counts and checks the kind's settings).

  Args:
    head: the head; `head.cfg` its config (`target`, `block_config`, `num_features`).
    new_cfg: the config of the expanded head.
    make: `(cfg, rngs) -> module`, the kind's constructor.
    axes_of: `path -> (plan, letters) | None`: how a parameter outside the head's
      `block` grows: plan "target" (the target's widths) or "block" (the head's own
      layer widths); None: `HEAD_AXES`' rules (fc, fuse and residual heads).

  Raises:
    ValueError: no exact expansion of the head's block.
    NotImplementedError: a parameter with no expansion rule.
  """
  old_cfg = head.cfg
  check_expansion(old_cfg.block_config, new_cfg.block_config)
  plans = {
    "target": _Plan(old_cfg.target, new_cfg.target, old_cfg.num_features),
    "block": _Plan(old_cfg.block_config, new_cfg.block_config),
  }
  old = _old_params(head)

  def value(path, shape, dtype):
    if path[0] == "block":
      return _block_param(plans["block"], path[1:], old[path], shape, dtype)
    rule = axes_of(path) if axes_of is not None else _default_head_axes(path)
    if rule is None:
      raise NotImplementedError(f"no expansion rule for head parameter {'.'.join(map(str, path))}.")
    plan, letters = rule
    return _grow(plans[plan], letters, old[path], shape, dtype, path[-1] == "scale")

  return _fill(nnx.eval_shape(lambda: make(new_cfg, rngs=nnx.Rngs(0))), value)


def _default_head_axes(path: tuple) -> tuple[str, str] | None:
  axes = HEAD_AXES.get((path[0], path[-1]))  # drops a residual head's index
  return None if axes is None else ("target", axes)

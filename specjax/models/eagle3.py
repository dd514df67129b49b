"""EAGLE-3's head (arXiv 2503.01840) as published heads lay it out (vLLM's and
SGLang's `llama_eagle3.py`): h = fc([f_a; f_b; f_c]) (3 target layers); h' = h +
attn(cat(input_layernorm(embed(x)), hidden_norm(h))) (q/k/v read 2D), then +
mlp(post_attention_layernorm(h')); q = softmax(lm_head(norm(h'))) over K draft
ids (target id d + d2t[d]), 0 elsewhere. h' is the next step's h.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.heads import HEAD_MODULES, EagleHead, HeadConfig, _linear, _own_logits
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import MLP, Attention, Norm, Transformer, run_blocks

ARCHITECTURE = "LlamaForCausalLMEagle3"
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def draft_vocab_ids(tokens, vocab_size: int, k: int) -> tuple[int, ...]:
  """The `k` most frequent ids of `tokens`, ascending (ties: the lower id)."""
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
  return tuple(sorted(int(i) for i in np.argsort(-counts, kind="stable")[:k]))


class Eagle3Layer(nnx.Module):
  """`[embed; h]` `[B, T, 2D]` -> h' `[B, T, D]`, called as a `Block` by `run_blocks`."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h = cfg.d_model, cfg.resolved_head_dim
    for name in _NORMS:
      setattr(self, name, Norm(cfg))
    self.attn = Attention(cfg.replace(d_model=2 * d, head_dim=h), rngs=rngs)
    self.attn.o_proj = _linear(cfg, cfg.n_heads * h, d, rngs=rngs)  # back to D wide
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
    self.fc = _linear(c, 3 * c.d_model, c.d_model, rngs=rngs)
    self.midlayer = Eagle3Layer(c, rngs=rngs)
    self.norm = Norm(c)
    self.lm_head = _linear(c, c.d_model, cfg.draft_vocab, rngs=rngs)

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


def warm_start(head: Eagle3Head, target: Transformer) -> Eagle3Head:
  """`head` with the target's final norm and head (at the draft ids); fc passes
  the highest layer on."""
  t, d = target, target.cfg.d_model
  ids = jnp.asarray(head.cfg.draft_ids or range(t.cfg.vocab_size))
  w = t.embed.embedding[...][ids].T if t.cfg.tie_embeddings else t.lm_head[...][:, ids]
  head.lm_head.kernel[...] = w.astype(head.lm_head.kernel.dtype)
  head.norm.scale[...] = jnp.copy(t.final_norm.scale[...])  # its own buffer: training donates it
  head.fc.kernel[...] = jnp.zeros((3 * d, d)).at[2 * d :].set(jnp.eye(d))
  return head


def _hub_params(head: Eagle3Head):
  """(hub name, parameter, fused part or None) for every tensor of the layout."""
  m, a = head.midlayer, "midlayer.self_attn."
  out = [("fc.weight", head.fc.kernel), ("norm.weight", head.norm.scale)]
  out += [("lm_head.weight", head.lm_head.kernel), (a + "o_proj.weight", m.attn.o_proj.kernel)]
  out += [("midlayer.mlp.down_proj.weight", m.mlp.down_proj.kernel)]
  out += [(f"midlayer.{n}.weight", getattr(m, n).scale) for n in _NORMS]
  out = [(*x, None) for x in out]
  out += [(f"{a}{p.name}.weight", m.attn.qkv_proj.kernel, p) for p in qkv_parts(m.attn.cfg)]
  mlp = m.mlp.gate_up_proj.kernel
  return out + [(f"midlayer.mlp.{p.name}.weight", mlp, p) for p in gate_up_parts(m.mlp.d_ff)]


def hub_config(head: Eagle3Head) -> dict:
  """The head's `config.json` in the `LlamaForCausalLMEagle3` layout. The aux layer
  ids are layer counts as vLLM reads them (SGLang adds 1 to explicit ids)."""
  from types import SimpleNamespace

  from specjax.hf.export import hf_config  # refuses what a Llama config cannot say

  c = head.cfg.block_config
  out = hf_config(SimpleNamespace(cfg=c), str(jnp.dtype(c.param_dtype)))
  out.update(
    architectures=[ARCHITECTURE],
    head_dim=c.resolved_head_dim,
    num_hidden_layers=1,
    tie_word_embeddings=False,
    draft_vocab_size=head.cfg.draft_vocab,
    target_hidden_size=c.d_model,
    eagle_config={
      "eagle_aux_hidden_state_layer_ids": list(head.cfg.feature_layers),
      "use_aux_hidden_state": True,
    },
  )
  return out


def hub_tensors(head: Eagle3Head) -> dict[str, np.ndarray]:
  """The head's tensors by published name, torch `[out, in]` layouts; `d2t`
  int64 `[K]` (target id = d + d2t[d]) and `t2d` bool `[V]`."""
  out = {}
  for name, param, part in _hub_params(head):
    w = np.asarray(param[...])
    w = w if part is None else part.take(w)
    out[name] = w if w.ndim == 1 else np.ascontiguousarray(w.T)
  ids = np.asarray(head.cfg.draft_ids or range(head.cfg.draft_vocab), np.int64)
  out["d2t"] = ids - np.arange(ids.size)
  out["t2d"] = np.zeros(head.cfg.target.vocab_size, bool)
  out["t2d"][ids] = True
  return out


def from_hub(
  config: dict, tensors: dict[str, np.ndarray], target: Transformer, dtype
) -> Eagle3Head:
  """An `Eagle3Head` for `target` from a `LlamaForCausalLMEagle3` config and its
  tensors (`hub_config`, `hub_tensors`); ValueError naming the field or tensor
  that does not fit `target`. `embed_tokens.weight` is ignored (the target's is used)."""
  t, name = target.cfg, str(jnp.dtype(dtype))
  if ARCHITECTURE not in config.get("architectures", []):
    raise ValueError(
      f"config architectures must include {ARCHITECTURE}, got {config.get('architectures')!r}."
    )
  want = dict(hidden_size=t.d_model, target_hidden_size=t.d_model, rms_norm_eps=t.norm_eps)
  want.update(rope_theta=t.rope_theta, num_hidden_layers=1, vocab_size=t.vocab_size)
  want.update(num_attention_heads=t.n_heads, num_key_value_heads=t.n_kv_heads)
  want.update(norm_before_residual=False)
  for key, value in {**want, "head_dim": t.resolved_head_dim}.items():
    if config.get(key, value) not in (value, None):
      raise ValueError(f"config {key} is {config[key]!r}; the target needs {value}.")
  layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
  tensors = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
  d2t = np.asarray(tensors.pop("d2t", np.zeros(config.get("draft_vocab_size") or t.vocab_size)))
  ids = np.arange(d2t.size) + d2t
  t2d, ff = tensors.pop("t2d", None), int(config.get("intermediate_size", t.d_ff))
  if t2d is not None and not np.array_equal(np.flatnonzero(t2d), ids):
    raise ValueError("tensor t2d does not mark the ids d2t maps to.")
  cfg = HeadConfig(
    "eagle3",
    t.replace(dtype=name, param_dtype=name),
    feature_layers=tuple(int(i) for i in layers),
    d_ff=ff * (ff != t.d_ff),  # 0: the target's
    draft_vocab_size=int(d2t.size),
    draft_ids=() if d2t.size == t.vocab_size and not d2t.any() else tuple(int(i) for i in ids),
  )
  head = Eagle3Head(cfg, rngs=nnx.Rngs(0))
  fused = {}
  for key, param, part in _hub_params(head):
    if key not in tensors:
      raise ValueError(f"tensor {key} is missing.")
    w = np.asarray(tensors.pop(key), np.float32)
    shape = param[...].shape if part is None else (*param[...].shape[:-1], part.width)
    w = w if w.ndim == 1 else w.T
    if w.shape != shape:
      raise ValueError(f"tensor {key} has shape {w.T.shape}; this target needs {shape[::-1]}.")
    if part is None:
      param[...] = jnp.asarray(w, dtype)
    else:
      buf = fused.setdefault(id(param), (param, np.zeros(param[...].shape, np.float32)))[1]
      part.put(buf, w)
  for param, buf in fused.values():
    param[...] = jnp.asarray(buf, dtype)
  if tensors:
    raise ValueError(f"tensors {sorted(tensors)} are not part of the EAGLE-3 layout.")
  return head


HEAD_MODULES["eagle3"] = Eagle3Head

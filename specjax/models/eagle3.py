"""EAGLE-3's draft head (Li et al. 2025, arXiv 2503.01840), as published heads
(`LlamaForCausalLMEagle3`: vLLM's and SGLang's `llama_eagle3.py`) lay it out.

  h_0 = fc([f_a; f_b; f_c])            the target's residual stream after three
                                       layer counts (`feature_layers`), [3D] -> [D]
  x   = cat(input_layernorm(embed(t)), hidden_norm(h))   [2D]: q/k/v read 2D
  h'  = h + attn(x);  h' = h' + mlp(post_attention_layernorm(h'))
  q   = softmax(lm_head(norm(h')))     over K draft ids; draft id d is target
                                       id d + d2t[d], every other id has q = 0

h' (before `norm`) is the next step's h: `fc` reads only the target's features.
The embedding is the target's own. Draft ids are the K most frequent target ids
(`draft_vocab_ids`), ascending, as SpecForge maps them; K = V is the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.heads import EagleHead, HeadConfig, _linear
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import MLP, Attention, Norm, Transformer, run_blocks

ARCHITECTURE = "LlamaForCausalLMEagle3"


def draft_vocab_ids(tokens, vocab_size: int, k: int) -> tuple[int, ...]:
  """The `k` most frequent ids of `tokens` (any int array), ascending; ties go
  to the lower id, so the result is a pure function of the counts."""
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
  return tuple(sorted(int(i) for i in np.argsort(-counts, kind="stable")[:k]))


class Eagle3Layer(nnx.Module):
  """The head's decoder layer; called as a `Block` by `run_blocks` on
  `[embed; h]` `[B, T, 2D]`, it returns h' `[B, T, D]`."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h = cfg.d_model, cfg.resolved_head_dim
    self.input_layernorm, self.hidden_norm = Norm(cfg), Norm(cfg)
    self.attn = Attention(cfg.replace(d_model=2 * d, head_dim=h), rngs=rngs)
    self.attn.o_proj = _linear(cfg, cfg.n_heads * h, d, rngs=rngs)  # back to D wide
    self.post_attention_layernorm = Norm(cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, masks, layer_cache, starts, inv_freq=None, contiguous=True):
    emb, h = jnp.split(x, 2, axis=-1)
    x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
    out, layer_cache = self.attn(x, positions, masks, layer_cache, starts, inv_freq, contiguous)
    h = h + out
    return h + self.mlp(self.post_attention_layernorm(h)), layer_cache


class Eagle3Head(nnx.Module):
  """EAGLE-3 (module docstring); the interface of `EagleHead` for `EagleDrafter`,
  plus `logits`, its own law over the target's vocabulary."""

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
    if vocab_subset is not None:
      keep = jnp.zeros(x.shape[-1], bool).at[vocab_subset].set(True)
      x = jnp.where(keep, x, -jnp.inf)
    return x


def _hub_params(head: Eagle3Head):
  """(hub name, parameter, fused part or None) for every tensor of the layout."""
  m = head.midlayer
  out = [("fc.weight", head.fc.kernel, None), ("norm.weight", head.norm.scale, None)]
  out += [("lm_head.weight", head.lm_head.kernel, None)]
  for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
    out.append((f"midlayer.{name}.weight", getattr(m, name).scale, None))
  out += [("midlayer.self_attn.o_proj.weight", m.attn.o_proj.kernel, None)]
  out += [
    (f"midlayer.self_attn.{p.name}.weight", m.attn.qkv_proj.kernel, p)
    for p in qkv_parts(m.attn.cfg)
  ]
  out += [
    (f"midlayer.mlp.{p.name}.weight", m.mlp.gate_up_proj.kernel, p)
    for p in gate_up_parts(m.mlp.d_ff)
  ]
  return out + [("midlayer.mlp.down_proj.weight", m.mlp.down_proj.kernel, None)]


def hub_config(head: Eagle3Head) -> dict:
  """The head's `config.json` in the `LlamaForCausalLMEagle3` layout. The aux layer
  ids are layer counts as vLLM reads them (SGLang adds 1 to explicit ids)."""
  from types import SimpleNamespace

  from specjax.hf.export import hf_config  # refuses what a Llama config cannot say

  c = head.cfg.block_config
  out = hf_config(SimpleNamespace(cfg=c), str(jnp.dtype(c.param_dtype)))
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    out.pop(key)
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
  want = {
    "hidden_size": t.d_model,
    "target_hidden_size": t.d_model,
    "rms_norm_eps": t.norm_eps,
    "rope_theta": t.rope_theta,
    "num_hidden_layers": 1,
    "vocab_size": t.vocab_size,
    "num_attention_heads": t.n_heads,
    "num_key_value_heads": t.n_kv_heads,
    "head_dim": t.resolved_head_dim,
  }
  for key, value in want.items():
    if config.get(key, value) not in (value, None):
      raise ValueError(f"config {key} is {config[key]!r}; the target needs {value}.")
  layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
  tensors = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
  d2t = np.asarray(
    tensors.pop("d2t", np.zeros(int(config.get("draft_vocab_size") or t.vocab_size)))
  )
  ids = np.arange(d2t.size) + d2t
  t2d = tensors.pop("t2d", None)
  if t2d is not None and not np.array_equal(np.flatnonzero(t2d), ids):
    raise ValueError("tensor t2d does not mark the ids d2t maps to.")
  cfg = HeadConfig(
    "eagle3",
    t.replace(dtype=name, param_dtype=name),
    feature_layers=tuple(int(i) for i in layers),
    d_ff=0
    if int(config.get("intermediate_size", t.d_ff)) == t.d_ff
    else int(config["intermediate_size"]),
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

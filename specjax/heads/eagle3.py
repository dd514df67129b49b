"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840), everything it is: settings
(`Eagle3Config`), module (`Eagle3Head`, `Eagle3Layer`), its draft ids and warm start,
its hub layout (`LlamaForCausalLMEagle3` as vLLM and SGLang load it), its training
objective (the training-time test, `ttt_unroll`) and record. It drafts through
`specjax.heads.eagle.EagleDrafter`, as EAGLE's head does.

The head as published heads lay it out (vLLM's and SGLang's `llama_eagle3.py`): h =
fc([f_a; f_b; f_c]) (3 target layers); h' = h + attn(cat(input_layernorm(embed(x)),
hidden_norm(h))) (q/k/v read 2D), then + mlp(post_attention_layernorm(h')); q =
softmax(lm_head(norm(h'))) over K draft ids (target id d + d2t[d]), 0 elsewhere. h' is
the next step's h.

The layout's biases are the midlayer's: q/k/v/o together (`attention_bias`) and the
MLP's (`mlp_bias`), as the engines' `LlamaAttention` and `LlamaMLP` read them; `fc` and
`lm_head` have none there, nor in `Eagle3Head`. `hub_tensors` writes the midlayer's
biases where the target's blocks have them (zeros for the rest of q/k/v/o when one
of them has one), so that export then import computes the same function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import losses
from specjax.heads import hub
from specjax.heads.base import (
  HeadConfig,
  HeadConfigError,
  HeadKind,
  LossSettings,
  TrainingRules,
  linear,
  one_layer_cache,
  own_logits,
)
from specjax.heads.eagle import EagleDrafter
from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.hub_config import llama_config  # refuses what a Llama config cannot say
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import MLP, Attention, Norm, Transformer, run_blocks
from specjax.validation import is_int

ARCHITECTURE = "LlamaForCausalLMEagle3"
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")  # its layer's


@dataclasses.dataclass(frozen=True)
class Eagle3Config(HeadConfig):
  """An EAGLE-3 head's settings (besides `HeadConfig`'s).

  `feature_layers`: exactly three; `()` picks vLLM's (2, L//2, L-3) when those are
  three increasing counts (L >= 7), else (1, (L+1)//2, L).

  Attributes:
    draft_vocab_size: its draft vocabulary K in [1, V]; 0 means V.
    draft_ids: its K target ids, ascending (`draft_vocab_ids`); `()`: the identity
      (K = V), or not yet counted.
  """

  kind = "eagle3"

  draft_vocab_size: int = 0
  draft_ids: tuple[int, ...] = ()

  def check_settings(self, layers):
    n = self.target.n_layers
    v, k, ids = self.target.vocab_size, self.draft_vocab_size, tuple(self.draft_ids)
    if not is_int(k) or not 0 <= k <= v:
      raise HeadConfigError(f"draft_vocab_size must be an int in [0, {v}] (0: {v}), got {k!r}.")
    if ids and (
      len(ids) != (k or v) or list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < v
    ):
      raise HeadConfigError(
        f"draft_ids must be draft_vocab_size={k or v} ascending distinct ids in [0, {v})."
      )
    object.__setattr__(self, "draft_ids", tuple(map(int, ids)) if len(ids) < v else ())
    if not layers:
      layers = (2, n // 2, n - 3) if n >= 7 else (1, (n + 1) // 2, n)
    if len(layers) != 3:
      raise HeadConfigError(f"feature_layers must be 3 layer counts for eagle3, got {layers!r}.")
    return layers

  @property
  def draft_vocab(self) -> int:
    """The draft vocabulary size K."""
    return self.draft_vocab_size or self.target.vocab_size


class Eagle3Layer(nnx.Module):
  """`[embed; h]` `[B, T, 2D]` -> h' `[B, T, D]`, called as a `Block` by `run_blocks`."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h = cfg.d_model, cfg.resolved_head_dim
    for name in _NORMS:
      setattr(self, name, Norm(cfg))
    self.attn = Attention(cfg.replace(d_model=2 * d, head_dim=h), rngs=rngs)
    # Back to D wide; a bias only where the target's blocks have one (the hub layout's
    # attention_bias), as vLLM's and SGLang's LlamaForCausalLMEagle3 build it.
    self.attn.o_proj = linear(cfg, cfg.n_heads * h, d, rngs=rngs, bias=cfg.out_bias)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, masks, layer_cache, starts, inv_freq=None, contiguous=True):
    emb, h = jnp.split(x, 2, axis=-1)
    x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
    out, layer_cache = self.attn(x, positions, masks, layer_cache, starts, inv_freq, contiguous)
    h = h + out
    return h + self.mlp(self.post_attention_layernorm(h)), layer_cache


class Eagle3Head(nnx.Module):
  """EAGLE-3, for `EagleDrafter` as `EagleHead` is, with its own `logits`."""

  def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs):
    if not isinstance(cfg, Eagle3Config):
      raise ValueError(f"Eagle3Head needs an Eagle3Config, got {type(cfg).__name__}.")
    if len(cfg.draft_ids or range(cfg.target.vocab_size)) != cfg.draft_vocab:
      raise ValueError(f"cfg.draft_ids must hold {cfg.draft_vocab} ids (draft_vocab_ids).")
    self.cfg = cfg
    c = cfg.block_config
    # No fc or lm_head bias: the published layout has none, so a trained head
    # exports whole (its hub layout, below).
    self.fc = linear(c, 3 * c.d_model, c.d_model, rngs=rngs, bias=False)
    self.midlayer = Eagle3Layer(c, rngs=rngs)
    self.norm = Norm(c)
    self.lm_head = linear(c, c.d_model, cfg.draft_vocab, rngs=rngs, bias=False)

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty cache of its one decoder layer."""
    return one_layer_cache(self.cfg, batch, capacity)

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
    return own_logits(x, vocab_subset)


def draft_vocab_ids(tokens, vocab_size: int, k: int) -> tuple[int, ...]:
  """The `k` most frequent ids of `tokens`, ascending (ties: the lower id)."""
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
  return tuple(sorted(int(i) for i in np.argsort(-counts, kind="stable")[:k]))


def warm_start(head: Eagle3Head, target: Transformer, settings=None, load=None) -> Eagle3Head:
  """`head` with the target's final norm and head (at the draft ids); fc passes
  the highest layer on."""
  del settings, load  # nothing of config.head: the start is the target's own
  t, d = target, target.cfg.d_model
  ids = jnp.asarray(head.cfg.draft_ids or range(t.cfg.vocab_size))
  w = t.embed.embedding[...][ids].T if t.cfg.tie_embeddings else t.lm_head[...][:, ids]
  head.lm_head.kernel[...] = w.astype(head.lm_head.kernel.dtype)
  head.norm.scale[...] = jnp.copy(t.final_norm.scale[...])  # its own buffer: training donates it
  head.fc.kernel[...] = jnp.zeros((3 * d, d)).at[2 * d :].set(jnp.eye(d))
  return head


# -- the hub layout (vLLM's and SGLang's LlamaForCausalLMEagle3)


def recognises(config: dict, file: str, keys: Collection[str]) -> bool:
  """Whether a head directory's config.json and tensor names are this layout's."""
  del file
  return "draft_vocab_size" in config or any(k.startswith("midlayer.") for k in keys)


def write(head: Eagle3Head, target: Transformer | None = None) -> tuple[dict, dict]:
  """`(config.json, {name: tensor})` of the head in this layout (`hub_config`,
  `hub_tensors`: every parameter of the head); `target` is unused."""
  del target
  return hub_config(head), hub_tensors(head)


def _hub_params(head: Eagle3Head):
  """(hub name, parameter, fused part or None) for every tensor of the layout the
  head has: the weights, and the midlayer's biases where its modules carry them
  (with the target's `qkv_bias`, `out_bias`, `mlp_bias`)."""
  m, a, mlp = head.midlayer, "midlayer.self_attn.", "midlayer.mlp."
  out = [("fc.weight", head.fc.kernel), ("norm.weight", head.norm.scale)]
  out += [("lm_head.weight", head.lm_head.kernel), (a + "o_proj.weight", m.attn.o_proj.kernel)]
  out += [(mlp + "down_proj.weight", m.mlp.down_proj.kernel)]
  out += [(f"midlayer.{n}.weight", getattr(m, n).scale) for n in _NORMS]
  if m.attn.o_proj.bias is not None:
    out += [(a + "o_proj.bias", m.attn.o_proj.bias)]
  if m.mlp.down_proj.bias is not None:
    out += [(mlp + "down_proj.bias", m.mlp.down_proj.bias)]
  out = [(*x, None) for x in out]
  for kind, qkv in (("weight", m.attn.qkv_proj.kernel), ("bias", m.attn.qkv_proj.bias)):
    out += [(f"{a}{p.name}.{kind}", qkv, p) for p in qkv_parts(m.attn.cfg) if qkv is not None]
  for kind, gate_up in (("weight", m.mlp.gate_up_proj.kernel), ("bias", m.mlp.gate_up_proj.bias)):
    parts = gate_up_parts(m.mlp.d_ff) if gate_up is not None else ()
    out += [(f"{mlp}{p.name}.{kind}", gate_up, p) for p in parts]
  return out


def _attention_bias(head: Eagle3Head) -> bool:
  """Whether the layout's `attention_bias` (q/k/v/o together) must be true."""
  attn = head.midlayer.attn
  return attn.qkv_proj.bias is not None or attn.o_proj.bias is not None


def hub_config(head: Eagle3Head) -> dict:
  """The head's `config.json` in the `LlamaForCausalLMEagle3` layout. The aux layer
  ids are layer counts as vLLM reads them (SGLang adds 1 to explicit ids)."""
  bias = _attention_bias(head)  # the layout says q/k/v/o biases in one flag
  c = head.cfg.block_config.replace(qkv_bias=bias, out_bias=bias)
  out = llama_config(c, str(jnp.dtype(c.param_dtype)))
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
  int64 `[K]` (target id = d + d2t[d]) and `t2d` bool `[V]`: every parameter of the
  head (its `fc` and `lm_head` have no bias, as in the layout)."""
  out, bias = {}, _attention_bias(head)
  for name, param, part in _hub_params(head):
    w = np.asarray(param[...])
    w = w if part is None else part.take(w)
    out[name] = w if w.ndim == 1 else np.ascontiguousarray(w.T)
  attn, a = head.midlayer.attn, "midlayer.self_attn."
  if bias:  # the engines read q/k/v/o biases together: zeros for those the head lacks
    widths = [(f"{a}{p.name}.bias", p.width) for p in qkv_parts(attn.cfg)]
    widths += [(f"{a}o_proj.bias", head.cfg.target.d_model)]
    dtype = np.asarray(head.fc.kernel[...]).dtype
    out.update({k: np.zeros(w, dtype) for k, w in widths if k not in out})
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
  that does not fit `target`. `embed_tokens.weight` is ignored (the target's is used);
  an absent bias is zero, and a bias this target's modules lack must be zero."""
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
  cfg = Eagle3Config(
    t.replace(dtype=name, param_dtype=name),
    feature_layers=tuple(int(i) for i in layers),
    d_ff=ff * (ff != t.d_ff),  # 0: the target's
    draft_vocab_size=int(d2t.size),
    draft_ids=() if d2t.size == t.vocab_size and not d2t.any() else tuple(int(i) for i in ids),
  )
  head = Eagle3Head(cfg, rngs=nnx.Rngs(0))
  fused = {}
  for key, param, part in _hub_params(head):
    if key not in tensors and key.endswith(".bias"):
      tensors[key] = np.zeros(param[...].shape[-1] if part is None else part.width, np.float32)
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
  # Biases of zeros the head has no parameter for compute nothing (q/k/v's, written
  # beside a target's o_proj bias); any other leftover would be dropped: refused.
  tensors = {k: v for k, v in tensors.items() if not (k.endswith(".bias") and not np.any(v))}
  if tensors:
    raise ValueError(f"tensors {sorted(tensors)} are not part of the EAGLE-3 layout.")
  return head


# -- training


def with_draft_ids(cfg: Eagle3Config, saved=None, tokens=None) -> Eagle3Config:
  """`cfg` with EAGLE-3's draft ids where it lacks them: a resumed run's own (`saved`,
  the head config it saved), else `draft_vocab_ids` of the first 2**26 `tokens` (the
  training split's)."""
  if cfg.draft_ids or cfg.draft_vocab == cfg.target.vocab_size:
    return cfg
  if isinstance(saved, Eagle3Config) and saved.draft_vocab == cfg.draft_vocab:
    return dataclasses.replace(cfg, draft_ids=saved.draft_ids)
  if tokens is None:
    return cfg
  ids = draft_vocab_ids(tokens[: 1 << 26], cfg.target.vocab_size, cfg.draft_vocab)
  return dataclasses.replace(cfg, draft_ids=ids)


def _ttt_mask(n: int, steps: int, j: int) -> jax.Array:
  """`[n - j, steps * n]`: step j's row t reads step 0's rows <= t and steps 1..j's
  row t (slot i * n + s: step i's row s), the cache drafting has."""
  t = jnp.arange(n - j)[:, None]
  step, row = jnp.arange(steps * n) // n, jnp.arange(steps * n) % n
  return ((step == 0) & (row <= t)) | ((step >= 1) & (step <= j) & (row == t))


def ttt_unroll(head, target, inputs: jax.Array, features: jax.Array, steps: int) -> list:
  """EAGLE-3's training-time test on `inputs [B, T]`, `features [B, T, 3D]`: step
  j's h' `[B, T - 1 - j, D]`; row r at position r + j, read with token r + 1 + j,
  is drafting's j-th step after position r (step 0 reads the target's features)."""
  b, n = inputs.shape[0], inputs.shape[1] - 1
  h, c = head.feature_space(features[:, :n]), head.midlayer.attn.cfg
  zeros = jnp.zeros((b, c.n_kv_heads, steps * n, c.resolved_head_dim), h.dtype)
  kv, out = (zeros, zeros), []
  for j in range(steps):
    m = n - j
    x = head.layer_input(target, h[:, :m], inputs[:, 1 + j : 1 + j + m])
    positions = jnp.broadcast_to(jnp.arange(m) + j, (b, m))
    mask = jnp.broadcast_to(_ttt_mask(n, steps, j), (b, m, steps * n))
    starts = jnp.full((b,), j * n, jnp.int32)
    h, kv = head.midlayer(x, positions, mask, kv, starts, contiguous=False)
    out.append(h)
  return out


def eagle3_objective(head, target, batch, key, *, loss, settings):
  """EAGLE-3's training-time test, `ttt_steps` steps: step j's law over the draft ids
  (`ttt_unroll`) against the target's at t + 1 + j gathered on them and renormalised,
  positions whose target argmax lies off them left out (SpecForge); loss sum_j 0.8**j *
  divergence_j; alpha_t0_step{j}, alpha_t1_step{j} against the full law."""
  del key
  inputs, v = batch[:, :-1], target.cfg.vocab_size
  p_logits, features = losses.target_outputs(target, inputs, head.cfg.target_features)
  ids = jnp.asarray(head.cfg.draft_ids or range(v), jnp.int32)  # draft id -> target id
  in_vocab = jnp.zeros(v, bool).at[ids].set(True)
  value, metrics = 0.0, {}
  for j, h in enumerate(ttt_unroll(head, target, inputs, features, settings.ttt_steps)):
    m = h.shape[1]
    log_q = jax.nn.log_softmax(head.draft_logits(h))  # [B, m, K]
    p_full = p_logits[:, 1 + j : 1 + j + m]
    log_p = jax.nn.log_softmax(p_full[..., ids])  # renormalised on the draft ids
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    div = 0.0
    if "kl" in loss:
      div = div + (p * (log_p - log_q)).sum(-1)
    if "tv" in loss:
      div = div + 0.5 * jnp.abs(p - q).sum(-1)
    value = value + 0.8**j * jnp.mean(div * in_vocab[p_full.argmax(-1)])
    metrics[f"alpha_t0_step{j}"] = jnp.mean(ids[log_q.argmax(-1)] == p_full.argmax(-1))
    p_true = jax.nn.softmax(p_full)[..., ids]
    metrics[f"alpha_t1_step{j}"] = jnp.mean(jnp.minimum(p_true, q).sum(-1))
    if j == 0:  # the head's cross-entropy on the corpus, over the labels it can draft
      labels = batch[:, 2 : 2 + m]
      draft_of = jnp.zeros(v, jnp.int32).at[ids].set(jnp.arange(ids.size))
      nll = -jnp.take_along_axis(log_q, draft_of[labels][..., None], -1)[..., 0]
      ok = in_vocab[labels]
      metrics["ce"] = jnp.sum(nll * ok) / jnp.maximum(ok.sum(), 1)
  metrics.update(distill=value, alpha_t0=metrics["alpha_t0_step0"])
  metrics["alpha_t1"] = metrics["alpha_t1_step0"]
  return value, metrics


def _check_training(config) -> None:
  ttt = config.head.get("ttt_steps", 7)
  if not is_int(ttt) or not 1 <= ttt <= min(16, config.seq_len - 1):
    raise ValueError(
      f"config.head.ttt_steps must be an int in [1, {min(16, config.seq_len - 1)}], got {ttt!r}."
    )


@dataclasses.dataclass(frozen=True)
class Eagle3Loss(LossSettings):
  """EAGLE-3's objective settings (`config.head`).

  Attributes:
    ttt_steps: the training-time test's steps unrolled on the head's own outputs.
  """

  ttt_steps: int = 7

  @classmethod
  def from_config(cls, head) -> Eagle3Loss:
    return cls(ttt_steps=int(head.get("ttt_steps", cls.ttt_steps)))


KIND = HeadKind(
  name="eagle3",
  title="EAGLE-3 head",
  config=Eagle3Config,
  make=Eagle3Head,
  drafter=EagleDrafter,  # its own `logits`, EAGLE's drafting
  holds="head",
  objective=eagle3_objective,
  hub=hub.HubLayout(f"{ARCHITECTURE} (vLLM, SGLang)", hub.LLAMA_FILES, recognises, from_hub, write),
  read_priority=1,
  training=TrainingRules(
    fields=("feature_layers", "d_ff", "draft_vocab_size"),
    check=_check_training,
    loss=Eagle3Loss,
    prepare=with_draft_ids,
    warm_start=warm_start,
  ),
  drafts_as="eagle",
  bundled=False,
)

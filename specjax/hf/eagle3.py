"""EAGLE-3's hub layout, `LlamaForCausalLMEagle3` as vLLM and SGLang load it
(`llama_eagle3.py`): `write` (`hub_config`, `hub_tensors`) writes it, `from_hub` reads
it and `recognises` tells it apart. The module is `specjax.models.heads.Eagle3Head`.

The layout's biases are the midlayer's: q/k/v/o together (`attention_bias`) and the
MLP's (`mlp_bias`), as the engines' `LlamaAttention` and `LlamaMLP` read them; `fc` and
`lm_head` have none there, nor in `Eagle3Head`. `hub_tensors` writes the midlayer's
biases where the target's blocks have them (zeros for the rest of q/k/v/o when one
of them has one), so that export then import computes the same function.
"""

from __future__ import annotations

from collections.abc import Collection
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.hf.export import hf_config  # refuses what a Llama config cannot say
from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.heads import _NORMS, Eagle3Head, HeadConfig
from specjax.models.transformer import Transformer

ARCHITECTURE = "LlamaForCausalLMEagle3"


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

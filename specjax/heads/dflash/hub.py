"""The block drafter's hub layout: z-lab/dflash's `DFlashDraftModel`.

`DFlashDraftModel` as z-lab/dflash publishes it (a Qwen3 config; `model/dflash.py`,
`dflash/model.py`): `write` writes it, `from_hub` reads it and `recognises` tells it
apart. The module is `DFlashHead` (`model.py`).
DSpark's layout (`specjax.heads.dspark`) is built on this one: it reads the drafter's
fields and tensors through `hub_fields` and `read_hub_head` (its own `HubSpelling`:
architectures and config objects) and writes them through `hub_tensors`.

The file holds the drafter's own layers: `fc.weight`, `hidden_norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight` (`.bias` with `attention_bias`),
`layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.{input,post_attention}_layernorm.weight` and `norm.weight`, torch `[out, in]`.
The block's embeddings and the logits are the target's (`embed_tokens`, `lm_head`),
as in `DFlashHead`. config.json: Qwen3Config's fields for the layers (`num_hidden_layers`
is the drafter's), `num_target_layers`, `block_size`, and `dflash_config`'s
`mask_token_id` and `target_layer_ids`: 0-based ids of the target layers whose outputs
are read (transformers' `hidden_states[id + 1]`), concatenated in that order for `fc`,
where specjax's `feature_layers` are counts of layers (count = id + 1) and the target
hands a head its features in depth order: ids are written ascending, and a file's
ids in another order are read with `fc`'s input blocks put in depth order.

Writing never drops a parameter: what the layout cannot hold is refused, naming it.
  - a learned mask embedding (`mask_token_id=-1`): the layout fills the block with the
    target's embedding of `mask_token_id`, an id; there is no tensor for one;
  - MLP biases that are not zero: Qwen3's MLP has none;
  - layers the Qwen3 ones do not compute: LayerNorm, `norm_offset`, GeGLU or GELU
    MLPs, an attention scale other than head_dim ** -0.5.
The layout says q/k/v/o biases with one flag (`attention_bias`): a head whose target
has some of them gets zeros for the others, which compute nothing; reading, a bias the
target's layers lack must be zero. A target's `logit_softcap` is written as
`dflash_config.final_logit_softcapping`, which the reference applies to its logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.heads import hub as shared_hub
from specjax.heads.dflash.model import DFlashConfig, DFlashHead
from specjax.models import hub_names
from specjax.models.config import ModelConfig
from specjax.models.fused import gate_up_parts
from specjax.models.hub_config import rope
from specjax.models.transformer import Transformer
from specjax.validation import is_int

ARCHITECTURE = "DFlashDraftModel"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Qwen3Config's values for fields a config.json leaves out (transformers' defaults).
_QWEN3_DEFAULTS = dict(num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, hidden_act="silu")


@dataclasses.dataclass(frozen=True)
class HubSpelling:
  """Where a layout built on `DFlashDraftModel`'s keeps its drafter's names: the
  `architectures` it reads (the first is written) and the config.json objects its
  drafter fields (`mask_token_id`, `target_layer_ids`, `block_size`, ...) are looked
  up in, in order, before the top level (the reference runtimes' lookups)."""

  architectures: tuple[str, ...]
  sections: tuple[str, ...]

  def lookup(self, config: dict, key: str, default=None) -> tuple:
    """`(value, where)`: the first section's `key`, else the top level's, else
    `default`; `where` names it as messages do ("dflash_config.mask_token_id")."""
    for section in self.sections:
      if key in (config.get(section) or {}):
        return config[section][key], f"{section}.{key}"
    if key in config:
      return config[key], key
    return default, f"{self.sections[0]}.{key}"


DFLASH_SPELLING = HubSpelling((ARCHITECTURE,), ("dflash_config",))


def recognises(config: dict, file: str, keys: Collection[str]) -> bool:
  """Whether a head directory's config.json is a DFlash drafter's (any of them:
  `from_hub` names the architectures it does not read), and not a DSpark one
  (`specjax.heads.dspark`: DFlash's fields and tensors plus a Markov and a confidence
  head, which a DFlash head would drop)."""
  if derived_layout(config, keys):
    return False
  architectures = config.get("architectures") or []  # tensors: EAGLE-1's names too (fc.weight)
  return "dflash_config" in config or any(str(a).startswith("DFlash") for a in architectures)


def derived_layout(config: dict, keys: Collection[str]) -> bool:
  """Whether a DFlash-shaped head directory is DSpark's (`specjax.heads.dspark`, which
  extends this layout with a Markov and a confidence head a DFlash head would drop): a
  `dspark_config`, a DSpark architecture, or Markov / confidence tensors."""
  architectures = [str(a) for a in config.get("architectures") or []]
  return (
    "dspark_config" in config
    or any("DSpark" in a for a in architectures)
    or any(k.startswith(("markov_head.", "confidence_head.")) for k in keys)
  )


def tensor_names(cfg: DFlashConfig, d_ff: int, bias: bool) -> dict[str, list[hub_names.Target]]:
  """Hub name -> `[(path, transform, part)]` of a drafter of `cfg` whose layers'
  MLPs are `d_ff` wide; with `bias`, the q/k/v/o biases too."""
  tr, same = hub_names.transpose, hub_names.same
  names = {"fc.weight": [(("fc", "kernel"), tr, None)]}
  names |= {f"{n}.weight": [((n, "scale"), same, None)] for n in ("hidden_norm", "norm")}
  for i in range(cfg.draft_layers):
    hub, at = f"layers.{i}.", ("layers", i)
    for p in _PROJECTIONS:
      names[f"{hub}self_attn.{p}.weight"] = [((*at, p, "kernel"), tr, None)]
      if bias:
        names[f"{hub}self_attn.{p}.bias"] = [((*at, p, "bias"), same, None)]
    for n in ("q_norm", "k_norm"):
      names[f"{hub}self_attn.{n}.weight"] = [((*at, n, "scale"), same, None)]
    for n in ("input_layernorm", "post_attention_layernorm"):
      names[f"{hub}{n}.weight"] = [((*at, n, "scale"), same, None)]
    for part in gate_up_parts(d_ff):
      names[f"{hub}mlp.{part.name}.weight"] = [((*at, "mlp", "gate_up_proj", "kernel"), tr, part)]
    names[f"{hub}mlp.down_proj.weight"] = [((*at, "mlp", "down_proj", "kernel"), tr, None)]
  return names


def _beyond_qwen3(c: ModelConfig) -> str | None:
  """What of layers of config `c` Qwen3's layers do not compute, or None."""
  if c.norm != "rmsnorm":
    return f"norm={c.norm!r} (Qwen3's norms are RMSNorm)"
  if c.norm_offset:
    return f"norm_offset={c.norm_offset!r} (Qwen3's norms multiply by their weight alone)"
  if c.mlp != "swiglu":
    return f"mlp={c.mlp!r} (Qwen3's MLP is SwiGLU)"
  if c.attn_scale is not None and c.attn_scale != c.resolved_head_dim**-0.5:
    return f"attn_scale={c.attn_scale!r} (Qwen3's is head_dim ** -0.5)"
  return None


def _rope_scaling(c: ModelConfig) -> dict | None:
  s = c.rope_scaling
  if s is None:
    return None
  if s.kind == "linear":
    return {"rope_type": "linear", "factor": s.factor}
  return {
    "rope_type": "llama3",
    "factor": s.factor,
    "low_freq_factor": s.low_freq_factor,
    "high_freq_factor": s.high_freq_factor,
    "original_max_position_embeddings": s.original_max_len,
  }


def hub_config(head: DFlashHead) -> dict:
  """The drafter's `config.json` in the `DFlashDraftModel` layout (`write` checks
  that the layout holds the head)."""
  cfg, c = head.cfg, head.layer_config
  t = cfg.target
  bias = c.qkv_bias or c.out_bias  # q/k/v/o biases in one flag
  # Layer counts -> the reference's ids, in the order the head's fc reads them:
  # the target hands a head its feature layers in depth order (`run_blocks`).
  ids = [i - 1 for i in sorted(cfg.feature_layers)]
  dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": ids}
  if t.logit_softcap:  # the target's head caps its logits; the reference caps by this
    dflash["final_logit_softcapping"] = t.logit_softcap
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "qwen3",
    "hidden_size": c.d_model,
    "intermediate_size": c.d_ff,
    "num_hidden_layers": cfg.draft_layers,
    "num_attention_heads": c.n_heads,
    "num_key_value_heads": c.n_kv_heads,
    "head_dim": c.resolved_head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": c.norm_eps,
    "rope_theta": c.rope_theta,
    "rope_scaling": _rope_scaling(c),
    "max_position_embeddings": c.max_seq_len,
    "vocab_size": c.vocab_size,
    "attention_bias": bias,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * cfg.draft_layers,
    "tie_word_embeddings": False,
    "initializer_range": c.init_std,
    "torch_dtype": str(jnp.dtype(c.param_dtype)),
    "num_target_layers": t.n_layers,
    "block_size": cfg.block_size,
    "dflash_config": dflash,
  }


def write(head: DFlashHead, target: Transformer | None = None) -> tuple[dict, dict]:
  """`(config.json, {name: tensor})` of the drafter in the `DFlashDraftModel` layout,
  torch `[out, in]` weights; ValueError naming the parameter or setting the layout
  cannot hold (nothing is dropped). `target` is unused: the file copies nothing of it."""
  del target
  return hub_config(head), hub_tensors(head)


def hub_tensors(
  head: DFlashHead, own: dict | None = None, held: Collection = (), layout: str = ARCHITECTURE
) -> dict[str, np.ndarray]:
  """`{name: tensor}` of the drafter's layers in the `DFlashDraftModel` layout, and
  `own` beside them: the tensors of a `layout` built on it, which hold the
  parameter paths `held`. ValueError naming the parameter or setting that neither
  holds (nothing is dropped)."""
  cfg, c = head.cfg, head.layer_config
  if cfg.mask_token_id < 0:
    raise ValueError(
      f"mask_embedding: the {layout} layout has no tensor for a learned mask "
      "embedding (it fills the block with the target's embedding of "
      "dflash_config.mask_token_id); train the head with mask_token_id set to a spare id "
      "of the tokenizer, or write it with layout='specjax'."
    )
  beyond = _beyond_qwen3(c)
  if beyond:
    raise ValueError(
      f"the {layout} layout's layers are Qwen3's; this head's target has {beyond}: "
      "write it with layout='specjax'."
    )
  params = shared_hub.flat_params(head)
  bias = c.qkv_bias or c.out_bias
  tensors, written = shared_hub.named_tensors(params, tensor_names(cfg, c.d_ff, bias))
  if bias:  # the reference reads q/k/v/o biases together: zeros for those the head lacks
    dtype = params[("fc", "kernel")].dtype
    for i in range(cfg.draft_layers):
      layer = head.layers[i]
      for p in _PROJECTIONS:
        name = f"layers.{i}.self_attn.{p}.bias"
        tensors.setdefault(name, np.zeros(getattr(layer, p).kernel.shape[-1], dtype))
  written = written | set(held)
  for path, value in params.items():
    if path not in written and np.any(value):
      raise ValueError(
        f"{'.'.join(map(str, path))}: the {layout} layout has no tensor for it "
        "(its MLPs have no biases) and it is not zero; write the head with layout='specjax'."
      )
  tensors |= own or {}
  return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def _check_config(config: dict, t: ModelConfig, spelling: HubSpelling = DFLASH_SPELLING) -> None:
  """ValueError naming the first config.json field that does not fit target `t`."""
  architectures = config.get("architectures") or []
  if not set(spelling.architectures) & set(map(str, architectures)):
    names = " or ".join(spelling.architectures)
    raise ValueError(
      f"config architectures is {architectures!r}; specjax reads {names} here (no other variant)."
    )
  required = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads")
  for key in (*required, "intermediate_size"):
    if key not in config:
      raise ValueError(f"config lacks the field {key}.")
  want = dict(hidden_size=t.d_model, vocab_size=t.vocab_size, num_attention_heads=t.n_heads)
  want |= dict(num_key_value_heads=t.n_kv_heads, head_dim=t.resolved_head_dim)
  want |= dict(rms_norm_eps=t.norm_eps, hidden_act="silu")
  want["num_target_layers"] = t.n_layers if "num_target_layers" in config else None  # optional
  for key, value in want.items():
    got = config.get(key, _QWEN3_DEFAULTS.get(key))
    if value is not None and got != value:
      raise ValueError(f"config {key} is {got!r}; the target needs {value!r}.")
  theta, scaling = rope(config, "config", theta=10_000.0)
  if (theta, scaling) != (t.rope_theta, t.rope_scaling):
    raise ValueError(
      f"config rope (theta {theta}, scaling {scaling}) is not the target's "
      f"(theta {t.rope_theta}, scaling {t.rope_scaling}): the drafter's RoPE is its target's."
    )
  types = config.get("layer_types") or []
  if "sliding_attention" in types or (not types and config.get("use_sliding_window")):
    raise ValueError("config asks for sliding-window layers; specjax's drafter attends globally.")
  if config.get("is_causal"):
    raise ValueError("config is_causal is true; specjax's drafter reads its block both ways.")
  for key in ("input_embedding_scale", "output_multiplier"):
    value = spelling.lookup(config, key, 1.0)[0]
    if float(value) != 1.0:
      raise ValueError(f"config {key} is {value!r}; specjax reads 1.0 only.")
  cap = spelling.lookup(config, "final_logit_softcapping")[0] or None
  if cap != t.logit_softcap:
    raise ValueError(
      f"config final_logit_softcapping is {cap!r}; the drafter's logits are its target's "
      f"(logit_softcap {t.logit_softcap!r})."
    )


def from_hub(
  config: dict, tensors: dict[str, np.ndarray], target: Transformer, dtype
) -> DFlashHead:
  """A `DFlashHead` for `target` from a `DFlashDraftModel` config and its tensors
  (`write`'s); ValueError naming the field or tensor that does not fit `target`.
  An absent bias is zero; a bias this target's layers lack must be zero."""
  fields, tensors = hub_fields(config, tensors, target.cfg, dtype)
  cfg = DFlashConfig(**fields)
  names = tensor_names(cfg, cfg.d_ff or target.cfg.d_ff, bias=True)
  return read_hub_head(cfg, names, tensors, dtype)


def hub_fields(
  config: dict, tensors: dict, t: ModelConfig, dtype, spelling: HubSpelling = DFLASH_SPELLING
) -> tuple[dict, dict]:
  """`(DFlashConfig's fields, tensors)` of a config.json in the `DFlashDraftModel`
  layout, or a layout built on it (`spelling`: where its drafter fields are), for
  target `t` in `dtype`: the tensors with `fc`'s input blocks in depth order.
  ValueError naming the field that does not fit `t`."""
  name = str(jnp.dtype(dtype))
  _check_config(config, t, spelling)
  beyond = _beyond_qwen3(t)
  if beyond:
    raise ValueError(
      f"this target's layers have {beyond}; {spelling.architectures[0]}'s are Qwen3's."
    )
  n, v = t.n_layers, t.vocab_size
  layers = config["num_hidden_layers"]
  low, high = DFlashConfig.RANGES["draft_layers"]
  if not is_int(layers) or not low <= layers <= high:
    raise ValueError(
      f"config num_hidden_layers is {layers!r}; specjax reads {low} to {high} layers."
    )
  ids, where = spelling.lookup(config, "target_layer_ids")
  if ids is None:  # the first reference's rule (its build_target_layer_ids)
    ids = (
      [n // 2]
      if layers == 1
      else [int(round(1 + i * (n - 4) / (layers - 1))) for i in range(layers)]
    )
    if len(set(ids)) != len(ids) or not 0 <= min(ids) <= max(ids) < n:
      raise ValueError(
        f"config {where} is absent, and the reference's rule gives "
        f"{ids} for {layers} layers on this target's {n}: name distinct ids in [0, {n})."
      )
  if (
    not isinstance(ids, list)
    or not ids
    or any(not is_int(i) or not 0 <= i < n for i in ids)
    or len(set(ids)) != len(ids)
  ):
    raise ValueError(
      f"config {where} is {ids!r}; this target needs distinct layer ids in [0, {n})."
    )
  mask, where = spelling.lookup(config, "mask_token_id")
  if not is_int(mask) or not 0 <= mask < v:
    raise ValueError(f"config {where} is {mask!r}; this target needs an id in [0, {v}).")
  block, where = spelling.lookup(config, "block_size", 16)  # the reference's default
  low, high = DFlashConfig.RANGES["block_size"]
  if not is_int(block) or not low <= block <= high:
    raise ValueError(f"config {where} is {block!r}; specjax reads {low} to {high}.")
  ff = config["intermediate_size"]
  if not is_int(ff) or ff < 1:
    raise ValueError(f"config intermediate_size is {ff!r}; specjax reads a positive int.")
  tensors = dict(tensors)
  if ids != sorted(ids) and "fc.weight" in tensors:  # fc's input blocks into depth order
    fc = np.asarray(tensors["fc.weight"])
    if fc.ndim == 2 and fc.shape[1] == len(ids) * t.d_model:
      blocks = np.split(fc, len(ids), axis=1)
      tensors["fc.weight"] = np.concatenate([blocks[j] for j in np.argsort(ids)], axis=1)
  fields = dict(
    target=t.replace(dtype=name, param_dtype=name),
    feature_layers=tuple(sorted(int(i) + 1 for i in ids)),
    d_ff=ff * (ff != t.d_ff),  # 0: the target's
    block_size=int(block),
    draft_layers=layers,
    mask_token_id=int(mask),
  )
  return fields, tensors


def read_hub_head(cfg: DFlashConfig, names: dict, tensors: dict, dtype) -> nnx.Module:
  """The head of `cfg` (a block drafter's or a kind's built on it) in `dtype` from hub
  `tensors` by `names` (`specjax.heads.hub.build_head`); a bias of `names` that the
  target's layers lack is read as nothing, and must be zero."""
  name, t, names = str(jnp.dtype(dtype)), cfg.target, dict(names)
  held = {tuple(p) for p, _ in nnx.to_flat_state(shared_hub.abstract_head(cfg, name)[1])}
  for name_ in [k for k, targets in names.items() if targets[0][0] not in held]:
    del names[name_]  # a bias the target's layers lack: computes nothing only if zero
    if name_ in tensors and np.any(np.asarray(tensors.pop(name_), np.float32)):
      raise ValueError(
        f"tensor {name_} is not zero, and this target's layers have no such bias "
        f"(qkv_bias {t.qkv_bias}, out_bias {t.out_bias})."
      )
  return shared_hub.build_head(cfg, name, names, tensors, {})

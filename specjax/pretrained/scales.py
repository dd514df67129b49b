"""Scaled pairs: the bundled pair grown to real models' shapes, computing the same function.

  target, draft, tokenizer = specjax.pretrained.load_pair(jnp.bfloat16, scale="1b")

A preset names the ModelConfig sizes of the target and of the draft;
`specjax.models.expand` grows each bundled model to them (zero-padded weights,
identity layers: `specjax/models/expand.py`), so the pair keeps the bundled
pair's outputs and acceptance while costing what models of those shapes cost.
The vocabulary stays the bundled 4,096 ids: the embedding (tied with the head)
is a small share of each model, where a 32k vocabulary spends 65M+ parameters
per matrix at d_model 2048.

Parameter counts (vocabulary 4,096, tied embeddings; bytes = 2 or 4 per
parameter in bfloat16 / float32):

  preset  target                                         draft
  160m    116,411,136  (233 MB / 466 MB)                  the bundled one, 920,192
  1b      1,000,433,664 (2.00 GB / 4.00 GB)               69,217,536 (138 MB / 277 MB)
  7b      6,493,048,832 (12.99 GB / 25.97 GB)             69,217,536, as 1b's
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from specjax.dtypes import dtype_name
from specjax.models.config import ModelConfig
from specjax.models.expand import expand, expanded_config
from specjax.models.transformer import Transformer

# The ~68M-parameter-shaped draft of the 1b and 7b presets (double7/vicuna-68m's
# layer shape: d_model 768, 12 heads, d_ff 3072). That model has 2 layers and a
# 32,000-id untied vocabulary (49M of its 68M); with 4,096 tied ids, 7 layers
# give 69,217,536 parameters (6 would give 59.8M, 8 78.7M).
DRAFT_68M = dict(d_model=768, n_layers=7, n_heads=12, n_kv_heads=12, d_ff=3072)


@dataclasses.dataclass(frozen=True)
class Scale:
  """A scaled-pair preset.

  Attributes:
    name: what `load_pair(scale=...)` calls it.
    target: ModelConfig sizes of the scaled target (passed to
      `specjax.models.expanded_config` of the bundled target's config).
    draft: the same for the draft; empty: the draft stays as it is.
    note: what the shapes imitate, and the parameter counts.
  """

  name: str
  target: Mapping[str, Any]
  draft: Mapping[str, Any]
  note: str = ""


SCALES = {
  scale.name: scale
  for scale in (
    Scale(
      "160m",
      target=dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=3072),
      draft={},
      note=(
        "GPT-Neo-125M / Pythia-160m-shaped target (d_model 768, 12 layers, 12 heads of 64, "
        "d_ff 3072): 116,411,136 parameters with the 4,096-id vocabulary; the bundled "
        "draft unchanged (920,192)."
      ),
    ),
    Scale(
      "1b",
      target=dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=8, d_ff=5632),
      draft=DRAFT_68M,
      note=(
        "TinyLlama-1.1B-shaped target (d_model 2048, 22 layers, 32 query heads over 8 kv "
        "heads of 64, d_ff 5632; 8 kv heads, not TinyLlama's 4, because the bundled 5 must "
        "fit): 1,000,433,664 parameters, 8,388,608 of them the tied embedding; "
        "68M-shaped draft (d_model 768, 7 layers, 12 heads, d_ff 3072): 69,217,536."
      ),
    ),
    Scale(
      "7b",
      target=dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008),
      draft=DRAFT_68M,
      note=(
        "Llama-2-7B-shaped target (d_model 4096, 32 layers, 32 heads of 128, d_ff 11008; "
        "rope_theta 1e8 and attn_scale 1/8 keep the bundled 64-wide heads' function): "
        "6,493,048,832 parameters; draft as 1b's (69,217,536)."
      ),
    ),
  )
}


def get_scale(scale: str | Scale) -> Scale:
  """The preset called `scale` (a `Scale` passes through); ValueError listing the names."""
  if isinstance(scale, Scale):
    return scale
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}.")
  return SCALES[scale]


def scaled_configs(
  scale: str | Scale, target: ModelConfig, draft: ModelConfig, dtype=None
) -> tuple[ModelConfig, ModelConfig]:
  """The configs `(target, draft)` of `scale` grown from these, with dtype and
  param_dtype `dtype` (None: each config's own). Builds nothing."""
  scale = get_scale(scale)
  out = []
  for cfg, sizes in ((target, scale.target), (draft, scale.draft)):
    fields = dict(sizes)
    if dtype is not None:
      fields.update(dtype=dtype_name(dtype), param_dtype=dtype_name(dtype))
    out.append(expanded_config(cfg, **fields) if fields else cfg)
  return out[0], out[1]


def scale_pair(
  target: Transformer, draft: Transformer, scale: str | Scale, dtype=None
) -> tuple[Transformer, Transformer]:
  """`(target, draft)` grown to `scale`'s shapes (`specjax.models.expand`), each
  computing what it did; in `dtype` (None: each model's own). A model whose
  config would not change is returned as it is.

  Raises:
    ValueError: an unknown preset name, a bad dtype, or sizes the models cannot
      grow to (the ModelConfig field named).
  """
  target_cfg, draft_cfg = scaled_configs(scale, target.cfg, draft.cfg, dtype)
  return (
    target if target_cfg == target.cfg else expand(target, target_cfg),
    draft if draft_cfg == draft.cfg else expand(draft, draft_cfg),
  )

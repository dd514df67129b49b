"""How a block drafter's parameters grow with a scaled target (`specjax.models.expand`):
`expansion_axes`, the kind's record's rule, by parameter path and axis letters."""

from __future__ import annotations

from specjax.models.expand import BLOCK_AXES

# The axes of a block drafter's (DFlash's) parameters besides its layers': fc reads its
# nf * D features.
_DFLASH_AXES = {
  ("fc", "kernel"): "XD",
  ("hidden_norm", "scale"): "D",
  ("hidden_norm", "bias"): "D",
  ("norm", "scale"): "D",
  ("norm", "bias"): "D",
  ("mask_embedding",): "D",
}
# ... in a block drafter's layer (`DFlashLayer`: separate projections, query heads
# grouped by kv head as the fused ones are), by its path inside the layer.
_DFLASH_LAYER_AXES = {
  ("q_proj", "kernel"): "DKGH",
  ("q_proj", "bias"): "KGH",
  ("k_proj", "kernel"): "DKH",
  ("k_proj", "bias"): "KH",
  ("v_proj", "kernel"): "DKH",
  ("v_proj", "bias"): "KH",
  ("o_proj", "kernel"): "KGHD",
  ("o_proj", "bias"): "D",
  ("q_norm", "scale"): "H",
  ("k_norm", "scale"): "H",
  **{k: v for k, v in BLOCK_AXES.items() if k[0] == "mlp"},
}
for _norm in ("input_layernorm", "post_attention_layernorm"):
  _DFLASH_LAYER_AXES[(_norm, "scale")] = _DFLASH_LAYER_AXES[(_norm, "bias")] = "D"


def expansion_axes(path: tuple) -> tuple[str, str] | None:
  """How a block drafter's parameter grows with the target: (its plan: "block" for its
  layers', "target" for the rest, their letters), or None for a path it lacks."""
  if path[0] == "layers":  # ("layers", i, ...)
    axes = _DFLASH_LAYER_AXES.get(path[2:])
    return None if axes is None else ("block", axes)
  axes = _DFLASH_AXES.get(path)
  return None if axes is None else ("target", axes)

"""The sequential block drafter's hub layout: DeepSpec's DSpark drafter (`Qwen3DSparkModel`).

DSpark's published checkpoints (DeepSeek's DeepSpec, e.g. deepseek-ai/dspark_qwen3_8b_block7;
served by vLLM's `qwen3_dspark.py`, SGLang's `dspark.py`, llama.cpp's `dspark` arch,
TensorRT-LLM's `modeling_dspark.py`, vllm-project/speculators' `models/dspark`) are a
DFlash drafter (`specjax.heads.dflash.hub`'s `DFlashDraftModel` layout: its tensors and
Qwen3 fields, read and written by its `hub_fields` / `hub_tensors`) plus, torch `[out, in]`:
  markov_head.markov_w1.weight  [V, r]     an embedding of the token before (W1)
  markov_head.markov_w2.weight  [V, r]     a Linear r -> V (W2, specjax's [r, V] transposed)
  confidence_head.proj.weight   [1, D + r] over concat(h, W1[prev]), or [1, D] without
                                           the Markov input (`confidence_head_with_markov`)
  confidence_head.proj.bias     [1]        optional (DeepSeek-V4's has none): absent is 0
  embed_tokens.weight, lm_head.weight      optional: the reference keeps frozen copies of
                                           the target's; read only if equal to the
                                           target's, written when saving a drafter
logits' = logits + W2 . W1[prev] (prev_0 = the anchor s[-1], prev_i = draft i - 1), the
confidence sigmoid(proj(...)): `DSparkHead` exactly. config.json: architectures
`Qwen3DSparkModel` (written) or `DSparkDraftModel`; the DSpark fields `markov_rank`,
`markov_head_type` ("vanilla" only: the bias from the previous token alone; "gated" and
"rnn" are refused naming the field), `enable_confidence_head`,
`confidence_head_with_markov`, and DFlash's `mask_token_id`, `target_layer_ids`,
`block_size`, each looked up in `dspark_config`, then `dflash_config`, then the top level
(the runtimes' lookups; DeepSpec's own configs are flat). Written in all three places that
runtimes read: the top level, `dspark_config`, and `dflash_config` as `dflash` writes it.
Writing never drops a parameter: the confidence head's parts (`confidence_hidden`,
`confidence_markov`, `confidence_bias`) are concatenated into `proj.weight` / `proj.bias`;
a head of markov_rank 0 writes no Markov tensors and `markov_rank: 0`.

The block's alignment: DeepSpec's DSpark blocks are anchor-first (every slot, the
anchor's included, gives the law of the token after it: B drafts per block), specjax's
block drafter's are not (slot k >= 1 gives its own position's: B - 1). `anchor_first`
says which; a file without the field (DeepSpec's) reads as anchor-first, and `write`
writes the field, so a head trained on the block drafter's alignment (the bundled one)
reads back as it is; DeepSpec's runtimes ignore the field and would misalign such a file.

What is not settled: no published checkpoint is reachable offline here, so the names and
fields follow the runtimes' public descriptions, not a downloaded file.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from specjax.heads import hub as shared_hub
from specjax.heads.dflash import hub as block_hub
from specjax.heads.dflash.training import TRAINING_FIELDS as BLOCK_TRAINING_FIELDS
from specjax.heads.dspark.model import DSparkConfig, DSparkHead
from specjax.models import hub_names
from specjax.models.transformer import Transformer
from specjax.validation import is_int

ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
SPELLING = block_hub.HubSpelling(ARCHITECTURES, ("dspark_config", "dflash_config"))
MARKOV_HEAD_TYPES = ("vanilla",)
_PROJ = "confidence_head.proj"


def recognises(config: dict, file: str, keys: Collection[str]) -> bool:
  """Whether a head directory is a DSpark drafter's: a `dspark_config`, a DSpark
  architecture, or Markov / confidence tensors (`from_hub` names what it does not read)."""
  del file
  return block_hub.derived_layout(config, keys)


def _names(cfg: DSparkConfig) -> dict[str, list[hub_names.Target]]:
  """Hub name -> `[(path, transform, part)]` of the two heads (reading: `proj.weight`'s
  columns split into the hidden part [D, 1] and the Markov part [r, 1])."""
  same, d, r = hub_names.same, cfg.target.d_model, cfg.markov_rank
  names = {}
  if r:
    names["markov_head.markov_w1.weight"] = [(("markov_w1",), same, None)]
    names["markov_head.markov_w2.weight"] = [(("markov_w2",), hub_names.transpose, None)]
  if cfg.confidence_head:
    parts = [(("confidence_hidden", "kernel"), lambda w: w[:, :d].T, None)]
    if r and cfg.confidence_with_markov:
      parts.append((("confidence_markov", "kernel"), lambda w: w[:, d:].T, None))
    names[f"{_PROJ}.weight"] = parts
    names[f"{_PROJ}.bias"] = [(("confidence_bias",), same, None)]
  return names


def _target_tensors(target: Transformer) -> dict[str, np.ndarray]:
  """The target's embedding and output head as the reference's files copy them,
  `embed_tokens.weight` and `lm_head.weight`, both `[V, D]`, in the target's dtype."""
  embed = np.asarray(target.embed.embedding[...])
  head = embed if target.cfg.tie_embeddings else np.asarray(target.lm_head[...]).T
  return {"embed_tokens.weight": embed, "lm_head.weight": head}


def _heads_fields(config: dict, t, keys: Collection[str]) -> dict:
  """`DSparkConfig`'s own fields from a DSpark config.json; ValueError naming the field."""
  rank, where = SPELLING.lookup(config, "markov_rank", 0)
  low, high = DSparkConfig.RANGES["markov_rank"]
  if not is_int(rank) or not low <= rank <= high:
    raise ValueError(f"config {where} is {rank!r}; specjax reads an int in [{low}, {high}].")
  markov = [k for k in keys if k.startswith("markov_head.")]
  if not rank and markov:
    raise ValueError(f"config {where} is 0, but the file holds tensor {sorted(markov)[0]}.")
  kind, where = SPELLING.lookup(config, "markov_head_type", "vanilla")
  if rank and kind not in MARKOV_HEAD_TYPES:
    raise ValueError(
      f"config {where} is {kind!r}; specjax reads {MARKOV_HEAD_TYPES[0]!r} only (the bias "
      "from the token before alone, not gated by the hidden state nor carried over the block)."
    )
  flags = {}
  for key in ("enable_confidence_head", "confidence_head_with_markov"):
    flags[key], where = SPELLING.lookup(config, key, False)
    if not isinstance(flags[key], bool):
      raise ValueError(f"config {where} is {flags[key]!r}; specjax reads a bool.")
  confidence, with_markov = flags["enable_confidence_head"], flags["confidence_head_with_markov"]
  if confidence and with_markov and not rank:
    raise ValueError(
      f"config {where} is true, but markov_rank is 0: there is no Markov embedding to read."
    )
  vocab, where = SPELLING.lookup(config, "draft_vocab_size", t.vocab_size)
  if vocab != t.vocab_size:
    raise ValueError(
      f"config {where} is {vocab!r}; specjax's drafter drafts over the target's "
      f"{t.vocab_size} ids (no reduced draft vocabulary)."
    )
  # specjax's own fields (absent: the reference's anchor-first blocks, first law corrected)
  own = {}
  for key in ("anchor_first", "correct_first"):
    own[key], where = SPELLING.lookup(config, key, True)
    if not isinstance(own[key], bool):
      raise ValueError(f"config {where} is {own[key]!r}; specjax reads a bool.")
  return dict(
    markov_rank=int(rank),
    **own,
    confidence_head=confidence,
    # a flag without effect (no confidence head or no Markov head) reads as the default
    confidence_with_markov=(
      with_markov if confidence and rank else DSparkConfig.confidence_with_markov
    ),
  )


def from_hub(
  config: dict, tensors: dict[str, np.ndarray], target: Transformer, dtype
) -> DSparkHead:
  """A `DSparkHead` for `target` from a DSpark config.json and its tensors (`write`'s);
  ValueError naming the field or tensor that does not fit `target`, or that specjax does
  not compute (a "gated" or "rnn" Markov head, a copy of the embedding or output head
  other than the target's)."""
  t = target.cfg
  fields, tensors = block_hub.hub_fields(config, tensors, t, dtype, SPELLING)
  cfg = DSparkConfig(**fields, **_heads_fields(config, t, tensors.keys()))
  for name, want in _target_tensors(target).items():
    if name in tensors:
      got = np.asarray(tensors.pop(name))
      same = got.shape == want.shape and np.array_equal(
        got.astype(np.float32), want.astype(got.dtype).astype(np.float32)
      )
      if not same:
        raise ValueError(
          f"tensor {name} is not this target's: specjax's drafter reads the target's own "
          "embedding and output head (the reference's file keeps frozen copies of them)."
        )
  r, d = cfg.markov_rank, t.d_model
  if cfg.confidence_head and f"{_PROJ}.weight" in tensors:
    width = d + (r if cfg.confidence_with_markov else 0)
    shape = np.shape(tensors[f"{_PROJ}.weight"])
    if shape != (1, width):
      _, where = SPELLING.lookup(config, "confidence_head_with_markov")
      raise ValueError(
        f"tensor {_PROJ}.weight has shape {shape}; this target needs (1, {width}): the hidden "
        f"state's {d}" + (f" and the Markov embedding's {r} ({where} true)." if width > d else ".")
      )
  names = block_hub.tensor_names(cfg, cfg.d_ff or t.d_ff, bias=True) | _names(cfg)
  return block_hub.read_hub_head(cfg, names, tensors, dtype)


def hub_config(head: DSparkHead) -> dict:
  """The drafter's config.json: `block_hub.hub_config`'s, a DSpark architecture, and the
  DSpark fields at the top level (DeepSpec's flat configs) and in `dspark_config`."""
  cfg, config = head.cfg, block_hub.hub_config(head)
  r = cfg.markov_rank
  own = {
    "mask_token_id": cfg.mask_token_id,
    "target_layer_ids": config["dflash_config"]["target_layer_ids"],
    "block_size": cfg.block_size,
    "markov_rank": r,
    "markov_head_type": MARKOV_HEAD_TYPES[0],
    "enable_confidence_head": cfg.confidence_head,
    "confidence_head_with_markov": bool(cfg.confidence_head and r and cfg.confidence_with_markov),
    "anchor_first": cfg.anchor_first,
    "correct_first": cfg.correct_first,
  }
  # The reference's class also requires `num_anchors`, a training setting specjax's head
  # does not record: the block drafter's default.
  anchors = BLOCK_TRAINING_FIELDS["num_anchors"][0]
  config = {**config, "architectures": [ARCHITECTURES[0]], **own, "num_anchors": anchors}
  return {**config, "dspark_config": own}


def write(head: DSparkHead, target: Transformer | None = None) -> tuple[dict, dict]:
  """`(config.json, {name: tensor})` of the drafter in the DSpark layout: the block
  drafter's tensors (`block_hub.hub_tensors`), the Markov head's, the confidence head's parts
  in one `proj.weight` [1, D + r] (or [1, D]) and `proj.bias`; and, given the drafter's
  `target`, its embedding and output head as the reference's files copy them. ValueError
  naming what the layout cannot hold (nothing is dropped)."""
  cfg = head.cfg
  params = shared_hub.flat_params(head)
  names = _names(cfg)
  proj = names.pop(f"{_PROJ}.weight", [])  # its columns are two parameters': joined here
  own, held = shared_hub.named_tensors(params, names)
  if proj:
    own[f"{_PROJ}.weight"] = np.concatenate([params[path] for path, _, _ in proj], axis=0).T
    held |= {path for path, _, _ in proj}
  if target is not None:
    own |= _target_tensors(target)
  return hub_config(head), block_hub.hub_tensors(head, own, held, ARCHITECTURES[0])

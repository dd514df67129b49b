"""The bundled trained draft/target pair, loaded offline in one call.

  target, draft, tokenizer = specjax.pretrained.load_pair()
  target, draft, tokenizer = specjax.pretrained.load_pair(jnp.bfloat16, scale="1b")  # grown
  head = specjax.pretrained.load_head("eagle", target)   # any of specjax.heads.bundled()
  drafter = specjax.pretrained.load_drafter("eagle", target)  # the head, as a drafter
  models = specjax.pretrained.load_checkpoints()  # the bundled pair, or HF checkpoints

Both models were trained on the Python standard library's source (see the
model card in docs/bundled_pair.md and `stdlib_pair/card.json`); the draft is distilled
toward the target. The files are ordinary Hugging Face Llama checkpoints
(`stdlib_pair/target`, `stdlib_pair/draft`) sharing `stdlib_pair/tokenizer.json`,
so `specjax.hf.load_model` and transformers read them too.

Draft heads trained on the frozen target (configs/train_eagle.py,
train_medusa.py, train_early_exit.py, train_dflash.py; `experiments/bundle_heads.py`
writes them) live in `stdlib_pair/heads/<kind>/`: `head_config.json` (a `HeadConfig`)
and bfloat16 `model.safetensors`, their sha256 and training record in
`stdlib_pair/heads/card.json`.

`load_pair(scale=...)` grows the pair to a real model's shape computing the same
function (the presets: `scales.SCALES`; `specjax/models/expand.py`), and
`load_head` / `load_drafter` grow the bundled heads to such a target.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads
from specjax.data.tokenizer import Tokenizer
from specjax.drafting import NGramDrafter, layer_skip
from specjax.dtypes import dtype_name
from specjax.heads import files as head_files
from specjax.hf.config import model_config
from specjax.hf.hub import resolve_checkpoint
from specjax.hf.loader import check_same_tokenizer, load_model, read_config
from specjax.hf.pairs import check_pair
from specjax.models.config import ModelConfig
from specjax.models.expand import check_expansion
from specjax.models.transformer import Transformer
from specjax.pretrained.scales import SCALES, Scale, get_scale, scale_pair, scaled_configs
from specjax.validation import file_sha256, is_int, read_json_object

PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_pair")
TARGET_DIR = os.path.join(PAIR_DIR, "target")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")
TOKENIZER_FILE = os.path.join(PAIR_DIR, "tokenizer.json")
CARD_FILE = os.path.join(PAIR_DIR, "card.json")
# The files whose sha256 `card.json` records, relative to the pair's directory.
BUNDLED_FILES = (
  "target/config.json",
  "target/model.safetensors",
  "draft/config.json",
  "draft/model.safetensors",
  "tokenizer.json",
)
_REBUILD = "reinstall specjax, or rebuild it with experiments/bundle_pair.py"
HEADS_DIR = os.path.join(PAIR_DIR, "heads")
HEADS_CARD_FILE = os.path.join(HEADS_DIR, "card.json")
# The files of each bundled head, relative to its directory heads/<kind>/.
HEAD_FILES = (head_files.CONFIG_FILE, head_files.WEIGHTS_FILE)
_REBUILD_HEADS = "reinstall specjax, or rebuild it with experiments/bundle_heads.py"
# A draft with a tokenizer of its own (1024-id BPE), for cross-tokenizer drafting.
CROSS_DRAFT_DIR = os.path.join(PAIR_DIR, "cross_draft")
CROSS_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_REBUILD_CROSS = "reinstall specjax, or rebuild it with experiments/bundle_cross_draft.py"


# What `load_drafter` builds besides the bundled heads' drafters (`specjax.heads.bundled()`).
OTHER_DRAFTERS = ("ngram", "layer_skip")


def drafter_kinds() -> tuple[str, ...]:
  """What `load_drafter` builds: the bundled heads' drafters, prompt lookup, the
  target's first layers."""
  return (*heads.bundled(), *OTHER_DRAFTERS)


class Pair(NamedTuple):
  target: Transformer
  draft: Transformer
  tokenizer: Tokenizer


class Checkpoints(NamedTuple):
  """The models a launcher decodes with (`load_checkpoints`).

  Attributes:
    target, tokenizer: the target and its tokenizer.
    draft, draft_tokenizer: the draft model and its tokenizer (the target's for
      a pair that shares one); None when no draft was asked for.
    target_path, draft_path: their checkpoint directories (None: no draft).
  """

  target: Transformer
  draft: Transformer | None
  tokenizer: Tokenizer
  draft_tokenizer: Tokenizer | None
  target_path: str
  draft_path: str | None


def file_sums(directory: str, files: tuple[str, ...] = BUNDLED_FILES) -> dict[str, str]:
  """{relative path: sha256} of `files` under `directory` (for a card.json)."""
  return {rel: file_sha256(os.path.join(directory, rel)) for rel in files}


def _verify_sums(sums, root: str, files, card_file: str, rebuild: str) -> None:
  """Raises ValueError unless each of `files` (relative to `root`) has the sha256
  that `card_file`'s table `sums` records."""
  if not isinstance(sums, dict):
    raise ValueError(f"{card_file} has no 'sha256' table of the bundled files ({rebuild}).")
  for rel in files:
    expected = sums.get(rel)
    if not isinstance(expected, str):
      raise ValueError(f"{card_file}: 'sha256' has no entry for {rel} ({rebuild}).")
    path = os.path.join(root, rel)
    actual = file_sha256(path)
    if actual != expected:
      raise ValueError(
        f"{path} is corrupt or was changed: {card_file} records sha256 "
        f"{expected}, the file has {actual} ({rebuild})."
      )


def load_pair(dtype=jnp.float32, scale: str | Scale | None = None, *, draft_dtype=None) -> Pair:
  """`(target, draft, tokenizer)` of the bundled pair; weights cast to `dtype`.

  The files hold bfloat16 weights; float32 (the default) computes in float32,
  which keeps greedy speculative and autoregressive outputs bit-identical.
  Every file is checked against the sha256 in `card.json` before it is loaded.

  Args:
    dtype: compute and parameter dtype of both models.
    scale: None: the pair as trained. A preset name of `scales.SCALES` ("160m",
      "1b", "7b") or a `Scale`: both models grown to its shapes
      (`specjax.models.expand`), computing the same function, built directly in
      `dtype` on the default device (the "1b" target is 2.0 GB in bfloat16,
      "7b" 13 GB: see docs/scaled_pairs.md).
    draft_dtype: the draft's dtype when it differs from the target's (None:
      `dtype`): e.g. a bfloat16 draft reads half the bytes of a float32 one, and
      verification keeps the output the target's whatever the draft computes in.

  Raises:
    FileNotFoundError: a bundled file is missing.
    ValueError: a bad `dtype` or `scale`, or a file whose sha256 differs from the card's.
  """
  dtype_name(dtype)  # a bad dtype or preset fails before any file is read
  draft_dtype = dtype if draft_dtype is None else draft_dtype
  dtype_name(draft_dtype)
  if scale is not None:
    scale = get_scale(scale)
  for path in (TARGET_DIR, DRAFT_DIR, TOKENIZER_FILE, CARD_FILE):
    if not os.path.exists(path):
      raise FileNotFoundError(f"the bundled pair is incomplete: {path} is missing ({_REBUILD})")
  _verify_sums(model_card().get("sha256"), PAIR_DIR, BUNDLED_FILES, CARD_FILE, _REBUILD)
  tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
  target, _ = load_model(TARGET_DIR, dtype=dtype)
  draft, _ = load_model(DRAFT_DIR, dtype=draft_dtype)
  if scale is not None:
    target, draft = scale_pair(target, draft, scale)  # both already in dtype
  return Pair(target, draft, tokenizer)


def bundled_configs(dtype=jnp.float32) -> tuple[ModelConfig, ModelConfig]:
  """The `ModelConfig`s `(target, draft)` of the bundled pair in `dtype`, read from
  their config.json (no weights): e.g. `scales.scaled_configs("7b", *bundled_configs())`
  sizes a preset without building it."""
  return tuple(
    model_config(read_config(path), dtype_name(dtype), source=os.path.join(path, "config.json"))
    for path in (TARGET_DIR, DRAFT_DIR)
  )


def load_cross_draft(dtype=jnp.float32) -> tuple[Transformer, Tokenizer]:
  """`(draft, draft_tokenizer)`: the bundled draft with its own 1024-id tokenizer,
  trained on the same corpus split and then on the target's continuations
  (configs/train_cross_draft.py), for `specjax.drafting.CrossTokenizerDrafter`
  and `specjax.string_level_generate` with the bundled target. Files are
  checked against `cross_draft/card.json`'s sha256 first."""
  dtype_name(dtype)
  card_file = os.path.join(CROSS_DRAFT_DIR, "card.json")
  for rel in (*CROSS_FILES, "card.json"):
    path = os.path.join(CROSS_DRAFT_DIR, rel)
    if not os.path.exists(path):
      raise FileNotFoundError(
        f"the bundled cross draft is incomplete: {path} is missing ({_REBUILD_CROSS})"
      )
  sums = read_json_object(card_file).get("sha256")
  _verify_sums(sums, CROSS_DRAFT_DIR, CROSS_FILES, card_file, _REBUILD_CROSS)
  draft, _ = load_model(CROSS_DRAFT_DIR, dtype=dtype)
  return draft, Tokenizer.from_file(os.path.join(CROSS_DRAFT_DIR, "tokenizer.json"))


def head_file_sums(directory: str, kinds=None) -> dict[str, str]:
  """{"<kind>/<file>": sha256} of the bundled files of `kinds` (None: every bundled
  kind) under `directory`."""
  kinds = heads.bundled() if kinds is None else kinds
  return {
    f"{kind}/{name}": file_sha256(os.path.join(directory, kind, name))
    for kind in kinds
    for name in HEAD_FILES
  }


TOKEN_FREQUENCY_FILE = os.path.join(HEADS_DIR, "token_frequency.safetensors")


def frequent_token_ids(k: int) -> np.ndarray:
  """The `k` most frequent ids of the bundled tokenizer on the stdlib train split,
  most frequent first (int32 `[k]`): the vocabulary subset for FR-Spec drafting,
  `drafter.with_vocab_subset(frequent_token_ids(1024))` (84% of train tokens)."""
  from safetensors.numpy import load_file

  try:  # int16 [V]; its metadata says what was counted
    ranked = load_file(TOKEN_FREQUENCY_FILE)["ids_by_frequency"]
  except (OSError, KeyError) as e:
    raise ValueError(
      f"cannot read ids_by_frequency from {TOKEN_FREQUENCY_FILE} ({_REBUILD_HEADS})."
    ) from e
  if not is_int(k) or not 1 <= k <= len(ranked):
    raise ValueError(f"k must be an int in [1, {len(ranked)}], got {k!r}.")
  return ranked[:k].astype(np.int32)


def heads_card() -> dict:
  """The training record of the bundled heads (runs, steps, final metrics, sha256)."""
  if not os.path.exists(HEADS_CARD_FILE):
    raise FileNotFoundError(
      f"the bundled heads are missing: {HEADS_CARD_FILE} does not exist ({_REBUILD_HEADS})"
    )
  return read_json_object(HEADS_CARD_FILE)


def load_head(kind: str, target: Transformer, dtype=jnp.float32) -> nnx.Module:
  """The bundled draft head of `kind` for `target` (the bundled pair's target).

  Args:
    kind: one of `specjax.heads.bundled()` (e.g. "eagle", the `EagleHead`).
    target: the target the head will read, e.g. `load_pair().target`: of the
      shape the head was trained for, or an expansion of it (e.g.
      `load_pair(scale="1b").target`), for which the head is expanded alike
      (`specjax.heads.expand_head`) and predicts what it predicts for
      the bundled target.
    dtype: compute and parameter dtype of the head (the files hold bfloat16).

  Returns:
    The head module, for its kind's drafter (`specjax.heads.drafter(target, head)`).

  Raises:
    ValueError: an unknown `kind` or bad `dtype`, a target of another shape
      that is no expansion of the trained one, or a file whose sha256 differs
      from `heads/card.json`'s.
    FileNotFoundError: a bundled file is missing.
  """
  if kind not in heads.bundled():
    raise ValueError(f"kind must be one of {heads.bundled()}, got {kind!r}.")
  name = dtype_name(dtype)
  directory = os.path.join(HEADS_DIR, kind)
  for file in (*(os.path.join(directory, f) for f in HEAD_FILES), HEADS_CARD_FILE):
    if not os.path.exists(file):
      raise FileNotFoundError(
        f"the bundled {kind} head is incomplete: {file} is missing ({_REBUILD_HEADS})"
      )
  card = heads_card()
  # Tensors equal to another bundled head's are stored once (`shares`: that head's
  # kind -> the sha256 its weights had when this head was bundled).
  shares = card.get("heads", {}).get(kind, {}).get("shares", {})
  files = [f"{k}/{f}" for k in (kind, *shares) for f in HEAD_FILES]
  _verify_sums(card.get("sha256"), HEADS_DIR, files, HEADS_CARD_FILE, _REBUILD_HEADS)
  for other, sha in shares.items():
    if card["sha256"].get(f"{other}/{head_files.WEIGHTS_FILE}") != sha:
      raise ValueError(
        f"the bundled {kind} head shares tensors with the {other} head, which was bundled "
        f"again after it ({_REBUILD_HEADS}, --{kind} too)"
      )
  cfg = head_files.read_config(directory, _REBUILD_HEADS)
  grown = None  # the expanded target's config, when target is one
  try:
    cfg.check_target(target.cfg)
  except ValueError as mismatch:
    try:
      check_expansion(cfg.target, target.cfg)
    except ValueError as why:  # neither the trained shape nor grown from it
      raise mismatch from why
    grown = target.cfg.replace(dtype=name, param_dtype=name)
  shared = tuple(os.path.join(HEADS_DIR, other) for other in shares)
  head = head_files.read_head(directory, cfg, dtype, _REBUILD_HEADS, shared)
  return head if grown is None else heads.expand_head(head, grown)


def load_drafter(
  kind: str,
  target: Transformer,
  *,
  head: nnx.Module | None = None,
  vocab_subset: int = 0,
  max_ngram: int = 3,
  num_layers: int = 2,
  dtype=jnp.float32,
):
  """A drafter of `kind` for `target`, e.g. `load_drafter("eagle", load_pair().target)`.

  Args:
    kind: one of `drafter_kinds()`: a bundled head's kind (its drafter), "ngram"
      (prompt lookup of n-grams up to `max_ngram`) or "layer_skip" (the target's
      first `num_layers` layers).
    target: the target `Transformer` the drafter drafts for.
    head: a head's module (e.g. `specjax.training.load_trained_head(run)[0]`);
      None: the bundled head of `kind` (`load_head`, in `dtype`), which reads
      the bundled target or a scaled one (`load_pair(scale=...)`).
    vocab_subset: K > 0: a head drafts among the bundled tokenizer's K most
      frequent ids (FR-Spec, `frequent_token_ids`); 0: among all ids.

  Raises:
    ValueError: an unknown `kind`, or a setting out of range.
  """
  if kind not in drafter_kinds():
    raise ValueError(f"kind must be one of {', '.join(drafter_kinds())}; got {kind!r}.")
  if kind == "ngram":
    return NGramDrafter(target.cfg.vocab_size, max_ngram=max_ngram)
  if kind == "layer_skip":
    return layer_skip(target, num_layers)
  if not is_int(vocab_subset) or vocab_subset < 0:
    raise ValueError(f"vocab_subset must be an int >= 0 (0: all ids), got {vocab_subset!r}.")
  drafter = heads.drafter(target, load_head(kind, target, dtype) if head is None else head)
  if vocab_subset:
    drafter = drafter.with_vocab_subset(frequent_token_ids(vocab_subset))
  return drafter


def load_checkpoints(
  target: str = "",
  draft: str = "",
  *,
  dtype=jnp.float32,
  need_draft: bool = True,
  own_tokenizer: bool = False,
  fields: tuple[str, str] = ("config.target", "config.draft"),
  scale: str | None = None,
  draft_dtype=None,
) -> Checkpoints:
  """The target and draft a launcher decodes with: the bundled pair, or two
  Hugging Face checkpoints (directories, or hub repo ids in the local cache).

  Args:
    target, draft: checkpoint names; both empty: the bundled pair (with
      `own_tokenizer`, the bundled cross draft in place of its draft).
    dtype: the weights' dtype.
    need_draft: False: no draft is loaded (`draft` and its fields are None).
    own_tokenizer: the draft has a tokenizer of its own (cross-tokenizer
      drafting), which it must have; otherwise the two must share one.
    fields: how messages name `target` and `draft` (the launcher's flags).
    scale: the bundled pair grown to a preset of `scales.SCALES` (`load_pair`);
      only with the bundled pair and its own draft.
    draft_dtype: the draft's weights' dtype (None: `dtype`).

  Raises:
    ValueError: a target without a tokenizer, a draft that is needed but not
      named, or a draft whose tokenizer does not fit.
    FileNotFoundError: a checkpoint that is not there (`resolve_checkpoint`).
  """
  if scale and (target or draft or own_tokenizer):
    raise ValueError(
      f"scale={scale!r} grows the bundled pair; it takes no {fields[0]} / {fields[1]} "
      "and no draft with a tokenizer of its own."
    )
  if not target:
    if draft:
      raise ValueError(f"{fields[1]} needs {fields[0]} (both Hugging Face checkpoints).")
    return _bundled_checkpoints(dtype, need_draft, own_tokenizer, scale or None, draft_dtype)
  if need_draft and not draft:
    raise ValueError(f"{fields[1]} must name the draft checkpoint for {fields[0]}.")
  # Both names resolved before any weights load: a missing draft fails at once.
  target_path = resolve_checkpoint(target, flag=f"--{fields[0]}")
  draft_path = resolve_checkpoint(draft, flag=f"--{fields[1]}") if need_draft else None
  target_model, tokenizer = load_model(target_path, dtype=dtype)
  if tokenizer is None:
    raise ValueError(f"{fields[0]}: {target_path} has no tokenizer.json; decoding text needs one.")
  if not need_draft:
    return Checkpoints(target_model, None, tokenizer, None, target_path, None)
  logging.info("pair check:\n%s", check_pair(target_path, draft_path))
  draft_model, draft_tokenizer = load_model(draft_path, dtype=draft_dtype or dtype)
  if not own_tokenizer:
    check_same_tokenizer(tokenizer, draft_tokenizer, target_path, draft_path)
  elif draft_tokenizer is None:
    raise ValueError(
      f"{fields[1]}: {draft_path} has no tokenizer.json; a draft with a tokenizer of its "
      "own needs one."
    )
  return Checkpoints(target_model, draft_model, tokenizer, draft_tokenizer, target_path, draft_path)


def _bundled_checkpoints(
  dtype, need_draft: bool, own_tokenizer: bool, scale, draft_dtype
) -> Checkpoints:
  """`load_checkpoints` of the bundled pair (the cross draft with `own_tokenizer`;
  grown to `scale`'s shapes when that is set)."""
  target, draft, tokenizer = load_pair(dtype, scale=scale, draft_dtype=draft_dtype)
  if not need_draft:
    return Checkpoints(target, None, tokenizer, None, TARGET_DIR, None)
  if own_tokenizer:
    cross, cross_tokenizer = load_cross_draft(draft_dtype or dtype)
    return Checkpoints(target, cross, tokenizer, cross_tokenizer, TARGET_DIR, CROSS_DRAFT_DIR)
  return Checkpoints(target, draft, tokenizer, tokenizer, TARGET_DIR, DRAFT_DIR)


def model_card() -> dict:
  """The training record of the bundled pair (commands, steps, tokens, metrics, sha256)."""
  if not os.path.exists(CARD_FILE):
    raise FileNotFoundError(f"the bundled pair is incomplete: {CARD_FILE} is missing ({_REBUILD})")
  return read_json_object(CARD_FILE)


__all__ = [
  "BUNDLED_FILES",
  "CARD_FILE",
  "CROSS_DRAFT_DIR",
  "Checkpoints",
  "DRAFT_DIR",
  "HEADS_CARD_FILE",
  "HEADS_DIR",
  "HEAD_FILES",
  "PAIR_DIR",
  "Pair",
  "SCALES",
  "Scale",
  "TARGET_DIR",
  "OTHER_DRAFTERS",
  "TOKENIZER_FILE",
  "bundled_configs",
  "drafter_kinds",
  "file_sha256",
  "file_sums",
  "head_file_sums",
  "heads_card",
  "frequent_token_ids",
  "load_checkpoints",
  "load_cross_draft",
  "load_drafter",
  "load_head",
  "load_pair",
  "model_card",
  "scale_pair",
  "scaled_configs",
]

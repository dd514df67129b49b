"""Checking a draft/target pair of checkpoints before decoding them together."""

from __future__ import annotations

from typing import Any, NamedTuple

from specjax.hf.generation import generation_settings
from specjax.hf.hub import resolve_checkpoint
from specjax.hf.loader import load_tokenizer, read_config


class PairReport(NamedTuple):
  """What `check_pair` found.

  Attributes:
    drafter: how to draft with this pair: "model" (one tokenizer: a plain draft
      model) or "cross_tokenizer" (`specjax.drafting.CrossTokenizerDrafter`, or
      `specjax.string_level_generate`).
    problems: what stops the pair from decoding as it is (empty when it can).
    notes: what is worth knowing but does not stop it.
    details: sizes, ids and, across tokenizers, the vocabulary map's report.
  """

  drafter: str
  problems: tuple[str, ...]
  notes: tuple[str, ...]
  details: dict[str, Any]

  def __str__(self) -> str:
    lines = [f"drafter: {self.drafter}"]
    lines += [f"problem: {p}" for p in self.problems] + [f"note: {n}" for n in self.notes]
    return "\n".join(lines)


def check_pair(
  target: str, draft: str, revision: str | None = None, cache_dir: str | None = None
) -> PairReport:
  """Reads both checkpoints' configs, tokenizers and generation settings (no
  weights) and reports whether and how they decode together.

  Args:
    target, draft: checkpoint directories or cached hub repo ids.
    revision: the target's and draft's revision when both are repo ids.
  """
  paths = {
    role: resolve_checkpoint(name, revision, cache_dir)
    for role, name in (("target", target), ("draft", draft))
  }
  configs = {role: read_config(path) for role, path in paths.items()}
  tokenizers = {role: load_tokenizer(path) for role, path in paths.items()}
  settings = {role: generation_settings(path) for role, path in paths.items()}
  problems, notes = [], []
  details: dict[str, Any] = {"paths": paths}
  for role in paths:
    vocab = configs[role].get("vocab_size")
    details[f"{role}_vocab_size"] = vocab
    tok = tokenizers[role]
    if tok is None:
      problems.append(f"{role} ({paths[role]}) has no tokenizer.json; text needs one.")
      continue
    details[f"{role}_tokenizer_size"] = tok.vocab_size
    if isinstance(vocab, int) and vocab < tok.vocab_size:
      problems.append(
        f"{role}: config.json vocab_size {vocab} is below its tokenizer's {tok.vocab_size} ids."
      )
    details[f"{role}_eos_ids"] = list(settings[role].eos_ids)
  if None in tokenizers.values():
    return PairReport("model", tuple(problems), tuple(notes), details)
  same = tokenizers["target"].get_vocab() == tokenizers["draft"].get_vocab()
  if same:
    drafter = "model"
    sizes = (details["target_vocab_size"], details["draft_vocab_size"])
    if sizes[0] != sizes[1]:
      notes.append(
        f"vocabulary sizes differ ({sizes[0]} target, {sizes[1]} draft) over one tokenizer: "
        "ids a model lacks get probability 0 in its law (exact)."
      )
    if settings["target"].eos_ids != settings["draft"].eos_ids:
      notes.append(
        f"EOS ids differ (target {list(settings['target'].eos_ids)}, draft "
        f"{list(settings['draft'].eos_ids)}): decoding stops on the target's."
      )
  else:
    from specjax.vocab_map import build_vocab_map

    drafter = "cross_tokenizer"
    report = build_vocab_map(
      tokenizers["draft"],
      tokenizers["target"],
      details["draft_vocab_size"],
      details["target_vocab_size"],
    ).report()
    details["vocab_map"] = report
    notes.append(
      "different tokenizers: draft with specjax.drafting.CrossTokenizerDrafter (or "
      f"specjax.string_level_generate); {report['shared']} ids are shared "
      f"({report['shared_fraction_of_target']:.0%} of the target's vocabulary)."
    )
    if not report["shared"]:
      notes.append("no shared id: token-level intersection drafts nothing (plain decoding).")
  return PairReport(drafter, tuple(problems), tuple(notes), details)

"""Checking a draft/target pair of checkpoints before decoding them together."""

from __future__ import annotations

from typing import Any, NamedTuple

from specjax.data.tokenizer import Tokenizer
from specjax.hf.generation import GenerationSettings, generation_settings
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
  details: dict[str, Any] = {"paths": paths}
  problems = []
  for role, path in paths.items():
    problems += _check_one(role, path, configs[role], tokenizers[role], settings[role], details)
  if None in tokenizers.values():
    return PairReport("model", tuple(problems), (), details)
  if tokenizers["target"].get_vocab() == tokenizers["draft"].get_vocab():
    notes = _same_tokenizer_notes(settings, details)
    return PairReport("model", tuple(problems), tuple(notes), details)
  notes = _cross_tokenizer_notes(tokenizers, details)
  return PairReport("cross_tokenizer", tuple(problems), tuple(notes), details)


def _check_one(
  role: str,
  path: str,
  config: dict[str, Any],
  tokenizer: Tokenizer | None,
  settings: GenerationSettings,
  details: dict[str, Any],
) -> list[str]:
  """The problems of one checkpoint (`role`: "target" or "draft"); records its
  vocabulary size, tokenizer size and EOS ids in `details`."""
  vocab = config.get("vocab_size")
  details[f"{role}_vocab_size"] = vocab
  if tokenizer is None:
    return [f"{role} ({path}) has no tokenizer.json; text needs one."]
  problems = []
  details[f"{role}_tokenizer_size"] = tokenizer.vocab_size
  if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
    problems.append(
      f"{role}: config.json vocab_size {vocab} is below its tokenizer's {tokenizer.vocab_size} ids."
    )
  details[f"{role}_eos_ids"] = list(settings.eos_ids)
  return problems


def _same_tokenizer_notes(
  settings: dict[str, GenerationSettings], details: dict[str, Any]
) -> list[str]:
  """What is worth knowing about a pair over one tokenizer: differing vocabulary
  sizes or EOS ids."""
  notes = []
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
  return notes


def _cross_tokenizer_notes(tokenizers: dict[str, Tokenizer], details: dict[str, Any]) -> list[str]:
  """How a pair over two tokenizers drafts; records the vocabulary map's report
  in `details["vocab_map"]`."""
  from specjax.vocab_map import build_vocab_map

  report = build_vocab_map(
    tokenizers["draft"],
    tokenizers["target"],
    details["draft_vocab_size"],
    details["target_vocab_size"],
  ).report()
  details["vocab_map"] = report
  notes = [
    "different tokenizers: draft with specjax.drafting.CrossTokenizerDrafter (or "
    f"specjax.string_level_generate); {report['shared']} ids are shared "
    f"({report['shared_fraction_of_target']:.0%} of the target's vocabulary)."
  ]
  if not report["shared"]:
    notes.append("no shared id: token-level intersection drafts nothing (plain decoding).")
  return notes

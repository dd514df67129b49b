"""A checkpoint's own generation settings: EOS ids, pad id and default sampling.

`generation_config.json` as transformers reads it (`config.json`'s ids when it
has none): `do_sample` false means greedy whatever the temperature; sampling
keys it leaves out take transformers' defaults (temperature 1, top_k 50, top_p
1). `repetition_penalty` (transformers' definition is specjax's: over the prompt
and the generated tokens, before temperature; greedy decoding too) is kept, in
(0, 2]. Settings specjax cannot reproduce exactly (min_p, which transformers
applies after top-p and specjax before it, beams, ...) are refused with the key
named, never dropped silently.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from specjax.hf.config import UnsupportedConfigError
from specjax.hf.hub import resolve_checkpoint
from specjax.hf.loader import read_config
from specjax.sampling import SamplingParams
from specjax.validation import is_int, is_real, read_json_object

# transformers' GenerationConfig defaults for the keys specjax reads.
HF_DEFAULTS = dict(temperature=1.0, top_k=50, top_p=1.0)
# Keys whose non-default values change what is sampled; specjax has none of them.
_REFUSED = dict(
  min_p=None,
  typical_p=1.0,
  epsilon_cutoff=0.0,
  eta_cutoff=0.0,
  num_beams=1,
  no_repeat_ngram_size=0,
  encoder_repetition_penalty=1.0,
  penalty_alpha=None,
)


class GenerationSettings(NamedTuple):
  """What a checkpoint says about decoding it.

  Attributes:
    sampling: its default `SamplingParams` (GREEDY unless `do_sample`).
    eos_ids: the ids that end a sequence (several allowed), () when none.
    pad_id: its pad id, or None.
  """

  sampling: SamplingParams
  eos_ids: tuple[int, ...]
  pad_id: int | None


def _ids(value, key: str, source: str) -> tuple[int, ...]:
  if value is None:
    return ()
  ids = [value] if is_int(value) else value
  if not isinstance(ids, list) or not all(is_int(i) and i >= 0 for i in ids):
    raise ValueError(f"{source}: {key} must be an id or a list of ids, got {value!r}.")
  return tuple(dict.fromkeys(int(i) for i in ids))


def generation_settings(
  name_or_path: str, revision: str | None = None, cache_dir: str | None = None
) -> GenerationSettings:
  """The generation settings of a checkpoint directory or cached hub repo id.

  Raises:
    FileNotFoundError: no such checkpoint (see `resolve_checkpoint`).
    UnsupportedConfigError: a sampling setting specjax cannot reproduce, named.
    ValueError: a malformed value, naming the file and key.
  """
  path = resolve_checkpoint(name_or_path, revision, cache_dir)
  config = read_config(path)
  file = os.path.join(path, "generation_config.json")
  gen = read_json_object(file) if os.path.exists(file) else {}
  source = file if gen else os.path.join(path, "config.json")
  eos = _ids(gen.get("eos_token_id", config.get("eos_token_id")), "eos_token_id", source)
  pad = _ids(gen.get("pad_token_id", config.get("pad_token_id")), "pad_token_id", source)
  for key, default in _REFUSED.items():
    if gen.get(key, default) != default:
      raise UnsupportedConfigError(
        f"{file}: {key}={gen[key]!r} is not supported (specjax reads temperature, "
        "top_k, top_p and repetition_penalty); remove it to decode without it."
      )
  penalty = gen.get("repetition_penalty", 1.0)
  if not is_real(penalty) or not 0 < penalty <= 2:
    raise UnsupportedConfigError(
      f"{file}: repetition_penalty={penalty!r} is not supported (specjax takes it in (0, 2])."
    )
  sampling = SamplingParams(temperature=0.0, repetition_penalty=penalty)
  if gen.get("do_sample", False):
    values = {k: gen.get(k, v) for k, v in HF_DEFAULTS.items()}
    if not is_real(values["temperature"]) or values["temperature"] < 0:
      raise ValueError(f"{file}: temperature must be a number >= 0, got {values['temperature']!r}.")
    if values["top_k"] is None:
      values["top_k"] = 0
    if not is_int(values["top_k"]) or values["top_k"] < 0:
      raise ValueError(f"{file}: top_k must be an int >= 0, got {values['top_k']!r}.")
    if not is_real(values["top_p"]) or not 0 < values["top_p"] <= 1:
      raise ValueError(f"{file}: top_p must be in (0, 1], got {values['top_p']!r}.")
    sampling = SamplingParams(
      temperature=float(values["temperature"]),
      top_k=int(values["top_k"]),
      top_p=float(values["top_p"]),
      repetition_penalty=penalty,
    )
  return GenerationSettings(sampling, eos, pad[0] if pad else None)


def sampling_from_checkpoint(
  name_or_path: str, revision: str | None = None, cache_dir: str | None = None
) -> SamplingParams:
  """The checkpoint's default `SamplingParams` (`generation_settings(...).sampling`)."""
  return generation_settings(name_or_path, revision, cache_dir).sampling

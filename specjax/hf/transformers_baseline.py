"""What users would run instead: transformers' `generate`, plain and assisted.

Times Hugging Face transformers on the same checkpoint directories that specjax
loads, so the two can be compared per token. Assisted generation only supports
batch size 1 in transformers, so these timings use one row. The assistant is
set to a constant `gamma` drafted tokens (transformers defaults to a heuristic
schedule) and no confidence cut-off, to match specjax's fixed-gamma loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.bench.timing import time_calls
from specjax.dtypes import to_dtype
from specjax.hf.optional import import_torch_transformers
from specjax.sampling import SamplingParams


def time_transformers(
  target_path: str,
  draft_path: str,
  prompt_ids: list[int],
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  dtype: str,
  num_runs: int,
  seed: int = 0,
) -> dict[str, Any]:
  """Median ms per generated token of transformers' generate, without and with the draft.

  Args:
    prompt_ids: one prompt's token ids (batch 1).
    dtype: a name from `specjax.dtypes.DTYPES`, e.g. "float32" or "bfloat16"
      (both models).

  Returns:
    {"hf_ms_per_token", "hf_assisted_ms_per_token", "hf_tokens", "hf_assisted_tokens"}
    where the token lists are the last run's generated ids.
  """
  to_dtype(dtype)  # validates the name before the heavy imports
  if dataclasses.replace(sampling, repetition_penalty=1.0).has_warps:
    raise ValueError(
      "the transformers comparison takes temperature, top_k, top_p and repetition_penalty "
      "only (transformers' generate has no presence or frequency penalty, and applies "
      f"min_p after top-p), got {sampling!r}."
    )
  torch, transformers = import_torch_transformers("the transformers comparison")

  torch_dtype = getattr(torch, dtype)  # the DTYPES names are torch's names too
  target, draft = (
    transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype).eval()
    for p in (target_path, draft_path)
  )
  for model in (target, draft):  # fixed length: no EOS stop (specjax runs eos_id=None)
    model.generation_config.eos_token_id = None
  draft.generation_config.num_assistant_tokens = gamma
  draft.generation_config.num_assistant_tokens_schedule = "constant"
  draft.generation_config.assistant_confidence_threshold = 0.0
  ids = torch.tensor([prompt_ids])
  kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, pad_token_id=0)
  kwargs.update(repetition_penalty=sampling.repetition_penalty)  # the same definition
  if sampling.greedy:
    kwargs.update(do_sample=False)
  else:
    kwargs.update(
      do_sample=True,
      temperature=sampling.temperature,
      top_k=sampling.top_k or None,
      top_p=sampling.top_p,
    )

  def generate(**extra):
    torch.manual_seed(seed)
    with torch.no_grad():
      return target.generate(ids, **kwargs, **extra)[0, ids.shape[1] :]

  timings, outputs = time_calls(
    {"plain": generate, "assisted": lambda: generate(assistant_model=draft)}, num_runs
  )
  result = {}
  for name, key in (("plain", "hf"), ("assisted", "hf_assisted")):
    tokens = outputs[name].numpy().tolist()
    result[f"{key}_ms_per_token"] = timings[name].median_s * 1e3 / len(tokens)
    result[f"{key}_tokens"] = tokens
  return result

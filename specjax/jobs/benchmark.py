"""Autoregressive against speculative decoding on models built from a config:
what `experiments/benchmark.py` runs (`run`).

`run` builds the models (`build_models`) and random prompts and returns
`specjax.bench.benchmark_generation`'s full result; `COLUMNS` its headline figures.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import ml_collections
from flax import nnx

import specjax
from specjax import bench, dtypes
from specjax.models.kv_cache import cache_capacity
from specjax.results import markdown_table
from specjax.validation import check_loop, check_positive_int


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the first invalid field of `config`."""
  for name, minimum in (
    ("batch_size", 1),
    ("prompt_len", 1),
    ("max_new_tokens", 1),
    ("gamma", 1),
    ("num_runs", 3),
    ("step_timing_steps", 1),
    ("top_k", 0),
    ("seed", 0),
  ):
    check_positive_int(f"config.{name}", config[name], minimum)
  check_loop(config.loop, config.loop_chunk, "config.")
  if not isinstance(config.draft_is_target, bool):
    raise ValueError(f"config.draft_is_target must be a bool, got {config.draft_is_target!r}.")
  dtypes.to_dtype(config.dtype, "config.dtype")
  for name in ("target", "draft"):
    if "dtype" in config[name] or "param_dtype" in config[name]:
      raise ValueError(f"config.{name} must not set dtype/param_dtype; use config.dtype.")
  if not config.draft_is_target and config.draft.get("vocab_size") != config.target.get(
    "vocab_size"
  ):
    raise ValueError(
      f"config.draft.vocab_size ({config.draft.get('vocab_size')}) must "
      f"equal config.target.vocab_size ({config.target.get('vocab_size')})."
    )
  # temperature, top_k and top_p get SamplingParams' own range checks.


# The printed table: the headline figures of one result (the launcher's `markdown`).
COLUMNS = (
  ("preset", "{preset}"),
  ("target", lambda r: _count(r["target_params"])),
  ("draft", lambda r: _count(r["draft_params"])),
  ("batch", "{config[batch_size]}"),
  ("γ", "{config[gamma]}"),
  ("T", "{config[temperature]:g}"),
  ("AR ms/token", "{ar_ms_per_token:.3f}"),
  ("spec ms/token", "{spec_ms_per_token:.3f}"),
  ("speedup", "{speedup:.2f}"),
  ("predicted", "{predicted_speedup:.2f}"),
  ("α", "{acceptance_rate:.3f}"),
  ("tokens/iter", "{tokens_per_iteration:.2f}"),
  ("c", "{c:.3f}"),
  ("verify cost", "{verify_cost_ratio:.2f}"),
)


def _count(n: int) -> str:
  """A parameter count in a few characters: 426624 -> "0.43M", 42080 -> "42.1K"."""
  return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


LONG_PROMPT = 512  # tokens of the prompt whose time to first token is reported


def model_config(
  fields: ml_collections.ConfigDict, config: ml_collections.ConfigDict
) -> specjax.ModelConfig:
  """`ModelConfig` from a preset's fields, with max_seq_len and dtypes filled in."""
  kwargs = fields.to_dict()
  # At least 512 slots, so the long-prompt time to first token can be measured.
  capacity = cache_capacity(config.prompt_len, config.max_new_tokens, config.gamma)
  kwargs.setdefault("max_seq_len", max(capacity, LONG_PROMPT))
  return specjax.ModelConfig(dtype=config.dtype, param_dtype=config.dtype, **kwargs)


def build_models(
  config: ml_collections.ConfigDict,
) -> tuple[specjax.Transformer, specjax.Transformer]:
  """(target, draft); the same object twice when `config.draft_is_target`."""
  target = specjax.Transformer(model_config(config.target, config), rngs=nnx.Rngs(config.seed))
  if config.draft_is_target:
    return target, target
  draft = specjax.Transformer(model_config(config.draft, config), rngs=nnx.Rngs(config.seed + 1))
  return target, draft


def run(config: ml_collections.ConfigDict, *, progress: bool = False) -> dict[str, Any]:
  """Runs the benchmark described by `config`; returns the JSON-ready result.

  Args:
    config: the benchmark's configuration (configs/benchmark.py).
    progress: print a line on stderr as each measurement starts.
  """
  check_config(config)
  sampling = specjax.SamplingParams(
    temperature=float(config.temperature), top_k=config.top_k, top_p=float(config.top_p)
  )
  target, draft = build_models(config)
  prompts, lengths = bench.random_prompts(
    jax.random.fold_in(jax.random.key(config.seed), 1),
    config.batch_size,
    config.prompt_len,
    target.cfg.vocab_size,
  )
  result = {
    "preset": config.preset,
    "config": config.to_dict(),
    "target_params": target.num_params,
    "draft_params": draft.num_params,
    "max_seq_len": target.cfg.max_seq_len,
    **bench.environment_info(),
  }
  result.update(
    bench.benchmark_generation(
      target,
      draft,
      prompts,
      lengths,
      gamma=config.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      key=jax.random.fold_in(jax.random.key(config.seed), 2),
      num_runs=config.num_runs,
      step_timing_steps=config.step_timing_steps,
      loop=config.loop,
      loop_chunk=config.loop_chunk,
      progress=functools.partial(print, file=sys.stderr, flush=True) if progress else None,
    )
  )
  return result


def markdown(result: dict[str, Any]) -> str:
  """The headline figures of a `run` result as a one-row markdown table."""
  return markdown_table([result], COLUMNS)

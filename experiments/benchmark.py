"""Benchmark: autoregressive vs speculative decoding, measured and predicted.

  python -m experiments.benchmark --config=configs/benchmark.py[:tiny|:medium|:self] \
      [--config.max_new_tokens=16 ...] [--output_json=PATH]

Builds the target and draft from the config, random prompts from the seed, and
hands them to `specjax.benchmarking.benchmark_generation`; prints the result as
JSON and writes it to --output_json when given.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

import specjax
from specjax import benchmarking
from specjax.generation import validation

_DTYPES = ("float32", "bfloat16", "float16")


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the first invalid field of `config`."""
  for name, minimum in (("batch_size", 1), ("prompt_len", 1), ("max_new_tokens", 1),
                        ("gamma", 1), ("num_runs", 3), ("step_timing_steps", 1),
                        ("top_k", 0), ("seed", 0)):
    validation.check_positive_int(f"config.{name}", config[name], minimum)
  if not isinstance(config.draft_is_target, bool):
    raise ValueError(
        f"config.draft_is_target must be a bool, got {config.draft_is_target!r}.")
  if config.dtype not in _DTYPES:
    raise ValueError(f"config.dtype must be one of {_DTYPES}, got {config.dtype!r}.")
  for name in ("target", "draft"):
    if "dtype" in config[name] or "param_dtype" in config[name]:
      raise ValueError(f"config.{name} must not set dtype/param_dtype; use config.dtype.")
  if (not config.draft_is_target
      and config.draft.get("vocab_size") != config.target.get("vocab_size")):
    raise ValueError(f"config.draft.vocab_size ({config.draft.get('vocab_size')}) must "
                     f"equal config.target.vocab_size ({config.target.get('vocab_size')}).")
  # temperature, top_k and top_p get SamplingParams' own range checks.


def model_config(fields: ml_collections.ConfigDict, config: ml_collections.ConfigDict
                 ) -> specjax.ModelConfig:
  """`ModelConfig` from a preset's fields, with max_seq_len and dtypes filled in."""
  kwargs = fields.to_dict()
  kwargs.setdefault("max_seq_len",
                    config.prompt_len + config.max_new_tokens + config.gamma + 1)
  return specjax.ModelConfig(dtype=config.dtype, param_dtype=config.dtype, **kwargs)


def build_models(config: ml_collections.ConfigDict
                 ) -> tuple[specjax.Transformer, specjax.Transformer]:
  """(target, draft); the same object twice when `config.draft_is_target`."""
  target = specjax.Transformer(model_config(config.target, config),
                               rngs=nnx.Rngs(config.seed))
  if config.draft_is_target:
    return target, target
  draft = specjax.Transformer(model_config(config.draft, config),
                              rngs=nnx.Rngs(config.seed + 1))
  return target, draft


def make_prompts(config: ml_collections.ConfigDict, vocab_size: int):
  """Random token ids `[batch_size, prompt_len]`; every row is full length."""
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  prompts = jax.random.randint(key, (config.batch_size, config.prompt_len), 0, vocab_size,
                               dtype=jnp.int32)
  lengths = jnp.full((config.batch_size,), config.prompt_len, jnp.int32)
  return prompts, lengths


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Runs the benchmark described by `config`; returns the JSON-ready result."""
  check_config(config)
  sampling = specjax.SamplingParams(temperature=float(config.temperature),
                                    top_k=config.top_k, top_p=float(config.top_p))
  target, draft = build_models(config)
  prompts, lengths = make_prompts(config, target.cfg.vocab_size)
  result = {
      "preset": config.preset,
      "config": config.to_dict(),
      "target_params": target.num_params,
      "draft_params": draft.num_params,
      "max_seq_len": target.cfg.max_seq_len,
      **benchmarking.environment_info(),
  }
  result.update(benchmarking.benchmark_generation(
      target, draft, prompts, lengths, gamma=config.gamma,
      max_new_tokens=config.max_new_tokens, sampling=sampling,
      key=jax.random.fold_in(jax.random.key(config.seed), 2), num_runs=config.num_runs,
      step_timing_steps=config.step_timing_steps))
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  result = run(flags.FLAGS.config)
  text = json.dumps(result, indent=2)
  print(text)
  if flags.FLAGS.output_json:
    directory = os.path.dirname(flags.FLAGS.output_json)
    if directory:
      os.makedirs(directory, exist_ok=True)
    with open(flags.FLAGS.output_json, "w") as f:
      f.write(text + "\n")


def define_flags() -> None:
  """Flags live here, not at import, so tests can import several launchers."""
  config_flags.DEFINE_config_file(
      "config", None, "Benchmark configuration file (configs/benchmark.py[:preset]).",
      lock_config=True)
  flags.DEFINE_string("output_json", None, "Also write the result JSON to this path.")
  flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""A training set of a target's own continuations, for draft distillation.

Each sample is a window of `prompt_tokens` train-split tokens followed by
`new_tokens` tokens the target generated from it, then `<eos>`: half of the
batches greedy (what temperature-0 decoding meets), half sampled at
temperature 1. The output directory is a data directory for `train`:
`train.bin` holds the samples; validation, test and tokenizer are copied from
the corpus data directory, so validation metrics stay comparable.

Error messages name the flags of `experiments/generate_data.py`, which is this
module's launcher.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.data import TokenDataset, Tokenizer
from specjax.data.dataset import check_data_dir, check_tokenizer, tokenizer_record, write_meta
from specjax.generation import autoregressive_generate
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams
from specjax.training.checkpoint import MODEL_CONFIG_FILE, load_trained_model
from specjax.training.heads import check_target_dir, load_target
from specjax.validation import check_int, check_positive_int

COPIED = ("validation.bin", "validation.json", "test.bin", "test.json")


def write_continuations(
  target_run: str,
  data_dir: str,
  out: str,
  num_batches: int,
  batch_size: int,
  prompt_tokens: int,
  new_tokens: int,
  seed: int,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Writes `out/train.bin` of target continuations (and copies the rest); returns its meta.

  Samples are `[prompt_tokens + new_tokens + 1]` rows ending in the tokenizer's
  `<eos>`. Every argument and input file is checked before the target runs.

  Args:
    target_run: a training run or Hugging Face directory of the target.
    data_dir: the corpus data directory (tokenizer.json and the token files).
    out: the output data directory (not `data_dir`).
    num_batches: generation batches (even: greedy, odd: temperature 1).
    batch_size: prompts per batch.
    prompt_tokens, new_tokens: corpus tokens before each continuation, and
      tokens the target generates after them.
    seed: seed of the prompt windows and of sampling.
    log: where progress lines go.
  """
  tokenizer, train = _check_inputs(
    target_run, data_dir, out, num_batches, batch_size, prompt_tokens, new_tokens, seed
  )
  target, step = _load_target(target_run, tokenizer, prompt_tokens + new_tokens, data_dir)
  start = time.perf_counter()
  tokens = _continuations(
    target, train, tokenizer.eos_id, num_batches, batch_size, prompt_tokens, new_tokens, seed, log
  )
  if tokens.max() >= tokenizer.vocab_size:
    raise ValueError(
      f"the target generated id {tokens.max()}, outside the "
      f"{tokenizer.vocab_size} ids of {os.path.join(data_dir, 'tokenizer.json')}."
    )
  meta = {
    "split": "train",
    "source": "target continuations",
    "target_run": target_run,
    "target_step": step,
    "samples": num_batches * batch_size,
    "prompt_tokens": prompt_tokens,
    "new_tokens": new_tokens,
    "tokens": int(tokens.size),
    "greedy_batches": (num_batches + 1) // 2,
    "seed": seed,
    "seconds": time.perf_counter() - start,
    **tokenizer_record(tokenizer),
  }
  _write(out, tokens, meta, data_dir)
  return meta


def _check_inputs(
  target_run: str,
  data_dir: str,
  out: str,
  num_batches: int,
  batch_size: int,
  prompt_tokens: int,
  new_tokens: int,
  seed: int,
) -> tuple[Tokenizer, TokenDataset]:
  """The arguments and paths checked (each error naming its flag), before the
  target loads; returns the data directory's tokenizer and train split."""
  for name, value in (
    ("num_batches", num_batches),
    ("batch_size", batch_size),
    ("prompt_tokens", prompt_tokens),
    ("new_tokens", new_tokens),
  ):
    check_positive_int(name, value)
  check_int("seed", seed, minimum=0)
  check_target_dir(target_run, "--target")
  check_data_dir(data_dir, "--data_dir", ("tokenizer.json", "train.bin", "train.json", *COPIED))
  if os.path.abspath(out) == os.path.abspath(data_dir):
    raise ValueError(
      f"--out must be another directory than --data_dir, got {out!r} for both: "
      "it would overwrite the corpus token files."
    )
  if os.path.exists(out) and not os.path.isdir(out):
    raise NotADirectoryError(f"--out: {out} is a file, not a data directory")
  tokenizer_path = os.path.join(data_dir, "tokenizer.json")
  tokenizer = Tokenizer.from_file(tokenizer_path)
  if tokenizer.eos_id is None:
    raise ValueError(f"{tokenizer_path} has no <eos> token to end each sample with.")
  train_path = os.path.join(data_dir, "train.bin")
  check_tokenizer(train_path, tokenizer)
  return tokenizer, TokenDataset(train_path)


def _load_target(
  target_run: str, tokenizer: Tokenizer, length: int, data_dir: str
) -> tuple[Transformer, int | None]:
  """`(target, step)`: a training run's model in float32 (and its step) or a Hugging
  Face directory's (step None), checked to cover the tokenizer and `length` positions."""
  if os.path.isfile(os.path.join(target_run, MODEL_CONFIG_FILE)):
    target, step = load_trained_model(target_run, dtype="float32")
  else:  # a Hugging Face directory, e.g. the bundled pair's target
    target, step = load_target(target_run), None
  if target.cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(
      f"the target's vocab_size {target.cfg.vocab_size} is below the "
      f"{tokenizer.vocab_size} ids of {os.path.join(data_dir, 'tokenizer.json')}."
    )
  if length > target.cfg.max_seq_len:
    raise ValueError(
      f"prompt_tokens + new_tokens = {length} exceeds the "
      f"target's max_seq_len {target.cfg.max_seq_len}."
    )
  return target, step


def _continuations(
  target: Transformer,
  train: TokenDataset,
  eos_id: int,
  num_batches: int,
  batch_size: int,
  prompt_tokens: int,
  new_tokens: int,
  seed: int,
  log: Callable[[str], None],
) -> np.ndarray:
  """The samples, flat: `num_batches * batch_size` rows of
  `[prompt_tokens + new_tokens + 1]` tokens (prompt, continuation, `eos_id`)."""
  chunks, start = [], time.perf_counter()
  for i in range(num_batches):
    prompts = train.batch(i, batch_size, prompt_tokens - 1, seed)  # [B, prompt_tokens]
    result = autoregressive_generate(
      target,
      jnp.asarray(prompts),
      jnp.full((batch_size,), prompt_tokens, jnp.int32),
      max_new_tokens=new_tokens,
      sampling=SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0),
      key=jax.random.key(seed * 100003 + i),
    )
    body = np.concatenate(
      [prompts, np.asarray(result.tokens), np.full((batch_size, 1), eos_id, np.int32)], axis=1
    )
    chunks.append(body.ravel())
    if i % 10 == 0:
      log(f"batch {i + 1}/{num_batches}: {time.perf_counter() - start:.0f} s")
  return np.concatenate(chunks)


def _write(out: str, tokens: np.ndarray, meta: dict[str, Any], data_dir: str) -> None:
  """Writes `out/train.bin` (atomically) and its meta, then copies the other
  splits and the tokenizer from `data_dir`."""
  os.makedirs(out, exist_ok=True)
  out_train = os.path.join(out, "train.bin")
  tmp = f"{out_train}.tmp{os.getpid()}"
  tokens.astype(np.uint16).tofile(tmp)
  os.replace(tmp, out_train)
  write_meta(out_train, meta)
  # After train.bin's meta: copied splits without it would make a training run on
  # `out` encode the corpus train split there instead of using these samples.
  for name in COPIED + ("tokenizer.json",):
    shutil.copyfile(os.path.join(data_dir, name), os.path.join(out, name))

"""Write a training set of the target's own continuations (for draft distillation).

  python -m experiments.generate_data --target=runs/target --data_dir=runs/data \
      --out=runs/data_gen [--num_batches=80 --batch_size=128]

Each sample is a window of `prompt_tokens` train-split tokens followed by
`new_tokens` tokens the target generated from it, then `<eos>`: half of the
batches greedy (what temperature-0 decoding meets), half sampled at
temperature 1. The output directory is a data directory for
`experiments/train.py`: `train.bin` holds the samples; validation, test and
tokenizer are copied from --data_dir, so validation metrics stay comparable.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import specjax
from experiments import common
from specjax.data import TokenDataset, Tokenizer
from specjax.data.dataset import check_data_dir, check_tokenizer, tokenizer_record, write_meta
from specjax.training.checkpoint import MODEL_CONFIG_FILE, load_trained_model
from specjax.training.heads import check_target_dir, load_target
from specjax.validation import check_int, check_positive_int

_COPIED = ("validation.bin", "validation.json", "test.bin", "test.json")


def generate(
  target_run: str,
  data_dir: str,
  out: str,
  num_batches: int,
  batch_size: int,
  prompt_tokens: int,
  new_tokens: int,
  seed: int,
) -> dict:
  """Writes `out/train.bin` of target continuations (and copies the rest); returns its meta.

  Samples are `[prompt_tokens + new_tokens + 1]` rows ending in the tokenizer's
  `<eos>`. Every argument and input file is checked before the target runs.
  """
  for name, value in (
    ("num_batches", num_batches),
    ("batch_size", batch_size),
    ("prompt_tokens", prompt_tokens),
    ("new_tokens", new_tokens),
  ):
    check_positive_int(name, value)
  check_int("seed", seed, minimum=0)
  # The paths first, each error naming its flag: before the target loads.
  check_target_dir(target_run, "--target")
  check_data_dir(data_dir, "--data_dir", ("tokenizer.json", "train.bin", "train.json", *_COPIED))
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
  train = TokenDataset(train_path)
  if os.path.isfile(os.path.join(target_run, MODEL_CONFIG_FILE)):
    target, step = load_trained_model(target_run, dtype="float32")
  else:  # a Hugging Face directory, e.g. the bundled pair's target
    target, step = load_target(target_run), None
  if target.cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(
      f"the target's vocab_size {target.cfg.vocab_size} is below the "
      f"{tokenizer.vocab_size} ids of {tokenizer_path}."
    )
  if prompt_tokens + new_tokens > target.cfg.max_seq_len:
    raise ValueError(
      f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the "
      f"target's max_seq_len {target.cfg.max_seq_len}."
    )
  chunks, start = [], time.perf_counter()
  for i in range(num_batches):
    prompts = train.batch(i, batch_size, prompt_tokens - 1, seed)  # [B, prompt_tokens]
    sampling = specjax.SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0)
    result = specjax.autoregressive_generate(
      target,
      jnp.asarray(prompts),
      jnp.full((batch_size,), prompt_tokens, jnp.int32),
      max_new_tokens=new_tokens,
      sampling=sampling,
      key=jax.random.key(seed * 100003 + i),
    )
    body = np.concatenate(
      [prompts, np.asarray(result.tokens), np.full((batch_size, 1), tokenizer.eos_id, np.int32)],
      axis=1,
    )
    chunks.append(body.ravel())
    if i % 10 == 0:
      print(f"batch {i + 1}/{num_batches}: {time.perf_counter() - start:.0f} s", flush=True)
  tokens = np.concatenate(chunks)
  if tokens.max() >= tokenizer.vocab_size:
    raise ValueError(
      f"the target generated id {tokens.max()}, outside the "
      f"{tokenizer.vocab_size} ids of {tokenizer_path}."
    )
  os.makedirs(out, exist_ok=True)
  out_train = os.path.join(out, "train.bin")
  tmp = f"{out_train}.tmp{os.getpid()}"
  tokens.astype(np.uint16).tofile(tmp)
  os.replace(tmp, out_train)
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
  write_meta(out_train, meta)
  # After train.bin's meta: copied splits without it would make a training run on
  # `out` encode the corpus train split there instead of using these samples.
  for name in _COPIED + ("tokenizer.json",):
    shutil.copyfile(os.path.join(data_dir, name), os.path.join(out, name))
  return meta


def main(argv):
  del argv
  f = flags.FLAGS
  print(
    json.dumps(
      generate(
        f.target,
        f.data_dir,
        f.out,
        f.num_batches,
        f.batch_size,
        f.prompt_tokens,
        f.new_tokens,
        f.seed,
      ),
      indent=2,
    )
  )


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string(
    "target", None, "Run directory or Hugging Face directory of the target.", required=True
  )
  flags.DEFINE_string(
    "data_dir", None, "Corpus data directory (train.bin, tokenizer.json).", required=True
  )
  flags.DEFINE_string("out", None, "Output data directory.", required=True)
  flags.DEFINE_integer("num_batches", 80, "Generation batches (even: greedy, odd: T=1).")
  flags.DEFINE_integer("batch_size", 128, "Prompts per batch.")
  flags.DEFINE_integer("prompt_tokens", 32, "Corpus tokens before each continuation.")
  flags.DEFINE_integer("new_tokens", 96, "Tokens the target generates per prompt.")
  flags.DEFINE_integer("seed", 0, "Seed of prompt windows and sampling.")


if __name__ == "__main__":
  define_flags()
  common.run(main)

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
from absl import app, flags

import specjax
from specjax.data import TokenDataset
from specjax.training.checkpoint import load_trained_model


def generate(target_run: str, data_dir: str, out: str, num_batches: int, batch_size: int,
             prompt_tokens: int, new_tokens: int, seed: int) -> dict:
  target, step = load_trained_model(target_run, dtype="float32")
  train = TokenDataset(os.path.join(data_dir, "train.bin"))
  os.makedirs(out, exist_ok=True)
  eos = 2
  chunks, start = [], time.perf_counter()
  for i in range(num_batches):
    prompts = train.batch(i, batch_size, prompt_tokens - 1, seed)  # [B, prompt_tokens]
    sampling = specjax.SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0)
    result = specjax.autoregressive_generate(
        target, jnp.asarray(prompts), jnp.full((batch_size,), prompt_tokens, jnp.int32),
        max_new_tokens=new_tokens, sampling=sampling, key=jax.random.key(seed * 100003 + i))
    body = np.concatenate([prompts, np.asarray(result.tokens),
                           np.full((batch_size, 1), eos, np.int32)], axis=1)
    chunks.append(body.astype(np.uint16).ravel())
    if i % 10 == 0:
      print(f"batch {i + 1}/{num_batches}: {time.perf_counter() - start:.0f} s", flush=True)
  tokens = np.concatenate(chunks)
  tokens.tofile(os.path.join(out, "train.bin"))
  meta = {"split": "train", "source": "target continuations", "target_run": target_run,
          "target_step": step, "samples": num_batches * batch_size,
          "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "tokens": int(tokens.size),
          "greedy_batches": (num_batches + 1) // 2, "seed": seed,
          "seconds": time.perf_counter() - start}
  with open(os.path.join(out, "train.json"), "w") as f:
    json.dump(meta, f, indent=2)
  for name in ("validation.bin", "validation.json", "test.bin", "test.json", "tokenizer.json"):
    shutil.copyfile(os.path.join(data_dir, name), os.path.join(out, name))
  return meta


def main(argv):
  del argv
  f = flags.FLAGS
  print(json.dumps(generate(f.target, f.data_dir, f.out, f.num_batches, f.batch_size,
                            f.prompt_tokens, f.new_tokens, f.seed), indent=2))


if __name__ == "__main__":
  flags.DEFINE_string("target", None, "Run directory of the target.", required=True)
  flags.DEFINE_string("data_dir", None, "Corpus data directory (train.bin, tokenizer.json).",
                      required=True)
  flags.DEFINE_string("out", None, "Output data directory.", required=True)
  flags.DEFINE_integer("num_batches", 80, "Generation batches (even: greedy, odd: T=1).")
  flags.DEFINE_integer("batch_size", 128, "Prompts per batch.")
  flags.DEFINE_integer("prompt_tokens", 32, "Corpus tokens before each continuation.")
  flags.DEFINE_integer("new_tokens", 96, "Tokens the target generates per prompt.")
  flags.DEFINE_integer("seed", 0, "Seed of prompt windows and sampling.")
  app.run(main)

"""Write training data made by the target itself: responses to your prompts, or
continuations of the corpus.

  # self-distilled chats: the target answers each prompt (EAGLE's and SpecForge's recipe)
  python -m experiments.generate_data --target=specjax/pretrained/stdlib_pair/target \
      --prompts=my_chats/ --out=runs/chats_gen [--max_new_tokens=256 --temperature=0]
  # continuations of corpus windows (a data directory of token files)
  python -m experiments.generate_data --target=runs/target --data_dir=runs/data \
      --out=runs/data_gen [--num_batches=80 --batch_size=128]

With --prompts (files or directories of .jsonl / .parquet / .txt, read as
`config.data.files` reads them): each chat is cut after its last user turn and
rendered with the target's chat template and its generation prompt; a text
document becomes one user turn (with no template, a plain continuation). The
target answers through `specjax.generation.autoregressive_generate` (one jitted
loop per shape: rows padded to --batch_size, prompts right-padded to a power of
two from 16 up to --max_prompt_tokens, each row stopping at the target's EOS),
greedy at --temperature=0. The output is jsonl chats (`messages` with the new
assistant turn, `source` the prompt's file and line), which
`--config.data.files=OUT` trains on. Each process writes its own shard,
`part-<process_index>-of-<process_count>.jsonl`, of every process_count-th
prompt; lines are appended a batch at a time and flushed, and a restart keeps
the whole batches written (dropping a batch cut short) and goes on from there:
the same lines as an uninterrupted run, since batch i samples with key
fold_in(seed, i). Prompts longer than --max_prompt_tokens are skipped (counted).

Without --prompts, each sample is a window of `prompt_tokens` train-split tokens
followed by `new_tokens` tokens the target generated from it, then `<eos>`: half
of the batches greedy, half sampled at temperature 1. The output directory is a
data directory for `experiments/train.py`: `train.bin` holds the samples;
validation, test and tokenizer are copied from --data_dir, so validation metrics
stay comparable (`specjax.training.continuations`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from absl import flags

from experiments import common
from specjax.distributed import launch
from specjax.training.continuations import write_continuations

MIN_BUCKET = 16


def _tokenizer(path: str, tokenizer_file: str):
  """The target's tokenizer: --tokenizer, its tokenizer.json, or the bundled pair's."""
  from specjax import pretrained
  from specjax.data import Tokenizer
  from specjax.hf import load_tokenizer

  if tokenizer_file:
    return Tokenizer.from_file(tokenizer_file)
  tokenizer = load_tokenizer(path)
  pair = os.path.realpath(pretrained.PAIR_DIR)
  if tokenizer is None and os.path.commonpath([os.path.realpath(path), pair]) == pair:
    tokenizer = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
  if tokenizer is None:
    raise ValueError(f"--tokenizer must name the target's tokenizer.json: {path} holds none.")
  return tokenizer


def _prompts(files: list[str], template, tokenizer) -> list[tuple[str, list | None, list[int]]]:
  """(source, messages or None, prompt ids) of every document of `files`."""
  from specjax.data.files import read_documents

  prompts = []
  for path in files:
    for where, text, messages in read_documents(path, template, prompt=True):
      if messages is None and template is not None:  # a text document: one user turn
        messages = [{"role": "user", "content": text}]
        text = template.render(messages, add_generation_prompt=True)
      # A rendered chat carries its own BOS; a plain text gets the tokenizer's.
      ids = tokenizer.encode_batch([text], special=messages is None)[0]
      prompts.append((where, messages, ids))
  return prompts


def _resume(path: str, batch_size: int, total: int) -> int:
  """Batches already in `path` of `total` lines (rewritten without a batch cut short)."""
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.endswith("\n")]
  done = -(-total // batch_size) if len(lines) >= total else len(lines) // batch_size
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(lines[: done * batch_size])
  os.replace(tmp, path)
  return done


def write_responses(
  target: str,
  prompts: str,
  out: str,
  batch_size: int = 8,
  max_new_tokens: int = 256,
  max_prompt_tokens: int = 0,
  temperature: float = 0.0,
  seed: int = 0,
  tokenizer_file: str = "",
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Writes this process's shard of the target's responses to `prompts` into `out`.

  Args:
    target: the target's checkpoint directory, cached hub repo id or training run.
    prompts: "PATH[,PATH...]" of prompt files or directories (`source_files`).
    out: the output directory (created).
    batch_size: rows per generation call.
    max_new_tokens: the response budget per prompt.
    max_prompt_tokens: the longest prompt (0: the target's max_seq_len - max_new_tokens).
    temperature: 0 greedy, else sampled at this temperature.
    seed: sampling seed (batch i uses fold_in(key(seed), i)).
    tokenizer_file: the target's tokenizer.json when its directory has none.
    log: where progress lines go.

  Returns:
    {"file", "prompts", "skipped", "written", "seconds"} of this shard.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.data.chat import ChatTemplate
  from specjax.data.files import eos_of, source_files
  from specjax.generation import autoregressive_generate
  from specjax.hf import resolve_checkpoint
  from specjax.sampling import SamplingParams
  from specjax.training.heads import load_target, target_config
  from specjax.validation import check_int, check_positive_int

  for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
    check_positive_int(f"--{name}", value)
  check_int("--max_prompt_tokens", max_prompt_tokens, minimum=0)
  check_int("--seed", seed, minimum=0)
  if not temperature >= 0:
    raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature!r}.")
  files = source_files(prompts, "--prompts")
  path = resolve_checkpoint(target, flag="--target")
  limit = target_config(path, "--target").max_seq_len - max_new_tokens
  max_prompt_tokens = max_prompt_tokens or limit
  if not MIN_BUCKET <= max_prompt_tokens <= limit:
    raise ValueError(
      f"--max_prompt_tokens must be in [{MIN_BUCKET}, {limit}] (the target's max_seq_len minus "
      f"--max_new_tokens), got {max_prompt_tokens}."
    )
  tokenizer = _tokenizer(path, tokenizer_file)
  template, eos = ChatTemplate.from_checkpoint(path), eos_of(path, tokenizer)
  index, count = jax.process_index(), jax.process_count()
  mine = _prompts(files, template, tokenizer)[index::count]
  kept = [p for p in mine if len(p[2]) <= max_prompt_tokens]
  os.makedirs(out, exist_ok=True)
  shard = os.path.join(out, f"part-{index:05d}-of-{count:05d}.jsonl")
  done = _resume(shard, batch_size, len(kept))
  model = load_target(path)
  sampling = SamplingParams(temperature=float(temperature))
  start = time.perf_counter()
  batches = range(done, -(-len(kept) // batch_size))
  for i in batches:
    rows = kept[i * batch_size : (i + 1) * batch_size]
    longest = max(len(ids) for _, _, ids in rows)
    width = min(max_prompt_tokens, max(MIN_BUCKET, 1 << (longest - 1).bit_length()))
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.ones((batch_size,), np.int32)  # padding rows: one pad token, discarded
    for r, (_, _, ids) in enumerate(rows):
      tokens[r, : len(ids)], lengths[r] = ids, len(ids)
    result = autoregressive_generate(
      model,
      jnp.asarray(tokens),
      jnp.asarray(lengths),
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=jax.random.fold_in(jax.random.key(seed), i),
      eos_id=eos,
    )
    new, counts = np.asarray(result.tokens), np.asarray(result.num_generated)
    lines = []
    for r, (where, messages, _) in enumerate(rows):
      ids = [int(t) for t in new[r, : counts[r]] if t != eos]
      reply = tokenizer.decode(ids)
      if messages is None:  # no template: a plain continuation
        record = {"text": tokenizer.decode(rows[r][2]) + reply}
      else:
        record = {"messages": [*messages, {"role": "assistant", "content": reply}]}
      lines.append(json.dumps({**record, "source": where}, ensure_ascii=False) + "\n")
    with open(shard, "a", encoding="utf-8") as f:  # a whole batch, then flushed to disk
      f.write("".join(lines))
      f.flush()
      os.fsync(f.fileno())
    log(f"batch {i + 1}/{batches.stop}: {time.perf_counter() - start:.0f} s")
  return {
    "file": shard,
    "prompts": len(mine),
    "skipped": len(mine) - len(kept),
    "written": len(kept),
    "resumed_batches": done,
    "seconds": round(time.perf_counter() - start, 2),
  }


def main(argv):
  del argv
  f = flags.FLAGS
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  log = functools.partial(print, flush=True)
  if f.prompts:
    meta = write_responses(
      f.target,
      f.prompts,
      f.out,
      f.batch_size,
      f.max_new_tokens,
      f.max_prompt_tokens,
      f.temperature,
      f.seed,
      f.tokenizer,
      log=log,
    )
  elif not f.data_dir:
    raise ValueError("--data_dir (corpus continuations) or --prompts (responses) is required.")
  else:
    meta = write_continuations(
      f.target,
      f.data_dir,
      f.out,
      f.num_batches,
      f.batch_size,
      f.prompt_tokens,
      f.new_tokens,
      f.seed,
      log=log,
    )
  print(json.dumps(meta, indent=2))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string(
    "target",
    None,
    "Run directory, Hugging Face directory or cached hub repo id of the target.",
    required=True,
  )
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_integer("batch_size", 128, "Prompts per batch.")
  flags.DEFINE_integer("seed", 0, "Seed of prompt windows and sampling.")
  # Responses to prompts.
  flags.DEFINE_string("prompts", "", "Prompt files or directories, comma-separated.")
  flags.DEFINE_integer("max_new_tokens", 256, "Response budget per prompt (--prompts).")
  flags.DEFINE_integer("max_prompt_tokens", 0, "Longest prompt (0: max_seq_len - max_new_tokens).")
  flags.DEFINE_float("temperature", 0.0, "0: greedy responses; else sampled (--prompts).")
  flags.DEFINE_string("tokenizer", "", "The target's tokenizer.json, when its directory has none.")
  # Continuations of the corpus.
  flags.DEFINE_string("data_dir", "", "Corpus data directory (train.bin, tokenizer.json).")
  flags.DEFINE_integer("num_batches", 80, "Generation batches (even: greedy, odd: T=1).")
  flags.DEFINE_integer("prompt_tokens", 32, "Corpus tokens before each continuation.")
  flags.DEFINE_integer("new_tokens", 96, "Tokens the target generates per prompt.")
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)

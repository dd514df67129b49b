"""Writes a random-weight Hugging Face checkpoint (with a byte-level BPE tokenizer).

  python -m experiments.make_hf_checkpoint --arch=llama --size=medium --out=/tmp/target
  python -m experiments.make_hf_checkpoint --arch=llama --size=draft --out=/tmp/draft

For benchmarks and tests without downloads: the directory is what
`save_pretrained` writes, plus a tokenizer.json trained on a few files of the
Python standard library (so prompts can be text). Needs torch and transformers:
`pip install torch==2.13.0 transformers`, or where no local CPU wheel of torch
exists, `pip install torch --index-url https://download.pytorch.org/whl/cpu`
(the public index's plain `torch` is a CUDA build) and `pip install transformers`.
"""

from __future__ import annotations

import glob
import os

from absl import flags

from experiments import common
from specjax.data.corpus import stdlib_root
from specjax.data.tokenizer import train_tokenizer
from specjax.hf.optional import import_torch_transformers

SIZES = {
  # hidden, intermediate, layers, heads, kv heads
  "tiny": (64, 128, 2, 4, 2),
  "draft": (128, 256, 1, 2, 1),
  "medium": (512, 1408, 6, 8, 4),
}
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm", "gpt2")
_TOKENIZER_FILES = 20  # top-level stdlib modules the BPE is trained on


def make_checkpoint(out: str, arch: str, size: str, vocab_size: int, seed: int = 0) -> str:
  """Saves a random `arch` model of preset `size` and a tokenizer into `out`.

  The tokenizer is `specjax.data.tokenizer.train_tokenizer` on the first
  standard-library modules, with the specials `<pad>`, `<bos>`, `<eos>` at ids
  0, 1, 2 (the model config's pad, bos and eos ids).
  """
  if arch not in ARCHS:
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}.")
  if size not in SIZES:
    raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}.")
  # Before any work: a missing torch or transformers is one line saying how to install them.
  torch, transformers = import_torch_transformers("make_hf_checkpoint")
  files = sorted(glob.glob(os.path.join(stdlib_root(), "*.py")))[:_TOKENIZER_FILES]
  # Trained first: it checks vocab_size before the model is built or anything written.
  tokenizer = train_tokenizer(files, vocab_size)
  pad_id, bos_id, eos_id = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
  hidden, inter, layers, heads, kv = SIZES[size]
  torch.manual_seed(seed)
  common = dict(
    vocab_size=vocab_size,
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    max_position_embeddings=1024,
    eos_token_id=eos_id,
    bos_token_id=bos_id,
    pad_token_id=pad_id,
  )
  if arch == "gpt2":
    config = transformers.GPT2Config(
      vocab_size=vocab_size,
      n_embd=hidden,
      n_layer=layers,
      n_head=heads,
      n_positions=1024,
      eos_token_id=eos_id,
      bos_token_id=bos_id,
    )
  else:
    head_dim = hidden // heads  # Qwen3 and Gemma default to their own, larger one
    config = {
      "llama": lambda: transformers.LlamaConfig(**common),
      "smollm": lambda: transformers.LlamaConfig(tie_word_embeddings=True, **common),
      "mistral": lambda: transformers.MistralConfig(sliding_window=256, **common),
      "qwen2": lambda: transformers.Qwen2Config(**common),
      "qwen3": lambda: transformers.Qwen3Config(head_dim=head_dim, **common),
      "phi3": lambda: transformers.Phi3Config(sliding_window=256, **common),
      "gemma2": lambda: transformers.Gemma2Config(head_dim=head_dim, sliding_window=256, **common),
      "gemma3": lambda: transformers.Gemma3TextConfig(
        head_dim=head_dim, sliding_window=256, sliding_window_pattern=2, **common
      ),
    }[arch]()
  model = transformers.AutoModelForCausalLM.from_config(config)
  model.save_pretrained(out)
  tokenizer.save(os.path.join(out, "tokenizer.json"))
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  print(make_checkpoint(f.out, f.arch, f.size, f.vocab_size, f.seed))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_enum("arch", "llama", list(ARCHS), "Architecture.")
  flags.DEFINE_enum("size", "tiny", list(SIZES), "Preset size.")
  flags.DEFINE_integer("vocab_size", 4096, "Vocabulary size (model and BPE).")
  flags.DEFINE_integer("seed", 0, "torch seed of the random weights.")
  flags.DEFINE_string("out", None, "Output directory.", required=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)

"""Writes a random-weight Hugging Face checkpoint (with a byte-level BPE tokenizer).

  python -m experiments.make_hf_checkpoint --arch=llama --size=medium --out=/tmp/target
  python -m experiments.make_hf_checkpoint --arch=llama --size=draft --out=/tmp/draft

For benchmarks and tests without downloads: the directory is what
`save_pretrained` writes, plus a tokenizer.json trained on a few files of the
Python standard library (so prompts can be text). Needs torch and transformers.
"""

from __future__ import annotations

import glob
import os
import sysconfig

from absl import app, flags

SIZES = {
    # hidden, intermediate, layers, heads, kv heads
    "tiny": (64, 128, 2, 4, 2),
    "draft": (128, 256, 1, 2, 1),
    "medium": (512, 1408, 6, 8, 4),
}

def train_tokenizer(vocab_size: int, num_files: int = 20):
  """A byte-level BPE (at most vocab_size ids) trained on standard-library sources."""
  from tokenizers import ByteLevelBPETokenizer
  stdlib = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:num_files]
  tokenizer = ByteLevelBPETokenizer()
  tokenizer.train(files, vocab_size=vocab_size, min_frequency=2,
                  special_tokens=["<pad>", "<bos>", "<eos>"], show_progress=False)
  return tokenizer


def make_checkpoint(out: str, arch: str, size: str, vocab_size: int, seed: int = 0) -> str:
  """Saves a random `arch` model of preset `size` and a tokenizer into `out`."""
  import torch
  import transformers
  hidden, inter, layers, heads, kv = SIZES[size]
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, max_position_embeddings=1024, eos_token_id=2,
                bos_token_id=1, pad_token_id=0)
  if arch == "gpt2":
    config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers,
                                     n_head=heads, n_positions=1024, eos_token_id=2,
                                     bos_token_id=1)
  else:
    config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config}[arch](**common)
  model = transformers.AutoModelForCausalLM.from_config(config)
  model.save_pretrained(out)
  train_tokenizer(vocab_size).save(os.path.join(out, "tokenizer.json"))
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  print(make_checkpoint(f.out, f.arch, f.size, f.vocab_size, f.seed))


if __name__ == "__main__":
  flags.DEFINE_enum("arch", "llama", ["llama", "mistral", "qwen2", "gpt2"], "Architecture.")
  flags.DEFINE_enum("size", "tiny", list(SIZES), "Preset size.")
  flags.DEFINE_integer("vocab_size", 4096, "Vocabulary size (model and BPE).")
  flags.DEFINE_integer("seed", 0, "torch seed of the random weights.")
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  app.run(main)

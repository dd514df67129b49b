"""A user's case for the data tests: a Hugging Face checkpoint with a tokenizer and
a chat template of its own, and a folder of jsonl chats (issue 32)."""

import json
import os

from flax import nnx

from helpers import TINY
from specjax import ModelConfig, Transformer
from specjax.data import corpus_files, train_tokenizer
from specjax.data.corpus import read_source
from specjax.hf.export import save_model

# A Llama-3-like template: the BOS, a header per turn, the EOS ending each turn.
TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def user_checkpoint(path: str, corpus_root: str, template: bool = True) -> str:
  """The TINY target (peaked weights) as a Llama checkpoint in `path`, with a 512-id
  BPE trained on `corpus_root`'s train split and, with `template`, a chat template."""
  cfg = ModelConfig(**{**TINY, "init_std": 0.1})
  save_model(Transformer(cfg, rngs=nnx.Rngs(0)), path, "float32", bos_id=1, eos_id=2, pad_id=0)
  train_tokenizer(corpus_files("train", corpus_root), 512).save(
    os.path.join(path, "tokenizer.json")
  )
  config = {"bos_token": "<bos>", "eos_token": "<eos>"}
  if template:
    config["chat_template"] = TEMPLATE
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return path


def user_chats(path: str, corpus_root: str, files: int = 2, per_file: int = 12) -> str:
  """`files` jsonl files of `per_file` chats (system, user, assistant) cut from the
  corpus's train files, in `path`/chats/part-<i>.jsonl; returns `path`/chats."""
  text = "".join(read_source(p) for p in corpus_files("train", corpus_root))
  folder = os.path.join(path, "chats")
  os.makedirs(folder, exist_ok=True)
  for i in range(files):
    with open(os.path.join(folder, f"part-{i}.jsonl"), "w") as f:
      for j in range(per_file):
        start = (i * per_file + j) * 600
        messages = [
          {"role": "system", "content": "Continue the code."},
          {"role": "user", "content": text[start : start + 200]},
          {"role": "assistant", "content": text[start + 200 : start + 600]},
        ]
        f.write(json.dumps({"messages": messages}) + "\n")
  return folder

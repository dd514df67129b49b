"""Offline training data: the Python standard library's source, a byte-level BPE
tokenizer, and a deterministic token pipeline over memory-mapped arrays."""

from specjax.data.corpus import SPLITS, corpus_files, split_of, stdlib_root
from specjax.data.dataset import TokenDataset, build_token_file, prepare_splits
from specjax.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
  "SPLITS",
  "corpus_files",
  "split_of",
  "stdlib_root",
  "TokenDataset",
  "build_token_file",
  "prepare_splits",
  "Tokenizer",
  "train_tokenizer",
]

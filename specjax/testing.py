"""Tiny stand-ins for smoke runs and tests: random tiny models and a byte tokenizer.

  target, draft, tokenizer = tiny_setup(seed=0)     # what `--config.model=tiny` serves

The text they produce is noise; they exercise the machinery (the serving
engine, the HTTP server, the load test) in seconds, without checkpoints.
"""

from __future__ import annotations


class ByteTokenizer:
  """Text as its UTF-8 bytes: ids 0-255, for models with a vocabulary of at
  least 256 (the tiny smoke-test models). Invalid sequences decode to U+FFFD."""

  vocab_size = 256
  pad_id = bos_id = eos_id = None

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

  def token_bytes(self) -> list[bytes]:
    """Each id's byte (`specjax.vocab_map.token_bytes`)."""
    return [bytes([i]) for i in range(256)]


# The tiny random target of smoke tests (and of the serving tests).
TINY_CONFIG = dict(
  vocab_size=256, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256
)


def tiny_setup(seed: int = 0, noise: float = 0.3):
  """`(target, draft, tokenizer)`: a random tiny target (seed `seed`), its draft
  (the target's weights plus `noise` times another random model's: it agrees
  often, not always) and a `ByteTokenizer`, for smoke tests of the serving
  stack (the text is noise)."""
  import jax
  from flax import nnx

  from specjax.models import ModelConfig, Transformer

  cfg = ModelConfig(**TINY_CONFIG)
  target = Transformer(cfg, rngs=nnx.Rngs(seed))
  draft = Transformer(cfg, rngs=nnx.Rngs(seed + 1))
  perturbed = jax.tree.map(
    lambda p, n: p + noise * n, nnx.state(target, nnx.Param), nnx.state(draft, nnx.Param)
  )
  nnx.update(draft, perturbed)
  return target, draft, ByteTokenizer()

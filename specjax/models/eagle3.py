"""EAGLE-3's head (arXiv 2503.01840) as published heads lay it out (vLLM's and
SGLang's `llama_eagle3.py`): h = fc([f_a; f_b; f_c]) (3 target layers); h' = h +
attn(cat(input_layernorm(embed(x)), hidden_norm(h))) (q/k/v read 2D), then +
mlp(post_attention_layernorm(h')); q = softmax(lm_head(norm(h'))) over K draft
ids (target id d + d2t[d]), 0 elsewhere. h' is the next step's h.

The module (`Eagle3Head`, `Eagle3Layer`) lives with the other heads' in
`specjax.models.heads` and is re-exported here; this file holds its draft ids,
and warm start; its hub layout is `specjax.hf.eagle3`'s.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.models.heads import Eagle3Head, Eagle3Layer
from specjax.models.transformer import Transformer

__all__ = ["Eagle3Head", "Eagle3Layer", "draft_vocab_ids"]


def draft_vocab_ids(tokens, vocab_size: int, k: int) -> tuple[int, ...]:
  """The `k` most frequent ids of `tokens`, ascending (ties: the lower id)."""
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
  return tuple(sorted(int(i) for i in np.argsort(-counts, kind="stable")[:k]))


def warm_start(head: Eagle3Head, target: Transformer) -> Eagle3Head:
  """`head` with the target's final norm and head (at the draft ids); fc passes
  the highest layer on."""
  t, d = target, target.cfg.d_model
  ids = jnp.asarray(head.cfg.draft_ids or range(t.cfg.vocab_size))
  w = t.embed.embedding[...][ids].T if t.cfg.tie_embeddings else t.lm_head[...][:, ids]
  head.lm_head.kernel[...] = w.astype(head.lm_head.kernel.dtype)
  head.norm.scale[...] = jnp.copy(t.final_norm.scale[...])  # its own buffer: training donates it
  head.fc.kernel[...] = jnp.zeros((3 * d, d)).at[2 * d :].set(jnp.eye(d))
  return head

"""The one-kernel decode attention (`specjax.kernels.append_attention`) against the
XLA path it replaces on GPU: the fused projection scaled by a folded norm,
biased, rotated, written into the caches at each row's start, and attended over
each query's run of slots (stale slots past it, a window's start before it).

The kernel runs in interpret mode (the same Pallas program a GPU compiles with
Triton, executed as JAX operations on CPU); the whole model through it, greedy
text included, is tests/test_attention.py::test_whole_model_matches_einsum[auto].
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import TINY, TINY_DRAFT
from specjax import compiler_options
from specjax.kernels import append_attention as appended
from specjax.kernels import gated_down
from specjax.models.attention import attend, query_runs
from specjax.models.block import Block
from specjax.models.config import ModelConfig
from specjax.models.layers import apply_rope, rope_inv_freq
from specjax.models.transformer import attention_mask


def _reference(qkv, factor, bias, positions, mask, starts, k_cache, v_cache, scale):
  """What `Attention` computes on the XLA path: `Linear.scaled`'s rounding, RoPE,
  the cache writes, then `attend`."""
  b, t, kv_heads, parts, h = qkv.shape
  g = parts - 2
  y = qkv.astype(jnp.float32) * factor[:, :, None, None, None]
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  y = y.astype(k_cache.dtype)
  inv_freq = rope_inv_freq(h, 10000.0, None)
  q = apply_rope(y[:, :, :, :g].reshape(b, t, kv_heads * g, h), positions, inv_freq)
  k = jnp.swapaxes(apply_rope(y[:, :, :, g], positions, inv_freq), 1, 2)
  v = jnp.swapaxes(y[:, :, :, g + 1], 1, 2)
  write = jax.vmap(lambda cache, new, s: jax.lax.dynamic_update_slice(cache, new, (0, s, 0)))
  k_cache, v_cache = write(k_cache, k, starts), write(v_cache, v, starts)
  return attend(q, k_cache, v_cache, mask, scale), k_cache, v_cache


CASES = {
  # (rows, queries, kv heads, G, head size, capacity, window, bias, dtype)
  "decode_gqa": (2, 1, 2, 4, 32, 64, None, True, jnp.bfloat16),
  "verify_windowed": (1, 5, 2, 4, 32, 48, 9, False, jnp.bfloat16),  # 20 rows: Triton's dot
  "feed_mha_odd_capacity": (2, 2, 3, 1, 16, 40, None, True, jnp.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_computes_the_xla_paths_attention_and_writes(case):
  b, t, kv_heads, g, h, capacity, window, biased, dtype = CASES[case]
  keys = jax.random.split(jax.random.key(0), 5)
  qkv = jax.random.normal(keys[0], (b, t, kv_heads, g + 2, h), jnp.float32)
  # Stale slots hold large values: a read of one would move the output far.
  k_cache = jax.random.normal(keys[1], (b, kv_heads, capacity, h)).astype(dtype)
  v_cache = (jax.random.normal(keys[2], (b, kv_heads, capacity, h)) * 3).astype(dtype)
  factor = jax.random.uniform(keys[3], (b, t), minval=0.5, maxval=1.5)
  bias = (jax.random.normal(keys[4], (kv_heads, g + 2, h)) * 0.1).astype(dtype) if biased else None
  starts = jnp.array([capacity - t - 3, 7][:b], jnp.int32)
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  mask = attention_mask(positions, jnp.arange(capacity, dtype=jnp.int32), window)
  width, eps = 64, 1e-6
  sums = width * (1.0 / jnp.square(factor) - eps)  # rsqrt(sums / width + eps) == factor
  scale = h**-0.5
  got = appended.append_attention(
    qkv,
    *query_runs(mask),
    starts,
    k_cache,
    v_cache,
    sums,
    bias,
    rope_inv_freq(h, 10000.0, None),
    scale=scale,
    norm_width=width,
    norm_eps=eps,
    interpret=True,
  )
  want = _reference(qkv, factor, bias, positions, mask, starts, k_cache, v_cache, scale)
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
  for name, g_, w_ in zip(("out", "k_cache", "v_cache"), got, want):
    assert g_.shape == w_.shape and g_.dtype == w_.dtype, name
    np.testing.assert_allclose(
      np.asarray(g_, np.float32), np.asarray(w_, np.float32), atol=tol, rtol=tol, err_msg=name
    )


def test_which_calls_the_kernel_takes():
  assert appended.applies(1, 32, 8, 64, 256)  # a decode step of a 1b-shaped layer
  assert appended.applies(5, 32, 8, 128, 4096)  # verifying gamma = 4 on a 7b-shaped one
  assert not appended.applies(17, 32, 8, 64, 256)  # 68 query rows: a prompt's call
  assert not appended.applies(1, 4, 4, 48, 256)  # a head size whose halves are not 2^k
  assert not appended.applies(8, 4, 4, 64, 8)  # the padded new slots wrap a tiny cache


@pytest.mark.parametrize("t", [1, 5])
def test_a_gpu_decode_layer_computes_what_the_cpu_layer_computes(monkeypatch, t):
  """One decoder block as compiled for a GPU (its norms folded, attention through
  this kernel, the MLP's tail through `specjax.kernels.gated_down`), interpreted,
  against the same block's XLA path: outputs and caches within bfloat16 rounding,
  for a decode step and a verify block."""

  cfg = ModelConfig(
    vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
    dtype="bfloat16", param_dtype="bfloat16",
  )  # fmt: skip
  block = Block(cfg, rngs=nnx.Rngs(0))
  b, capacity = 2, 48
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (b, t, cfg.d_model)).astype(jnp.bfloat16)
  cache = tuple(jax.random.normal(k, (b, 2, capacity, 16)).astype(jnp.bfloat16) for k in keys[1:])
  starts = jnp.array([5, 30], jnp.int32)
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  masks = {None: attention_mask(positions, jnp.arange(capacity, dtype=jnp.int32))}
  calls = []
  for module, name in ((appended, "append_attention"), (gated_down, "gated_down")):
    kernel = getattr(module, name)
    monkeypatch.setattr(
      module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw)
    )
  run = lambda: jax.jit(lambda x, c: block(x, positions, masks, c, starts))(x, cache)
  want = run()
  assert not calls  # the CPU's layer: XLA's operations
  monkeypatch.setenv("SPECJAX_PALLAS_INTERPRET", "1")
  with compiler_options.target_platform("gpu"):
    got = run()
  assert sorted(set(calls)) == ["append_attention", "gated_down"]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), atol=0.05, rtol=0.05
    )


def test_decoding_as_compiled_for_a_gpu_gives_the_cpus_greedy_text(monkeypatch, prompts):
  """The whole model as a GPU runs it (norms folded, both kernels in every
  layer, the draft at one width), interpreted on CPU: the same greedy tokens as
  the CPU's own programs, autoregressive and speculative."""

  def pair(attention):
    # Configs of this test alone: JAX keeps traced programs by function and
    # argument types, not by the platform context, so no other test's trace
    # (nor this one's CPU reference) may serve the GPU's, nor the other way.
    cfg = specjax.ModelConfig(**TINY, scan_layers=False, attention=attention)
    draft = cfg.replace(**TINY_DRAFT)
    return specjax.Transformer(cfg, rngs=nnx.Rngs(0)), specjax.Transformer(draft, rngs=nnx.Rngs(1))

  run = dict(max_new_tokens=12, sampling=specjax.GREEDY)
  target, draft = pair("einsum")
  want = specjax.autoregressive_generate(target, *prompts, **run)
  want_spec = specjax.speculative_generate(target, draft, *prompts, gamma=3, **run)
  calls = []
  kernel = gated_down.gated_down
  monkeypatch.setattr(gated_down, "gated_down", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  monkeypatch.setenv("SPECJAX_PALLAS_INTERPRET", "1")
  target, draft = pair("pallas")  # the same weights; on a GPU, both kernels
  with compiler_options.target_platform("gpu"):
    got = specjax.autoregressive_generate(target, *prompts, **run)
    got_spec = specjax.speculative_generate(target, draft, *prompts, gamma=3, **run)
  assert calls  # traced through the GPU's MLP kernel (and so its folded blocks)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got_spec.tokens, want_spec.tokens)
  np.testing.assert_array_equal(got_spec.num_generated, want_spec.num_generated)

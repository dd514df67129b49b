"""The model: configuration checks, and cached decoding == full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import GEMMA_STYLE, forward_cached, full_logits
from specjax.models.fused import gate_up_parts, qkv_parts, unfuse
from specjax.models.transformer import apply_rope, attend, attention_mask, rope_inv_freq

GPT2_STYLE = dict(
  norm="layernorm",
  mlp="gelu",
  positions="learned",
  qkv_bias=True,
  out_bias=True,
  mlp_bias=True,
  tie_embeddings=True,
)


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma"])
def model(request, tiny_cfg, target):
  if request.param == "llama":
    return target
  if request.param == "gemma":
    gemma = specjax.Transformer(tiny_cfg.replace(**GEMMA_STYLE), rngs=nnx.Rngs(5))
    _perturb_biases_and_norms(gemma)
    return gemma
  return specjax.Transformer(tiny_cfg.replace(**GPT2_STYLE), rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(0), (3, 16), 0, 512, dtype=jnp.int32)


def _perturb_biases_and_norms(model):
  """Moves zero-initialised biases and unit norm scales away from their init."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  leaves = [
    x + 0.1 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1 else x
    for x, k in zip(leaves, keys)
  ]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))


def test_full_forward_shape_and_dtype(model, tokens):
  logits = model(tokens)
  assert logits.shape == (3, 16, 512)
  assert logits.dtype == jnp.float32


@pytest.mark.sample("llama-chunks0", "llama-chunks1", "gpt2-chunks2", "gemma-chunks1")
@pytest.mark.parametrize("chunks", [(4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (5, 3, 8), (16,)])
def test_cached_decoding_matches_full_forward(model, tokens, chunks):
  """Prefill then single tokens or multi-token chunks give the full forward's logits."""
  full = full_logits(model, tokens)
  cache = model.init_cache(3, 24)
  forward = jax.jit(model.forward_cached)  # one compile per chunk size, not op by op
  outs, start = [], 0
  for size in chunks:
    logits, cache = forward(tokens[:, start : start + size], cache)
    outs.append(logits)
    start += size
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, [16, 16, 16])


def test_ragged_rows_and_rollback(tokens, tiny_cfg):
  """Rows at different lengths, then a rollback, still match each row's full forward."""
  model = specjax.Transformer(tiny_cfg.replace(**GPT2_STYLE), rngs=nnx.Rngs(4))
  _perturb_biases_and_norms(model)
  full = full_logits(model, tokens)
  lengths = jnp.array([3, 9, 6], jnp.int32)
  cache = model.init_cache(3, 24)
  _, cache = forward_cached(model, tokens[:, :9], cache)  # row 0 and 2 see padding
  cache = cache.with_lengths(lengths)
  # Feed junk 4 tokens, then roll back: the junk must never be read.
  junk = jnp.full((3, 4), 7, jnp.int32)
  _, cache = forward_cached(model, junk, cache)
  cache = cache.with_lengths(lengths)
  nxt = jnp.stack([tokens[b, int(n) : int(n) + 5] for b, n in enumerate(lengths)])
  logits, cache = forward_cached(model, nxt, cache)
  for b, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(logits[b], full[b, n : n + 5], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, lengths + 5)


def test_logit_indices_select_positions(target, tokens):
  cache = target.init_cache(3, 16)
  idx = jnp.array([[0, 15], [3, 3], [7, 1]], jnp.int32)
  logits, _ = target.forward_cached(tokens, cache, logit_indices=idx)
  full = full_logits(target, tokens)
  np.testing.assert_allclose(
    logits, jnp.take_along_axis(full, idx[:, :, None], axis=1), atol=1e-5, rtol=0
  )


def test_bfloat16_model_runs_with_float32_logits(tiny_cfg, tokens):
  cfg = tiny_cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  model = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  assert nnx.state(model, nnx.Param).layers[0].attn.qkv_proj.kernel.dtype == jnp.bfloat16
  # Give it the float32 model's weights, rounded, to compare like with like.
  ref = specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
  logits, cache = model.forward_cached(tokens, model.init_cache(3, 16))
  assert logits.dtype == jnp.float32
  assert cache.k[0].dtype == jnp.bfloat16
  error = np.max(np.abs(np.asarray(logits) - np.asarray(ref(tokens))))
  assert 0 < error < 0.05


def test_params_carry_logical_axis_names(target, tiny_cfg):
  specs = nnx.get_partition_spec(nnx.state(target, nnx.Param))
  assert tuple(specs.layers[0].attn.qkv_proj.kernel.get_value()) == ("embed", "kv_heads")
  assert tuple(specs.layers[0].attn.o_proj.kernel.get_value()) == ("heads", "embed")
  assert tuple(specs.layers[0].mlp.gate_up_proj.kernel.get_value()) == ("embed", "mlp")
  assert tuple(specs.layers[0].mlp.down_proj.kernel.get_value()) == ("mlp", "embed")
  assert tuple(specs.embed.embedding.get_value()) == ("vocab", "embed")
  biased = specjax.Transformer(tiny_cfg.replace(**GPT2_STYLE), rngs=nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(biased, nnx.Param))
  assert tuple(specs.layers[0].attn.qkv_proj.bias.get_value()) == ("kv_heads",)
  assert tuple(specs.layers[0].mlp.up_proj.kernel.get_value()) == ("embed", "mlp")


def test_fused_columns_are_grouped_by_kv_head_and_hidden_unit(tiny_cfg):
  # K = 2 kv heads, G = 2 queries each, H = 3: columns [K, G + 2, H].
  cfg = tiny_cfg.replace(n_heads=4, n_kv_heads=2, head_dim=3, d_ff=3, positions="learned")
  q, k, v = qkv_parts(cfg)
  columns = np.arange(2 * 4 * 3)
  np.testing.assert_array_equal(q.take(columns), [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17])
  np.testing.assert_array_equal(k.take(columns), [6, 7, 8, 18, 19, 20])
  np.testing.assert_array_equal(v.take(columns), [9, 10, 11, 21, 22, 23])
  gate, up = gate_up_parts(3)
  np.testing.assert_array_equal(gate.take(np.arange(6)), [0, 2, 4])
  np.testing.assert_array_equal(up.take(np.arange(6)), [1, 3, 5])
  # put is take's inverse, on kernels [D, columns] too.
  kernel = np.arange(5 * 24, dtype=np.float32).reshape(5, 24)
  rebuilt = np.zeros_like(kernel)
  for part in (q, k, v):
    part.put(rebuilt, part.take(kernel))
  np.testing.assert_array_equal(rebuilt, kernel)


def _unfused_logits(model, tokens):
  """The model's logits computed the unfused way, from `unfuse`'s separate
  q/k/v/gate/up weights: one product per projection (the model before fusing)."""
  cfg = model.cfg
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  p = unfuse({tuple(path): v.get_value() for path, v in flat}, cfg)
  hi = jax.lax.Precision.HIGHEST

  def linear(path, x):
    y = jnp.dot(x, p[(*path, "kernel")], precision=hi)
    return y + p[(*path, "bias")] if (*path, "bias") in p else y

  def norm(path, x):
    if cfg.norm == "layernorm":
      x = x - x.mean(-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
    x = x * (cfg.norm_offset + p[(*path, "scale")])
    return x + p[(*path, "bias")] if (*path, "bias") in p else x

  b, t = tokens.shape
  n, kv, h = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  x = p[("embed", "embedding")][tokens]
  if cfg.positions == "learned":
    x = x + p[("pos_embed", "embedding")][positions]
  mask = attention_mask(positions, jnp.arange(t))
  inv_freq = rope_inv_freq(h, cfg.rope_theta, cfg.rope_scaling)
  for i in range(cfg.n_layers):
    attn, mlp = ("layers", i, "attn"), ("layers", i, "mlp")
    y = norm(("layers", i, "attn_norm"), x)
    q = linear((*attn, "q_proj"), y).reshape(b, t, n, h)
    k = linear((*attn, "k_proj"), y).reshape(b, t, kv, h)
    v = linear((*attn, "v_proj"), y).reshape(b, t, kv, h)
    if cfg.positions == "rope":
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    out = attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask)
    x = x + linear((*attn, "o_proj"), out.reshape(b, t, n * h))
    y = norm(("layers", i, "mlp_norm"), x)
    if cfg.mlp == "gelu":
      hidden = jax.nn.gelu(linear((*mlp, "up_proj"), y), approximate=True)
    else:
      act = jax.nn.silu if cfg.mlp == "swiglu" else lambda z: jax.nn.gelu(z, approximate=True)
      hidden = act(linear((*mlp, "gate_proj"), y)) * linear((*mlp, "up_proj"), y)
    x = x + linear((*mlp, "down_proj"), hidden)
  x = norm(("final_norm",), x)
  head = p[("embed", "embedding")].T if cfg.tie_embeddings else p[("lm_head",)]
  return jnp.dot(x, head, precision=hi)


@pytest.mark.parametrize(
  "overrides",
  [
    dict(qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=False),  # G = 2
    dict(n_kv_heads=4, mlp="geglu"),  # G = 1
    dict(n_kv_heads=1, d_ff=96),  # G = 4
    GPT2_STYLE,
  ],
  ids=["gqa-biases", "mha-geglu", "mqa", "gpt2"],
)
def test_fused_projections_compute_the_unfused_logits(tiny_cfg, tokens, overrides):
  """One q/k/v and one gate/up product give the logits of separate products with
  the same weights, to float32 rounding."""
  model = specjax.Transformer(tiny_cfg.replace(init_std=0.2, **overrides), rngs=nnx.Rngs(2))
  _perturb_biases_and_norms(model)
  want = np.asarray(_unfused_logits(model, tokens))
  assert np.std(want) > 1  # logits far from uniform: a wrong column order shows
  np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("n_heads", 3, "divisible by n_heads"),
    ("n_kv_heads", 3, "divisible by n_kv_heads"),
    ("d_model", 0, "d_model must be a positive integer"),
    ("vocab_size", -1, "vocab_size must be a positive integer"),
    ("norm", "batchnorm", "norm must be one of"),
    ("dtype", "int8", "dtype must be one of"),
    ("mlp", "relu", "mlp must be one of"),
    ("local_layers", (0,), "local_layers needs a sliding_window"),
    ("attn_softcap", 0.0, "attn_softcap must be None or a number > 0"),
    ("rope_local_theta", -1.0, "rope_local_theta must be None or a number > 0"),
  ],
)
def test_config_validation(tiny_cfg, field, value, message):
  with pytest.raises(ValueError, match=message):
    tiny_cfg.replace(**{field: value})


def test_per_layer_fields_are_checked(tiny_cfg):
  windowed = tiny_cfg.replace(sliding_window=4)
  for bad in ((2,), (0, 0), (-1,)):
    with pytest.raises(
      ValueError, match=r"local_layers must be distinct layer indices in \[0, 2\)"
    ):
      windowed.replace(local_layers=bad)
  cfg = windowed.replace(local_layers=[1], rope_local_theta=100.0)
  assert cfg.local_layers == (1,)  # a list (from JSON) becomes a hashable tuple
  assert [cfg.layer_window(i) for i in (0, 1)] == [None, 4]
  assert [cfg.layer_rope(i)[0] for i in (0, 1)] == [tiny_cfg.rope_theta, 100.0]
  with pytest.raises(ValueError, match="kind must be 'llama3' or 'linear'"):
    specjax.models.config.RopeScaling(2.0, kind="yarn")
  with pytest.raises(ValueError, match="'llama3' needs original_max_len"):
    specjax.models.config.RopeScaling(2.0)


def test_init_cache_capacity_range(target):
  with pytest.raises(ValueError, match=r"capacity must be in \[1, max_seq_len=128\]"):
    target.init_cache(1, 129)

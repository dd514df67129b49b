"""The model: configuration checks, and cached decoding == full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import GEMMA_STYLE, forward_cached, full_logits

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
  assert nnx.state(model, nnx.Param).layers[0].attn.q_proj.kernel.dtype == jnp.bfloat16
  # Give it the float32 model's weights, rounded, to compare like with like.
  ref = specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
  logits, cache = model.forward_cached(tokens, model.init_cache(3, 16))
  assert logits.dtype == jnp.float32
  assert cache.k[0].dtype == jnp.bfloat16
  error = np.max(np.abs(np.asarray(logits) - np.asarray(ref(tokens))))
  assert 0 < error < 0.05


def test_params_carry_logical_axis_names(target):
  specs = nnx.get_partition_spec(nnx.state(target, nnx.Param))
  assert tuple(specs.layers[0].attn.q_proj.kernel.get_value()) == ("embed", "heads")
  assert tuple(specs.layers[0].mlp.down_proj.kernel.get_value()) == ("mlp", "embed")
  assert tuple(specs.embed.embedding.get_value()) == ("vocab", "embed")


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

"""Scanned layers (`ModelConfig(scan_layers=True)`): the same function as the
unrolled model, through every path that runs or stores the layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import GEMMA_STYLE, TINY, forward_cached, full_logits, make_drafter, tiny_pair
from specjax.models.config import ModelConfig, default_scan_layers
from specjax.models.scan import ScannedBlocks, scan_model, unscan_model
from specjax.trees import full

PROMPTS = jnp.array([[5, 9, 2, 7, 1, 3, 8, 4], [6, 2, 9, 0, 0, 0, 0, 0]], jnp.int32)
LENGTHS = jnp.array([8, 3], jnp.int32)
GREEDY = specjax.SamplingParams(temperature=0.0)
SAMPLED = specjax.SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def pair():
  """(target, draft) unrolled, and the same two scanned."""
  target, draft = tiny_pair(scan_layers=False)
  return target, draft, scan_model(target), scan_model(draft)


def _close(a, b, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def test_layout_and_views(pair):
  target, _, scanned, _ = pair
  assert isinstance(scanned.layers, ScannedBlocks) and scanned.cfg.scan_layers is True
  kernel = nnx.state(scanned, nnx.Param).layers.block.attn.o_proj.kernel
  assert kernel.shape[0] == TINY["n_layers"]
  assert kernel.get_metadata()["out_sharding"] == ("layers", "heads", "embed")
  assert len(scanned.layers) == TINY["n_layers"]
  np.testing.assert_array_equal(
    scanned.layers[1].mlp.down_proj.kernel[...], target.layers[1].mlp.down_proj.kernel[...]
  )
  cache = scanned.init_cache(2, 16)
  assert cache.stacked and cache.k.shape == (2, 2, 2, 16, 16) and cache.capacity == 16
  assert cache.num_layers == 2
  # A model built scanned from a seed has the unrolled model's weights.
  built = specjax.Transformer(target.cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))
  for a, b in zip(jax.tree.leaves(nnx.state(built)), jax.tree.leaves(nnx.state(scanned))):
    np.testing.assert_array_equal(a, b)
  back = unscan_model(scanned)
  for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(target))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("style", ["llama", "gemma", "gpt2"])
def test_logits_match_unrolled(style):
  """Full and cached logits, features at chosen layers and layer skip, with mixed
  local/global windows and per-layer RoPE bases (Gemma) and learned positions."""
  extra = {
    "llama": dict(n_layers=3),
    "gemma": dict(GEMMA_STYLE, n_layers=3, local_layers=(0, 2)),
    "gpt2": dict(n_layers=3, norm="layernorm", mlp="gelu", positions="learned", qkv_bias=True),
  }[style]
  cfg = ModelConfig(**{**TINY, **extra, "scan_layers": False})
  model = specjax.Transformer(cfg, rngs=nnx.Rngs(3))
  scanned = scan_model(model)
  tokens = PROMPTS
  _close(full_logits(model, tokens), full_logits(scanned, tokens))
  cache, cache_s = model.init_cache(2, 24), scanned.init_cache(2, 24)
  (a, cache), (b, cache_s) = (
    forward_cached(model, tokens, cache),
    forward_cached(scanned, tokens, cache_s),
  )
  _close(a, b)
  step = tokens[:, :2]
  a, _, fa = forward_cached(model, step, cache, return_hidden=(1, 3))
  b, _, fb = forward_cached(scanned, step, cache_s, return_hidden=(1, 3))
  _close(a, b)
  _close(fa, fb)
  a, _ = forward_cached(model, tokens, model.init_cache(2, 24, num_layers=2), num_layers=2)
  b, _ = forward_cached(scanned, tokens, scanned.init_cache(2, 24, num_layers=2), num_layers=2)
  _close(a, b)


def test_cache_written_in_place_per_layer(pair):
  """Each layer writes only its T new slots of the stacked cache, at its own row offset."""
  _, _, scanned, _ = pair
  cache = scanned.init_cache(2, 16).with_lengths(jnp.array([3, 7], jnp.int32))
  _, new = forward_cached(scanned, PROMPTS[:, :2], cache)
  k = np.asarray(new.k)
  written = np.abs(k).sum(axis=(2, 4)) > 0  # [B, L, S]
  for row, start in enumerate((3, 7)):
    expected = np.zeros(16, bool)
    expected[start : start + 2] = True
    for layer in range(2):
      np.testing.assert_array_equal(written[row, layer], expected)
  np.testing.assert_array_equal(new.lengths, [5, 9])


# Layer skip: the draft model's CachedDrafting with another model (the slow tier);
# model_one_width: the accelerators' one-width draft loop, forced on the CPU.
@pytest.mark.sample("model", "eagle", "tree")
@pytest.mark.parametrize("drafter", ["model", "model_one_width", "layer_skip", "eagle", "tree"])
def test_speculative_tokens_match_unrolled(pair, drafter):
  """Same tokens, greedy and sampled (same key), scanned against unrolled: for a
  draft model, layer skip, an EAGLE head (target features) and a token tree
  (the accepted path moved within the stacked cache)."""
  target, draft, scanned, scanned_draft = pair

  def drafter_for(t, d):
    if drafter == "tree":
      return specjax.drafting.TreeDrafter(d, full((2, 1)))  # 4 nodes: 2 branches of 2
    return make_drafter(drafter, t, d)

  for sampling, key in ((GREEDY, None), (SAMPLED, jax.random.key(4))):
    outs = [
      specjax.speculative_generate(
        t,
        drafter_for(t, d),
        PROMPTS,
        LENGTHS,
        gamma=4 if drafter == "tree" else 3,
        max_new_tokens=10,
        sampling=sampling,
        key=key,
      )
      for t, d in ((target, draft), (scanned, scanned_draft))
    ]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].num_generated, outs[1].num_generated)


def test_gradients_match_unrolled(pair):
  target, _, scanned, _ = pair

  def loss(model):
    return jnp.mean(model(PROMPTS) ** 2)

  grads, grads_s = nnx.grad(loss)(target), nnx.grad(loss)(scanned)
  stacked = grads_s.layers.block.mlp.down_proj.kernel[...]
  for i in range(TINY["n_layers"]):
    _close(grads.layers[i].mlp.down_proj.kernel[...], stacked[i], tol=1e-7)


def test_hf_round_trip_and_expand(pair, tmp_path):
  """Export writes per-layer tensors; a scanned config loads them stacked; growth
  keeps the layout the new config asks for."""
  from specjax.hf.export import save_model
  from specjax.hf.loader import load_model

  target, _, scanned, _ = pair
  save_model(scanned, str(tmp_path), dtype="float32")
  loaded, _ = load_model(str(tmp_path), dtype=jnp.float32)
  assert not loaded.cfg.scanned  # the platform default on CPU
  _close(full_logits(target, PROMPTS), full_logits(loaded, PROMPTS))
  loaded, _ = load_model(str(tmp_path), dtype=jnp.float32, scan_layers=True)
  assert isinstance(loaded.layers, ScannedBlocks)
  _close(full_logits(target, PROMPTS), full_logits(loaded, PROMPTS))
  grown_cfg = specjax.models.expanded_config(target.cfg, n_layers=3).replace(scan_layers=True)
  grown = specjax.models.expand(target, grown_cfg)
  assert isinstance(grown.layers, ScannedBlocks) and len(grown.layers) == 3
  _close(full_logits(target, PROMPTS), full_logits(grown, PROMPTS), tol=1e-4)


def test_checkpoint_round_trip(pair, tmp_path):
  """Orbax checkpoints of a scanned model restore as saved; the run's config
  records the layout (scan_layers resolved), so any platform reads it."""
  from specjax.training import checkpoint

  _, _, scanned, _ = pair
  workdir = str(tmp_path)
  checkpoint.save_model_config(workdir, scanned.cfg)
  saver = checkpoint.Checkpointer(workdir)
  saver.save(3, nnx.state(scanned, nnx.Param), {"count": jnp.int32(0)}, {"step": 3}, force=True)
  saver.close()
  restored, step = checkpoint.load_trained_model(workdir)
  assert step == 3 and isinstance(restored.layers, ScannedBlocks)
  for a, b in zip(jax.tree.leaves(nnx.state(restored)), jax.tree.leaves(nnx.state(scanned))):
    np.testing.assert_array_equal(a, b)
  unrolled = scanned.cfg.replace(scan_layers=None)  # resolves to unrolled on CPU
  with pytest.raises(ValueError, match=r"scan_layers \(True saved, False configured\)"):
    checkpoint.check_resumable(workdir, unrolled)


def test_config():
  assert default_scan_layers("cpu") is False
  # XLA:GPU copies a scanned layer's weight slices too (a dynamic-slice fusion per
  # weight that splits the loop's command buffer): unrolled there as on CPU.
  assert default_scan_layers("gpu") is False and default_scan_layers("tpu") is True
  cfg = ModelConfig(**TINY)
  assert cfg.scan_layers is None and cfg.scanned is default_scan_layers()
  with pytest.raises(ValueError, match=r"ModelConfig.scan_layers must be None, True or False"):
    ModelConfig(**TINY, scan_layers="yes")

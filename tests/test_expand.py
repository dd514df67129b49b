"""Function-preserving expansion (`specjax.models.expand`) and the scaled-pair presets.

Each expansion of a random tiny model (weights large enough that attention is far
from uniform, norm scales and biases random too) gives the same logits, full
and cached, to float32 rounding; greedy decoding gives the same tokens; expanded
draft heads predict the same features; refused shapes name the ModelConfig
field. The presets are checked without building them: their configs are exact
expansions of the bundled pair's, of the parameter counts the docs state.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import GEMMA_STYLE, TINY
from specjax import pretrained
from specjax.heads import config as head_config
from specjax.heads import expand_head, make_head
from specjax.models import (
  check_expansion,
  expand,
  expanded_config,
  expanded_layer_count,
  layer_map,
)
from specjax.models.config import RopeScaling
from specjax.models.fused import qkv_parts
from specjax.pretrained.scales import SCALES, Scale, scale_pair, scaled_configs

ROOT = pathlib.Path(__file__).resolve().parent.parent
ATOL = 1e-4
PROMPT = 12  # tokens per row of the logit checks: 8 prefilled into a cache, then 4


def _randomize(module: nnx.Module, seed: int, std: float = 0.3) -> nnx.Module:
  """`module` with every norm scale and bias random around its initial value
  (an expansion must carry them, not only the kernels)."""
  flat = []
  leaves = nnx.to_flat_state(nnx.state(module, nnx.Param))
  for i, (path, variable) in enumerate(leaves):
    value = variable.get_value()
    if path[-1] in ("scale", "bias") or value.ndim == 2 and not value.any():  # Medusa: zeros
      noise = jax.random.normal(jax.random.key(seed * 1000 + i), value.shape)
      value = value + std * noise.astype(value.dtype)
    flat.append((path, variable.replace(value)))
  nnx.update(module, nnx.from_flat_state(flat))
  return module


def _model(seed: int = 0, **overrides) -> specjax.Transformer:
  """A random model of the TINY shape with `overrides`; init_std 0.2 makes the
  attention far from uniform and the logits O(1)."""
  cfg = specjax.ModelConfig(**{**TINY, "init_std": 0.2, **overrides})
  return _randomize(specjax.Transformer(cfg, rngs=nnx.Rngs(seed)), seed)


@jax.jit
def _logits(model, tokens):
  """`(full [B, T, V], cached [B, T, V])`: the forward without a cache, and the
  same tokens fed to forward_cached in two calls (8 tokens, then the rest)."""
  cache = model.init_cache(tokens.shape[0], tokens.shape[1])
  first, cache = model.forward_cached(tokens[:, :8], cache)
  rest, _ = model.forward_cached(tokens[:, 8:], cache)
  return model(tokens), jnp.concatenate([first, rest], axis=1)


def _tokens(vocab: int, seed: int = 3) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (2, PROMPT), 0, vocab, dtype=jnp.int32)


def _assert_same_logits(old, new):
  tokens = _tokens(old.cfg.vocab_size)
  (full_old, cached_old), (full_new, cached_new) = _logits(old, tokens), _logits(new, tokens)
  assert float(jnp.std(full_old)) > 0.5  # a function worth preserving
  np.testing.assert_allclose(full_new, full_old, atol=ATOL, rtol=0)
  np.testing.assert_allclose(cached_new, cached_old, atol=ATOL, rtol=0)


def _greedy(model) -> np.ndarray:
  prompts = _tokens(model.cfg.vocab_size, seed=5)[:, :6]
  out = specjax.autoregressive_generate(
    model, prompts, jnp.array([6, 3], jnp.int32), max_new_tokens=8, sampling=specjax.GREEDY
  )
  return np.asarray(out.tokens)


LLAMA3_SCALING = RopeScaling(
  factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=16
)
_SIZES = dict(d_model=128, n_layers=5, n_heads=12, n_kv_heads=3, head_dim=32, d_ff=256)
# name -> (base overrides, expansion sizes)
CASES = {
  # norm_offset is free: the scales are rewritten for the new offset.
  "wider": ({}, dict(d_model=96, head_dim=16, d_ff=192, norm_offset=1.0)),
  "heads_gqa": ({}, dict(n_heads=12, n_kv_heads=3, head_dim=16)),  # K 2 -> 3, G 2 -> 4
  # H 16 -> 32: rope_theta squared; Llama 3 scaling acts on each frequency alone.
  "head_dim": (dict(rope_scaling=LLAMA3_SCALING), dict(head_dim=32)),
  "deeper": ({}, dict(n_layers=5)),
  "all_untied": ({}, dict(_SIZES, max_seq_len=160)),
  "all_tied": (dict(tie_embeddings=True), _SIZES),
  # Gemma-style: sandwich norms, offset 1, q/k norms (D and H grow by the same
  # factor), a local layer moved with its layer, its own RoPE base, soft-caps.
  "gemma": ({**GEMMA_STYLE, "scale_embeddings": False}, dict(_SIZES, head_dim=32, d_model=128)),
  # GPT-2-like layout on RMSNorm: learned positions, GELU, every bias.
  "biases_learned": (
    dict(positions="learned", mlp="gelu", qkv_bias=True, out_bias=True, mlp_bias=True),
    dict(_SIZES, head_dim=16, max_seq_len=160),
  ),
  # The fused q/k/v and gate/up biases: K, G and F grow.
  "biases_gated": (
    dict(qkv_bias=True, mlp_bias=True),
    dict(n_heads=12, n_kv_heads=3, head_dim=16, d_ff=192),
  ),
}


@pytest.fixture(scope="module")
def expanded():
  """name -> (old model, new model) of each case, built once."""
  built = {}

  def get(name):
    if name not in built:
      overrides, sizes = CASES[name]
      old = _model(**overrides)
      built[name] = old, expand(old, expanded_config(old.cfg, **sizes))
    return built[name]

  return get


@pytest.mark.parametrize("name", list(CASES))
def test_expansion_preserves_the_logits(expanded, name):
  old, new = expanded(name)
  sizes = CASES[name][1]
  assert all(
    getattr(new.cfg, f) == v for f, v in sizes.items() if f != "head_dim"
  ) and new.cfg.resolved_head_dim == sizes.get("head_dim", old.cfg.resolved_head_dim)
  assert new.num_params > old.num_params
  _assert_same_logits(old, new)


# The default tier: one case, whose base model's program scale_pair's test reuses.
@pytest.mark.sample("all_untied")
@pytest.mark.parametrize("name", list(CASES))
def test_expansion_preserves_greedy_decoding(expanded, name):
  old, new = expanded(name)
  np.testing.assert_array_equal(_greedy(new), _greedy(old))


def test_expansion_into_another_dtype_builds_every_parameter_in_it(expanded):
  old, _ = expanded("all_tied")
  new = expand(old, expanded_config(old.cfg, **_SIZES, dtype="bfloat16", param_dtype="bfloat16"))
  dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(new, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  # The kept block is the old one rounded; an inserted block is an identity.
  moved = layer_map(old.cfg.n_layers, new.cfg.n_layers)
  q = qkv_parts(new.cfg)[0].take(new.layers[moved[1]].attn.qkv_proj.kernel[...])
  assert q.shape == (128, 12 * 32) and not q[64:].any()
  identity = new.layers[1]
  assert 1 not in moved and not identity.attn.o_proj.kernel[...].any()
  assert (identity.attn_norm.scale[...] == 1).all()


def test_layer_map_keeps_the_ends_and_spreads_the_identities():
  assert layer_map(6, 22) == (0, 4, 8, 13, 17, 21)
  assert layer_map(2, 7) == (0, 6)
  assert layer_map(1, 3) == (0,)
  assert layer_map(4, 4) == (0, 1, 2, 3)
  for n_old, n_new in ((3, 4), (5, 9), (6, 32)):
    moved = layer_map(n_old, n_new)
    assert moved[0] == 0 and moved[-1] == n_new - 1 and all(np.diff(moved) >= 1)
  assert [expanded_layer_count(c, 6, 22) for c in range(1, 7)] == [1, 5, 9, 14, 18, 22]
  with pytest.raises(ValueError, match=r"n_new \(3\) must be >= n_old \(4\)"):
    layer_map(4, 3)
  with pytest.raises(ValueError, match=r"count must be an integer in \[1, 6\]"):
    expanded_layer_count(7, 6, 22)


# -- draft heads


HEAD_CASES = {
  "eagle_fused": ("eagle", dict(feature_layers=(1, 2))),  # block d_ff follows the target
  "eagle_own_d_ff": ("eagle", dict(d_ff=48)),
  "medusa": ("medusa", dict(num_heads=3)),
  "early_exit": ("early_exit", dict(exit_layer=1, d_ff=48)),
  # one feature and a learned mask: fc's rows are nf * D, not EAGLE's 2D
  "dflash": ("dflash", dict(block_size=4, draft_layers=1, d_ff=48)),
  # the block drafter's layers, and its Markov (rank kept) and confidence heads
  "dspark": ("dspark", dict(block_size=4, draft_layers=1, d_ff=48, markov_rank=8)),
}


def _head_logits(target, head, tokens):
  """The head's draft logits at every position, through the target's final norm and head."""
  cfg = head.cfg
  b, t = tokens.shape
  if cfg.kind == "early_exit":
    cache = target.init_cache(b, t, num_layers=cfg.exit_layer)
    _, _, features = target.forward_cached(
      tokens, cache, num_layers=cfg.exit_layer, return_hidden=True
    )
    return target.features_to_logits(head(features))
  _, _, features = target.forward_cached(
    tokens, target.init_cache(b, t), return_hidden=cfg.target_features
  )
  if cfg.kind == "medusa":
    return target.features_to_logits(head(features))
  anchors = jnp.broadcast_to(jnp.array([2, 5]), (b, 2))
  if cfg.kind == "dflash":  # blocks at positions 2 and 5
    return head(target, features, tokens, anchors)
  if cfg.kind == "dspark":  # the corrected laws and the confidence logits alike
    h = head.train_hidden(target, features, tokens, anchors)
    previous = jnp.take_along_axis(tokens, (anchors[:, :, None] + jnp.arange(3)).reshape(b, -1), 1)
    embed = head.markov_embed(previous.reshape(b, 2, 3))
    confidence = head.confidence_logit(h, embed)[..., None]
    return jnp.concatenate([head.corrected(head.logits(target, h), embed), confidence], -1)
  next_tokens = jnp.roll(tokens, -1, axis=1)
  return target.features_to_logits(head(target, head.feature_space(features), next_tokens))


_jit_head_logits = jax.jit(_head_logits)


@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_expanded_heads_predict_the_same(expanded, name):
  old_target, new_target = expanded("all_tied")
  kind, settings = HEAD_CASES[name]
  head = make_head(head_config(kind, old_target.cfg, **settings), rngs=nnx.Rngs(4))
  head = _randomize(head, 4, std=0.2)
  new_head = expand_head(head, new_target.cfg)
  assert new_head.cfg.target == new_target.cfg
  assert new_head.cfg.d_ff == head.cfg.d_ff
  if kind == "eagle":
    assert new_head.cfg.feature_layers == tuple(
      expanded_layer_count(c, 2, 5) for c in settings.get("feature_layers", ())
    )
  if kind == "early_exit":
    assert new_head.cfg.exit_layer == expanded_layer_count(1, 2, 5) == 1
  tokens = _tokens(old_target.cfg.vocab_size)
  want = _jit_head_logits(old_target, head, tokens)
  assert float(jnp.std(want)) > 0.5
  np.testing.assert_allclose(_jit_head_logits(new_target, new_head, tokens), want, atol=ATOL)


def test_expand_head_refuses_a_head_config_with_other_layer_counts(expanded):
  old_target, new_target = expanded("all_tied")
  head = make_head(head_config("early_exit", old_target.cfg, exit_layer=1), rngs=nnx.Rngs(0))
  wrong = head_config("early_exit", new_target.cfg, exit_layer=3)
  with pytest.raises(ValueError, match=r"HeadConfig.exit_layer: the expanded head needs 1, got 3"):
    expand_head(head, wrong)


# -- refusals


_BASE = specjax.ModelConfig(**TINY)
# (base overrides, new-config fields, the message); fields go through expanded_config.
REFUSED = {
  "vocab": ({}, dict(vocab_size=1024), r"ModelConfig.vocab_size: an expansion keeps it \(512\)"),
  "tie": ({}, dict(tie_embeddings=True), r"ModelConfig.tie_embeddings: an expansion keeps it"),
  "mlp_kind": ({}, dict(mlp="geglu"), r"ModelConfig.mlp: an expansion keeps it"),
  "positions": ({}, dict(positions="learned"), r"ModelConfig.positions: an expansion keeps it"),
  "window": ({}, dict(sliding_window=8), r"ModelConfig.sliding_window: an expansion keeps it"),
  "narrower": ({}, dict(d_model=48, head_dim=16), r"ModelConfig.d_model: .*never shrinks it"),
  "shallower": ({"n_layers": 3}, dict(n_layers=2), r"ModelConfig.n_layers: .*never shrinks"),
  "d_ff": ({}, dict(d_ff=64), r"ModelConfig.d_ff: an expansion never shrinks it: 128 -> 64"),
  "kv_heads": ({}, dict(n_kv_heads=1), r"ModelConfig.n_kv_heads: .*never shrinks it: 2 -> 1"),
  "groups": ({}, dict(n_kv_heads=4, head_dim=16), r"ModelConfig.n_heads: .*groups of 1, fewer"),
  "layernorm": (
    dict(norm="layernorm"),
    dict(d_model=96, head_dim=16),
    r"ModelConfig.norm: a layernorm model keeps d_model",
  ),
  "scaled_embeddings": (
    dict(scale_embeddings=True),
    dict(d_model=96, head_dim=16),
    r"ModelConfig.scale_embeddings: .*d_model stays 64",
  ),
  "qk_norm": (
    dict(qk_norm=True),
    dict(d_model=128, head_dim=16),
    r"ModelConfig.head_dim: with qk_norm.*needs head_dim 32",
  ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_expansions_name_the_field(name):
  overrides, fields, message = REFUSED[name]
  base = _BASE.replace(**overrides)
  with pytest.raises(ValueError, match=message):
    expanded_config(base, **fields)
  with pytest.raises(ValueError, match=message):
    check_expansion(base, base.replace(**fields))


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(d_model=128, head_dim=16), r"ModelConfig.norm_eps: this expansion needs 5e-06"),
    (dict(head_dim=32, norm_eps=1e-5), r"ModelConfig.rope_theta: this expansion needs 100000000"),
    (dict(head_dim=32, rope_theta=1e8), r"ModelConfig.attn_scale: .* of 0.25 \(the base's\)"),
  ],
)
def test_a_config_without_the_derived_fields_is_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    check_expansion(_BASE, _BASE.replace(**fields))
  with pytest.raises(ValueError, match=message):
    expand(specjax.Transformer(_BASE, rngs=nnx.Rngs(0)), _BASE.replace(**fields))


def test_local_layers_must_move_with_their_layers():
  base = _BASE.replace(sliding_window=4, local_layers=(1,))
  assert expanded_config(base, n_layers=5).local_layers == (4,)
  with pytest.raises(ValueError, match=r"ModelConfig.local_layers: base layer 1 .* needs \(4,\)"):
    check_expansion(base, base.replace(n_layers=5))
  with pytest.raises(ValueError, match=r"expanded_config derives norm_eps from the base"):
    expanded_config(_BASE, d_model=128, norm_eps=1e-6)


# -- scaled pairs


# A stand-in preset for the tiny models. Its shapes are those of the cases above
# ("all_untied" for the target, "deeper" for a TINY-shaped draft), so that the
# checks below reuse their compiled programs.
TINY_SCALE = Scale(
  "tiny",
  target=dict(_SIZES, max_seq_len=160),
  draft=CASES["deeper"][1],
  note="a stand-in for the tests",
)


def test_scale_pair_grows_a_tiny_pair_and_keeps_its_greedy_output():
  target, draft = _model(0), _model(1)
  big_target, big_draft = scale_pair(target, draft, TINY_SCALE)
  assert big_target.cfg.d_model == 128 and big_draft.cfg.n_layers == 5
  np.testing.assert_array_equal(_greedy(big_target), _greedy(target))
  _assert_same_logits(draft, big_draft)
  half_target, half_draft = scale_pair(target, draft, TINY_SCALE, dtype=jnp.bfloat16)
  for model in (half_target, half_draft):
    assert model.cfg.param_dtype == model.cfg.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.bfloat16)}
  same = scale_pair(target, draft, Scale("none", target={}, draft={}))
  assert same[0] is target and same[1] is draft
  with pytest.raises(ValueError, match=r"ModelConfig.n_layers: an expansion never shrinks"):
    scale_pair(target, draft, Scale("bad", target=dict(n_layers=1), draft={}))


def _params(cfg) -> int:
  """cfg's parameter count, from abstract models of 1 and 2 layers (no weights):
  every layer has the same parameters, so the count is affine in n_layers (and
  tracing 32 abstract layers costs seconds)."""
  one, two = (
    nnx.eval_shape(lambda n=n: specjax.Transformer(cfg.replace(n_layers=n), rngs=nnx.Rngs(0)))
    for n in (1, 2)
  )
  return one.num_params + (cfg.n_layers - 1) * (two.num_params - one.num_params)


def test_presets_are_exact_expansions_of_the_bundled_pair_of_the_documented_sizes():
  bundled_target, bundled_draft = pretrained.bundled_configs()
  docs = (ROOT / "docs" / "scaled_pairs.md").read_text()
  docstring = specjax.pretrained.scales.__doc__
  expected = {"160m": 116_411_136, "1b": 1_000_433_664, "7b": 6_493_048_832}
  for name, scale in SCALES.items():
    target, draft = scaled_configs(name, bundled_target, bundled_draft, dtype=jnp.bfloat16)
    check_expansion(bundled_target, target)
    check_expansion(bundled_draft, draft)
    assert target.vocab_size == draft.vocab_size == 4096
    assert target.param_dtype == draft.param_dtype == "bfloat16"
    counts = (_params(target), _params(draft))
    assert counts[0] == expected[name]
    for count in counts:
      assert f"{count:,}" in scale.note + docstring, (name, count)
      assert f"{count:,}" in docs, (name, count)
  assert _params(scaled_configs("1b", bundled_target, bundled_draft)[1]) == 69_217_536
  assert scaled_configs("160m", bundled_target, bundled_draft)[1] == bundled_draft
  seven = scaled_configs("7b", bundled_target, bundled_draft)[0]
  assert (seven.resolved_head_dim, seven.rope_theta, seven.attn_scale) == (128, 1e8, 0.125)
  assert re.search(r"\b1,000,433,664\b", docs)


def test_load_pair_refuses_an_unknown_scale_before_reading_files():
  with pytest.raises(ValueError, match=r"scale must be one of '160m', '1b', '7b', got '2b'"):
    pretrained.load_pair(scale="2b")


def test_bundled_heads_load_for_a_scaled_target():
  """`load_head` / `load_drafter` expand the bundled heads for a grown target:
  the same draft logits as on the bundled target."""
  pair = pretrained.load_pair()
  small = Scale("small", target=dict(d_model=384, n_layers=8, n_heads=6, n_kv_heads=6), draft={})
  grown, draft = scale_pair(pair.target, pair.draft, small)
  assert draft is pair.draft
  tokens = _tokens(4096)[:, :8]
  head = pretrained.load_head("eagle", pair.target)
  big = pretrained.load_head("eagle", grown)
  assert big.cfg.target == grown.cfg and big.cfg.d_ff == head.cfg.d_ff == 320
  want = _jit_head_logits(pair.target, head, tokens)
  np.testing.assert_allclose(_jit_head_logits(grown, big, tokens), want, atol=ATOL)
  # The other kinds grow alike (their logits: test_expanded_heads_predict_the_same).
  exit_layer = pretrained.load_drafter("early_exit", grown).adapter.cfg.exit_layer
  assert exit_layer == expanded_layer_count(2, 6, 8) == 2  # layer_map(6, 8)[1] == 1
  assert pretrained.load_drafter("medusa", grown).heads.cfg.target == grown.cfg
  block = pretrained.load_drafter("dflash", grown).head.cfg
  assert block.target == grown.cfg and block.feature_layers == tuple(
    expanded_layer_count(c, 6, 8) for c in (2, 3, 4, 5, 6)
  )
  with pytest.raises(ValueError, match="this eagle head was trained for another target"):
    pretrained.load_head("eagle", _model())

"""The block drafter's hub layout (`specjax.heads.dflash`: z-lab/dflash's `DFlashDraftModel`).

An exported head, read back by a small torch implementation of the published forward
pass written from its description (the file's names and `[out, in]` weights, Qwen3's
RMSNorm, RoPE and SwiGLU, the block reading the context's keys both ways), gives the
logits specjax's head gives, drafting and in its training form; export then import
gives identical tensors and logits for every target shape; what the layout cannot hold
is refused naming it, and files that do not fit the target are refused naming the field
or tensor.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
from helpers import TINY
from specjax import heads
from specjax.heads import HeadConfig, make_head
from specjax.heads import config as head_config
from specjax.heads.dflash import DFlashDrafter, DFlashHead
from specjax.hf import load_drafter, load_head, save_head
from specjax.models.config import RopeScaling

MASK = 500  # a "spare" id of the tiny vocabulary
BLOCK = 4
# Target shapes (over TINY with 4 layers) and head settings exported: plain Llama/Qwen3
# blocks, every attention bias, q/k/v's alone (Qwen2: o's written as zeros), o's
# alone, a tied head, wider heads with another RoPE base, linear and Llama 3 RoPE
# scaling, a capped head, and a drafter of three layers reading features out of order.
SHAPES = {
  "plain": ({}, {}),
  "biased": (dict(qkv_bias=True, out_bias=True), {}),
  "qkv_biased": (dict(qkv_bias=True), {}),
  "out_biased": (dict(out_bias=True), {}),
  "tied": (dict(tie_embeddings=True), {}),
  "wide_heads": (dict(head_dim=24, rope_theta=5e5), dict(d_ff=0)),
  "linear_rope": (dict(rope_scaling=RopeScaling(factor=2.0, kind="linear")), {}),
  "llama3_rope": (
    dict(
      rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=32
      )
    ),
    {},
  ),
  "capped": (dict(logit_softcap=3.0), {}),
  "three_layers": ({}, dict(draft_layers=3, feature_layers=(3, 1, 4))),
}


def _target(**overrides) -> specjax.Transformer:
  config = specjax.ModelConfig(**{**TINY, "n_layers": 4, **overrides})
  return specjax.Transformer(config, rngs=nnx.Rngs(6))


def _perturbed(head, seed=7):
  """`head` with every parameter moved off its initial value (zero biases, unit norm
  scales), so an exporter that skipped or mislaid one is caught."""
  graphdef, state = nnx.split(head)
  flat = nnx.to_flat_state(state)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  moved = []
  for k, (path, v) in zip(keys, flat):
    x = v.get_value()
    moved.append((path, v.replace(x + 0.1 * jax.random.normal(k, x.shape, x.dtype))))
  return nnx.merge(graphdef, nnx.from_flat_state(moved))


def _head(target, seed=7, **fields) -> DFlashHead:
  settings = dict(block_size=BLOCK, draft_layers=2, mask_token_id=MASK, d_ff=96) | fields
  head = make_head(head_config("dflash", target.cfg, **settings), rngs=nnx.Rngs(4))
  return _perturbed(head, seed)


def _shape(name):
  overrides, fields = SHAPES[name]
  target = _target(**overrides)
  return target, _head(target, **fields)


def _params(module) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def _tokens(b=2, t=9, seed=3) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (b, t), 0, TINY["vocab_size"], jnp.int32)


def _features(target, tokens, layers):
  cache = target.init_cache(tokens.shape[0], tokens.shape[1])
  return target.forward_cached(tokens, cache, return_hidden=tuple(layers))[2]


def _draft_logits(head, target, tokens, last) -> np.ndarray:
  """specjax drafting: the context of `tokens [B, T]` cached (T slots of T + 3), the
  block after `last [B]` at positions T .. T + B_size - 1."""
  b, t = tokens.shape
  features = _features(target, tokens, head.cfg.feature_layers)
  cache = head.init_cache(b, t + 3)
  cache = head.write_context(features, cache, jnp.zeros((b,), jnp.int32))
  return np.asarray(head.draft_logits(target, cache.with_lengths(jnp.full((b,), t)), last))


# ---------------------------------------------------------------------------------------
# The published forward pass in torch, from the file alone.


def _rms(torch, x, weight, eps):
  x = x.float()
  return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(state, x, name):
  y = x @ state[f"{name}.weight"].T
  bias = state.get(f"{name}.bias")
  return y if bias is None else y + bias


def _inv_freq(torch, config):
  h = config["head_dim"]
  inv = 1.0 / config["rope_theta"] ** (torch.arange(0, h, 2, dtype=torch.float64) / h)
  scaling = config["rope_scaling"]
  if scaling is None:
    return inv
  if scaling["rope_type"] == "linear":
    return inv / scaling["factor"]
  # Llama 3: long wavelengths divided by the factor, short kept, a smooth band between.
  keys = ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
  old, lo, hi = (scaling[k] for k in keys)
  low, high, wavelength = old / lo, old / hi, 2 * torch.pi / inv
  smooth = (old / wavelength - lo) / (hi - lo)
  blended = (1 - smooth) * inv / scaling["factor"] + smooth * inv
  out = torch.where(wavelength > low, inv / scaling["factor"], inv)
  return torch.where((wavelength <= low) & (wavelength >= high), blended, out)


def _rope(torch, x, positions, inv_freq):
  """`x [B, heads, T, H]` rotated by `positions [T]` (halves, as transformers' Qwen3)."""
  angles = (positions[:, None].double() * inv_freq[None]).float()
  cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
  half = x.shape[-1] // 2
  rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def torch_dflash(torch, config, state, hidden_states, noise, start):
  """The drafter's normed outputs `[B, N, D]` for the block `noise [B, N, D]` (its
  embeddings) at positions start .. start + N - 1, reading the context at positions
  0 .. start - 1: `hidden_states` as transformers gives them (index 0: the embeddings,
  i: after i layers), the layer ids of `config["dflash_config"]["target_layer_ids"]`."""
  eps, h = config["rms_norm_eps"], config["head_dim"]
  nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
  ids = config["dflash_config"]["target_layer_ids"]
  context = torch.cat([hidden_states[i + 1][:, :start] for i in ids], -1)
  context = _rms(torch, _linear(state, context, "fc"), state["hidden_norm.weight"], eps)
  b, n, _ = noise.shape
  inv_freq = _inv_freq(torch, config)
  every = torch.arange(start + n)
  x = noise
  for i in range(config["num_hidden_layers"]):
    at = f"layers.{i}."
    normed = _rms(torch, x, state[at + "input_layernorm.weight"], eps)
    q = _linear(state, normed, at + "self_attn.q_proj").view(b, n, nq, h)
    q = _rms(torch, q, state[at + "self_attn.q_norm.weight"], eps).transpose(1, 2)
    both = torch.cat([context, normed], 1)
    k = _linear(state, both, at + "self_attn.k_proj").view(b, start + n, nkv, h)
    k = _rms(torch, k, state[at + "self_attn.k_norm.weight"], eps).transpose(1, 2)
    v = _linear(state, both, at + "self_attn.v_proj").view(b, start + n, nkv, h).transpose(1, 2)
    q, k = _rope(torch, q, every[start:], inv_freq), _rope(torch, k, every, inv_freq)
    k, v = (a.repeat_interleave(nq // nkv, dim=1) for a in (k, v))  # query head j: kv j // G
    weights = torch.softmax(q @ k.transpose(-1, -2) * h**-0.5, -1)  # no mask: both ways
    out = (weights @ v).transpose(1, 2).reshape(b, n, nq * h)
    x = x + _linear(state, out, at + "self_attn.o_proj")
    normed = _rms(torch, x, state[at + "post_attention_layernorm.weight"], eps)
    gate, up = (_linear(state, normed, f"{at}mlp.{p}") for p in ("gate_proj", "up_proj"))
    x = x + _linear(state, torch.nn.functional.silu(gate) * up, at + "mlp.down_proj")
  return _rms(torch, x, state["norm.weight"], eps)


def _torch_logits(torch, config, lm_head, hidden):
  """The target's head on the block's positions 1 .., capped as `dflash_config` says."""
  logits = hidden[:, 1:] @ lm_head.T
  cap = config["dflash_config"].get("final_logit_softcapping")
  return logits if not cap else torch.tanh(logits / cap) * cap


def _torch_target(torch, target, tokens):
  """(transformers-style hidden states of `tokens`, embed `[V, D]`, lm_head `[V, D]`)."""
  n = target.cfg.n_layers
  every = _features(target, tokens, range(1, n + 1))
  hidden = [target.embed(tokens), *jnp.split(every, n, axis=-1)]
  embed = np.asarray(target.embed.embedding[...])
  head = embed if target.cfg.tie_embeddings else np.asarray(target.lm_head[...]).T
  hidden = [torch.from_numpy(np.array(a, np.float32)) for a in hidden]
  return hidden, torch.from_numpy(np.array(embed)), torch.from_numpy(np.array(head, np.float32))


@pytest.mark.sample("plain", "biased", "tied", "llama3_rope", "three_layers")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_torch_reading_of_the_export_computes_the_heads_logits(tmp_path, shape):
  torch = pytest.importorskip("torch")
  target, head = _shape(shape)
  save_head(head, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  # The target hands a head its features in depth order; the file's ids are that order.
  ids = [c - 1 for c in sorted(head.cfg.feature_layers)]
  assert config["dflash_config"]["target_layer_ids"] == ids
  state = {
    k: torch.from_numpy(v) for k, v in load_file(str(tmp_path / "model.safetensors")).items()
  }
  tokens, last = _tokens(), jnp.array([7, 300], jnp.int32)
  hidden, embed, lm_head = _torch_target(torch, target, tokens)
  t = tokens.shape[1]

  def block(first):  # [last verified token, mask, ..., mask], embedded by the target
    ids = torch.tensor(
      [[int(f)] + [config["dflash_config"]["mask_token_id"]] * (BLOCK - 1) for f in first]
    )
    return embed[ids]

  # Drafting: the context is the whole prompt, the block starts after it.
  out = torch_dflash(torch, config, state, hidden, block(last), t)
  want = _torch_logits(torch, config, lm_head, out).numpy()
  got = _draft_logits(head, target, tokens, last)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  # Training form: block j starts at anchor a_j with tokens[a_j], reading positions < a_j.
  anchors = jnp.array([[1, 4, 8], [2, 3, 6]], jnp.int32)
  features = _features(target, tokens, head.cfg.feature_layers)
  got = np.asarray(head(target, features, tokens, anchors))
  for row in range(2):
    for j, a in enumerate(np.asarray(anchors[row])):
      rows = [h[row : row + 1] for h in hidden]
      out = torch_dflash(torch, config, state, rows, block([tokens[row, a]]), int(a))
      want = _torch_logits(torch, config, lm_head, out).numpy()[0]
      np.testing.assert_allclose(got[row, j], want, atol=1e-4, rtol=1e-4, err_msg=f"{row} {j}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_then_import_is_identical(tmp_path, shape):
  target, head = _shape(shape)
  save_head(head, str(tmp_path / "hub"))
  again = load_head(str(tmp_path / "hub"), target)
  assert isinstance(again, DFlashHead) and again.cfg == _in_depth_order(head.cfg)
  mine, theirs = _params(head), _params(again)
  assert mine.keys() == theirs.keys()
  for key in mine:
    np.testing.assert_array_equal(mine[key], theirs[key], err_msg=str(key))
  tokens, last = _tokens(), jnp.array([7, 300], jnp.int32)
  np.testing.assert_array_equal(
    _draft_logits(head, target, tokens, last), _draft_logits(again, target, tokens, last)
  )
  # The drafter loads too, and saving it writes the same bytes as saving its head.
  drafter = load_drafter(str(tmp_path / "hub"), target)
  assert isinstance(drafter, DFlashDrafter) and heads.module_of(drafter).cfg == again.cfg
  save_head(drafter, str(tmp_path / "again"))
  for name in ("config.json", "model.safetensors"):
    with open(tmp_path / "hub" / name, "rb") as a, open(tmp_path / "again" / name, "rb") as b:
      assert a.read() == b.read(), name


def _in_depth_order(cfg: HeadConfig) -> HeadConfig:
  return dataclasses.replace(cfg, feature_layers=tuple(sorted(cfg.feature_layers)))


def test_ids_out_of_depth_order_are_read_as_the_reference_concatenates_them(tmp_path):
  """The reference concatenates `hidden_states[id + 1]` in the file's order of ids;
  specjax's target hands them over in depth order: fc's input blocks are reordered."""
  target, head = _shape("three_layers")  # feature layers (3, 1, 4): ids 0, 2, 3 written
  save_head(head, str(tmp_path / "hub"))
  tensors = load_file(str(tmp_path / "hub" / "model.safetensors"))
  blocks = np.split(tensors["fc.weight"], 3, axis=1)  # [D, 3D]: ids 0, 2, 3
  shuffled = {"fc.weight": np.concatenate([blocks[2], blocks[0], blocks[1]], axis=1)}
  config = {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [3, 0, 2]}}
  again = load_head(_edited(tmp_path, head, config, shuffled), target)
  assert again.cfg == _in_depth_order(head.cfg)
  for key, value in _params(head).items():
    np.testing.assert_array_equal(value, _params(again)[key], err_msg=str(key))


def test_the_files_are_the_published_layout(tmp_path):
  target, head = _shape("biased")
  save_head(head, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
  assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
  assert config["block_size"] == BLOCK and config["dflash_config"]["mask_token_id"] == MASK
  assert config["attention_bias"] and config["intermediate_size"] == 96
  assert not config["tie_word_embeddings"] and config["layer_types"] == ["full_attention"] * 2
  tensors = load_file(str(tmp_path / "model.safetensors"))
  d = TINY["d_model"]
  # [out, in]: the default feature layers of a 4-layer target are all four
  assert tensors["fc.weight"].shape == (d, 4 * d)
  assert tensors["layers.1.self_attn.k_proj.weight"].shape == (32, d)  # 2 kv heads of 16
  assert tensors["layers.1.self_attn.o_proj.bias"].shape == (d,)
  assert tensors["layers.0.mlp.gate_proj.weight"].shape == (96, d)
  assert tensors["layers.0.mlp.down_proj.weight"].shape == (d, 96)
  assert tensors["layers.0.self_attn.q_norm.weight"].shape == (16,)
  assert not any(k.startswith(("embed_tokens", "lm_head", "mask")) for k in tensors)
  # Gate and up are the fused projection's interleaved halves, taken apart.
  fused = np.asarray(head.layers[0].mlp.gate_up_proj.kernel[...])
  np.testing.assert_array_equal(tensors["layers.0.mlp.gate_proj.weight"], fused[:, 0::2].T)
  np.testing.assert_array_equal(tensors["layers.0.mlp.up_proj.weight"], fused[:, 1::2].T)
  transformers = pytest.importorskip("transformers")
  qwen3 = transformers.Qwen3Config.from_pretrained(str(tmp_path))
  assert (qwen3.head_dim, qwen3.num_key_value_heads, qwen3.attention_bias) == (16, 2, True)
  assert qwen3.dflash_config["target_layer_ids"] == [0, 1, 2, 3]


def test_a_qwen2_style_target_exports_zero_o_biases(tmp_path):
  """q/k/v biases alone: the layout's one attention_bias writes o_proj's as zeros, and
  reading takes them back as nothing (the head has no o_proj bias)."""
  target, head = _shape("qkv_biased")
  assert head.layers[0].o_proj.bias is None
  save_head(head, str(tmp_path))
  tensors = load_file(str(tmp_path / "model.safetensors"))
  assert not tensors["layers.0.self_attn.o_proj.bias"].any()
  assert tensors["layers.0.self_attn.q_proj.bias"].any()


def test_what_the_layout_cannot_hold_is_refused_naming_it(tmp_path):
  target = _target()
  learned = _head(target, mask_token_id=-1)
  with pytest.raises(ValueError, match="mask_embedding: the DFlashDraftModel layout has no tensor"):
    save_head(learned, str(tmp_path / "learned"))
  with pytest.raises(ValueError, match="mask_token_id set to a spare id"):
    save_head(heads.drafter(target, learned), str(tmp_path / "learned"))
  assert not os.path.exists(tmp_path / "learned")
  save_head(learned, str(tmp_path / "specjax"), layout="specjax")  # its own layout holds it
  again = load_head(str(tmp_path / "specjax"), target)
  np.testing.assert_array_equal(again.mask_embedding[...], learned.mask_embedding[...])

  # MLP biases: Qwen3's MLP has none. Zeros compute nothing and export; others are named.
  biased = _target(mlp_bias=True)
  zeros = make_head(
    head_config("dflash", biased.cfg, block_size=BLOCK, mask_token_id=MASK), rngs=nnx.Rngs(0)
  )
  save_head(zeros, str(tmp_path / "zeros"))
  again = load_head(str(tmp_path / "zeros"), biased)
  for key, value in _params(zeros).items():
    np.testing.assert_array_equal(value, _params(again)[key], err_msg=str(key))
  with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.bias: the DFlashDraftModel"):
    save_head(_head(biased), str(tmp_path / "mlp_bias"))
  assert not os.path.exists(tmp_path / "mlp_bias")

  # Layers Qwen3's do not compute.
  for overrides, named in [
    (dict(norm="layernorm"), "norm='layernorm'"),
    (dict(norm_offset=1.0), "norm_offset=1.0"),
    (dict(mlp="geglu"), "mlp='geglu'"),
    (dict(mlp="gelu"), "mlp='gelu'"),
    (dict(attn_scale=0.3), "attn_scale=0.3"),
  ]:
    with pytest.raises(ValueError, match=f"layers are Qwen3's; this head's target has {named}"):
      save_head(_head(_target(**overrides)), str(tmp_path / "other"))
  assert not os.path.exists(tmp_path / "other")


def _edited(tmp_path, head, config=None, tensors=None) -> str:
  """`head` exported to a fresh directory with `config` fields and `tensors` changed
  (a tensor None: removed)."""
  directory = tmp_path / f"edited{len(os.listdir(tmp_path))}"
  save_head(head, str(directory))
  with open(directory / "config.json") as f:
    written = json.load(f)
  with open(directory / "config.json", "w") as f:
    json.dump({**written, **(config or {})}, f)
  file = str(directory / "model.safetensors")
  edited = {**load_file(file), **(tensors or {})}
  save_file({k: v for k, v in edited.items() if v is not None}, file)
  return str(directory)


def test_files_that_do_not_fit_the_target_are_refused_naming_the_field_or_tensor(tmp_path):
  target, head = _shape("plain")
  d = TINY["d_model"]
  ids = {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
  cases = [
    (dict(hidden_size=32), None, "config hidden_size is 32; the target needs 64"),
    (dict(vocab_size=1000), None, "config vocab_size is 1000; the target needs 512"),
    (dict(num_target_layers=36), None, "config num_target_layers is 36; the target needs 4"),
    (dict(num_key_value_heads=4), None, "config num_key_value_heads is 4; the target needs 2"),
    (dict(rms_norm_eps=1e-6), None, "config rms_norm_eps is 1e-06; the target needs 1e-05"),
    (dict(rope_theta=1e6), None, "config rope .* is not the target's"),
    (dict(architectures=["DFlash2DraftModel"]), None, r"config architectures is \['DFlash2Dr"),
    (dict(layer_types=["sliding_attention"] * 2), None, "sliding-window layers"),
    (dict(dflash_config={**ids, "target_layer_ids": [1, 4]}), None, r"ids is \[1, 4\]; this"),
    (dict(dflash_config={**ids, "target_layer_ids": [1, 1]}), None, "distinct layer ids in"),
    (dict(dflash_config={"target_layer_ids": [1, 3]}), None, "mask_token_id is None"),
    (dict(dflash_config={**ids, "mask_token_id": 512}), None, r"needs an id in \[0, 512\)"),
    (dict(dflash_config={**ids, "output_multiplier": 0.5}), None, "output_multiplier is 0.5"),
    (dict(dflash_config={**ids, "final_logit_softcapping": 20.0}), None, "softcapping is 20.0"),
    (dict(block_size=128), None, "config block_size is 128; specjax reads 2 to 64"),
    (dict(num_hidden_layers=3), None, "tensor layers.2.self_attn.q_proj.weight is missing"),
    (None, {"layers.1.self_attn.k_norm.weight": None}, "tensor layers.1.self_attn.k_norm.weig"),
    (None, {"extra": np.zeros(1, np.float32)}, r"tensors \['extra'\] are not part"),
    (None, {"fc.weight": np.zeros((d, 3 * d), np.float32)}, "tensor fc.weight has shape"),
    (  # a bias the target's layers lack, not zero: the head could not hold it
      None,
      {"layers.0.self_attn.o_proj.bias": np.ones(d, np.float32)},
      r"o_proj\.bias is not zero, and this target's layers have no such bias",
    ),
  ]
  for config, tensors, message in cases:
    path = _edited(tmp_path, head, config, tensors)
    with pytest.raises(ValueError, match=message):
      load_head(path, target)
  # A zero bias the target lacks computes nothing: read as nothing.
  path = _edited(tmp_path, head, None, {"layers.0.self_attn.o_proj.bias": np.zeros(d, np.float32)})
  assert load_head(path, target).layers[0].o_proj.bias is None
  # The file fits; these targets do not.
  path = _edited(tmp_path, head)
  with pytest.raises(ValueError, match=r"\(model\.safetensors\): config num_target_layers is 4"):
    load_head(path, specjax.Transformer(target.cfg.replace(n_layers=3), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="this target's layers have mlp='geglu'"):
    load_head(path, _target(mlp="geglu"))
  # Absent target_layer_ids: the first reference's rule (its build_target_layer_ids),
  # the middle layer for one drafter layer; ids 1, 1 for two on 4 layers: refused.
  ids = {"mask_token_id": MASK}
  with pytest.raises(ValueError, match=r"the reference's rule gives \[1, 1\] for 2 layers"):
    load_head(_edited(tmp_path, head, dict(dflash_config=ids)), target)
  one = _head(target, draft_layers=1, feature_layers=(3,))
  again = load_head(_edited(tmp_path, one, dict(dflash_config=ids)), target)
  assert again.cfg == one.cfg  # id 4 // 2 = 2: the stream after 3 layers

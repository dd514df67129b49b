"""Draft heads in the hub's layouts (`specjax.hf.load_head`, `load_drafter`, `save_head`).

Fixtures are written here in each layout from its loader's key names and shapes
(random weights, no network): the EAGLE repository's EAGLE-1 head (cnets1.py:
fc over cat(embed, normed feature), layer 0 without input_layernorm), Medusa's
medusa_lm_head ({i}.{j}.linear, {i}.{L}), vLLM's Medusa (blocks.{i}.layers.{j},
lm_heads.{i}) and the EAGLE-3 layout (LlamaForCausalLMEagle3). Each imported head
computes what a small torch/numpy re-implementation of the published forward
computes, greedy speculative decoding equals autoregressive decoding, export then
import gives identical tensors and drafts, and bad layouts are refused naming the
file and the tensor or field.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

import specjax
from helpers import TINY, hub_cache
from specjax import GREEDY
from specjax.heads import config as head_config
from specjax.heads import make_head
from specjax.hf import load_drafter, load_head, save_head

MAX_NEW = 16
D_FF = 96  # the heads' own MLP width (not the target's)


@pytest.fixture(scope="module")
def target():
  """TINY (untied head) with a final norm that is not the identity, so a head that
  skipped or misplaced it would compute something else."""
  model = specjax.Transformer(specjax.ModelConfig(**TINY), rngs=nnx.Rngs(3))
  scale = 1 + 0.3 * jax.random.normal(jax.random.key(5), (TINY["d_model"],))
  model.final_norm.scale[...] = scale
  return model


@pytest.fixture(scope="module")
def reference(target, prompts):
  return specjax.autoregressive_generate(target, *prompts, max_new_tokens=MAX_NEW, sampling=GREEDY)


def _w(rng, *shape, scale=0.1):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def eagle1_layout(t, seed=0, bias=True) -> tuple[dict, dict]:
  """(config.json, tensors) of an EAGLE-1 head as the EAGLE repository saves it."""
  rng, d, h = np.random.default_rng(seed), t.d_model, t.resolved_head_dim
  tensors = {
    "fc.weight": _w(rng, d, 2 * d),
    "layers.0.self_attn.q_proj.weight": _w(rng, t.n_heads * h, d),
    "layers.0.self_attn.k_proj.weight": _w(rng, t.n_kv_heads * h, d),
    "layers.0.self_attn.v_proj.weight": _w(rng, t.n_kv_heads * h, d),
    "layers.0.self_attn.o_proj.weight": _w(rng, d, t.n_heads * h),
    "layers.0.post_attention_layernorm.weight": 1 + _w(rng, d),
    "layers.0.mlp.gate_proj.weight": _w(rng, D_FF, d),
    "layers.0.mlp.up_proj.weight": _w(rng, D_FF, d),
    "layers.0.mlp.down_proj.weight": _w(rng, d, D_FF),
  }
  if bias:
    tensors["fc.bias"] = _w(rng, d)
  config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "bias": bias,
    "hidden_act": "silu",
    "hidden_size": d,
    "intermediate_size": D_FF,
    "num_attention_heads": t.n_heads,
    "num_key_value_heads": t.n_kv_heads,
    "num_hidden_layers": 1,
    "rms_norm_eps": t.norm_eps,
    "rope_theta": t.rope_theta,
    "max_position_embeddings": t.max_seq_len,
    "vocab_size": t.vocab_size,
    "tie_word_embeddings": False,
  }
  return config, tensors


def medusa_layout(t, heads=3, layers=2, vllm=False, seed=1) -> tuple[dict, dict]:
  """(config.json, tensors) of Medusa heads as the Medusa repository (medusa_lm_head)
  or vLLM (MedusaModel) saves them."""
  rng, d, v = np.random.default_rng(seed), t.d_model, t.vocab_size
  tensors = {}
  for i in range(heads):
    for j in range(layers):
      name = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
      tensors[name + "weight"], tensors[name + "bias"] = _w(rng, d, d), _w(rng, d)
    tensors[f"lm_heads.{i}.weight" if vllm else f"{i}.{layers}.weight"] = _w(rng, v, d, scale=0.3)
  if vllm:
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": d}
    config |= {"vocab_size": v, "num_heads": heads, "num_hidden_layers": layers}
    config["medusa_fc_bias"] = True
  else:
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "version": "2"}
    config["base_model_name_or_path"] = "org/target"
  return config, tensors


def write(directory, config, tensors, file="model.safetensors") -> str:
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  path = os.path.join(directory, file)
  if file.endswith(".safetensors"):
    save_file(tensors, path)
  else:  # a torch pickle, as pytorch_model.bin and medusa_lm_head.pt are
    torch.save({k: torch.tensor(v) for k, v in tensors.items()}, path)
  return str(directory)


def _rms(x, g, eps):
  return g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _t(x):
  return torch.tensor(np.asarray(x, np.float32))


def eagle1_reference(target, tensors, features, tokens) -> np.ndarray:
  """cnets1.py's forward over T positions from the start, in torch: logits `[T, V]`
  of the head's predictions from the target's pre-norm `features [T, D]` and the
  next `tokens [T]`, drafted through the target's lm_head with no norm."""
  c, w = target.cfg, {k: _t(v) for k, v in tensors.items()}
  hidden = _rms(_t(features), _t(target.final_norm.scale[...]), c.norm_eps)  # outputs[0]
  emb = _t(target.embed.embedding[...])[torch.tensor(np.asarray(tokens))]
  x = torch.cat([emb, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
  t, h, hd = x.shape[0], c.n_heads, c.resolved_head_dim
  q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(t, h, hd).transpose(0, 1)
  k, v = (
    (x @ w[f"layers.0.self_attn.{n}_proj.weight"].T).view(t, c.n_kv_heads, hd).transpose(0, 1)
    for n in "kv"
  )
  k, v = (a.repeat_interleave(h // c.n_kv_heads, 0) for a in (k, v))
  inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
  angles = torch.arange(t).float()[:, None] * inv
  cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

  def rope(a):
    half = torch.cat([-a[..., hd // 2 :], a[..., : hd // 2]], -1)
    return a * cos + half * sin

  scores = rope(q) @ rope(k).transpose(1, 2) / hd**0.5
  scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -torch.inf)
  attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, h * hd)
  x = x + attn @ w["layers.0.self_attn.o_proj.weight"].T  # no input_layernorm in layer 0
  y = _rms(x, w["layers.0.post_attention_layernorm.weight"], c.norm_eps)
  gate, up = (y @ w[f"layers.0.mlp.{n}_proj.weight"].T for n in ("gate", "up"))
  x = x + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
  return (x @ _t(target.lm_head[...])).numpy()


def medusa_reference(target, tensors, features, heads, layers, vllm) -> np.ndarray:
  """medusa_model.py's heads on the target's normed features: logits `[T, K, V]`."""
  x = _rms(_t(features), _t(target.final_norm.scale[...]), target.cfg.norm_eps)
  out = []
  for i in range(heads):
    y = x
    for j in range(layers):
      name = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
      y = y + torch.nn.functional.silu(
        y @ _t(tensors[name + "weight"]).T + _t(tensors[name + "bias"])
      )
    lm_head = tensors[f"lm_heads.{i}.weight" if vllm else f"{i}.{layers}.weight"]
    out.append(y @ _t(lm_head).T)
  return torch.stack(out, 1).numpy()


def _features(target, t=7, seed=2):
  return np.asarray(jax.random.normal(jax.random.key(seed), (t, target.cfg.d_model)))


def _params(module) -> dict:
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def _assert_decodes_exactly(target, drafter, prompts, reference, gamma=3):
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=gamma, max_new_tokens=MAX_NEW, sampling=GREEDY
  )
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)
  assert np.sum(out.stats.proposed) > 0
  return out


@pytest.mark.parametrize("file, bias", [("model.safetensors", True), ("pytorch_model.bin", False)])
def test_eagle1_computes_the_published_forward_and_decodes_exactly(
  target, prompts, reference, tmp_path, file, bias
):
  config, tensors = eagle1_layout(target.cfg, bias=bias)
  tensors["embed_tokens.weight"] = np.asarray(target.embed.embedding[...])  # as some files hold
  path = write(tmp_path / "eagle", config, tensors, file)
  drafter = load_drafter(path, target)
  head = drafter.head
  assert head.cfg.normed_features and head.cfg.embed_first and not head.cfg.input_norm
  features, tokens = _features(target), np.arange(7) * 31 % target.cfg.vocab_size
  predicted = head(
    target, head.feature_space(jnp.asarray(features)[None]), jnp.asarray(tokens)[None]
  )
  want = eagle1_reference(target, tensors, features, tokens)
  np.testing.assert_allclose(head.logits(predicted)[0], want, atol=2e-4, rtol=1e-4)
  _assert_decodes_exactly(target, drafter, prompts, reference)


@pytest.mark.parametrize(
  "vllm, layers, file",
  [(False, 2, "medusa_lm_head.safetensors"), (False, 1, "medusa_lm_head.pt"), (True, 2, None)],
)
def test_medusa_computes_the_published_heads_and_decodes_exactly(
  target, prompts, reference, tmp_path, vllm, layers, file
):
  config, tensors = medusa_layout(target.cfg, heads=3, layers=layers, vllm=vllm)
  path = write(tmp_path / "medusa", config, tensors, file or "model.safetensors")
  drafter = load_drafter(path, target)
  heads = drafter.heads
  assert (heads.cfg.num_heads, heads.cfg.medusa_layers) == (3, layers)
  features = _features(target)
  got = heads.logits(heads(jnp.asarray(features)))
  want = medusa_reference(target, tensors, features, 3, layers, vllm)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
  _assert_decodes_exactly(target, drafter, prompts, reference)


def _roundtrip(head, target, tmp_path, layout="hub"):
  save_head(head, str(tmp_path / "exported"), layout=layout)
  again = load_head(str(tmp_path / "exported"), target)
  mine, theirs = _params(head), _params(again)
  assert mine.keys() == theirs.keys()
  for key in mine:
    np.testing.assert_array_equal(mine[key], theirs[key], err_msg=str(key))
  return again


def _draft(target, head, prompts):
  """One draft from the prompts' state: the proposed tokens `[B, gamma]`."""
  from specjax import heads

  config = specjax.SpecConfig(gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY)
  drafter = heads.drafter(target, head)
  state = specjax.generation.init_state(target, drafter, *prompts, jax.random.key(0), config)
  limit = jnp.full((prompts[0].shape[0],), 3, jnp.int32)
  proposal, _ = drafter.propose(
    state.drafter_state, state.recent, jax.random.key(1), limit, gamma=3, sampling=GREEDY
  )
  return np.asarray(proposal.tokens)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_export_then_import_gives_identical_tensors_and_drafts(target, prompts, tmp_path, kind):
  if kind == "eagle":
    path = write(tmp_path / "hub", *eagle1_layout(target.cfg))
  else:
    path = write(tmp_path / "hub", *medusa_layout(target.cfg), "medusa_lm_head.safetensors")
  head = load_head(path, target)
  again = _roundtrip(head, target, tmp_path)
  np.testing.assert_array_equal(_draft(target, head, prompts), _draft(target, again, prompts))


def test_eagle3_exports_as_engines_load_it_and_imports_identically(prompts, tmp_path):
  """EAGLE-3 reads three layers: a 3-layer target (`specjax.heads.eagle3`: `hub_config`,
  `hub_tensors` and `from_hub` do the layout; this checks the files, the round trip and
  decoding)."""
  target = specjax.Transformer(specjax.ModelConfig(**{**TINY, "n_layers": 3}), rngs=nnx.Rngs(6))
  cfg = head_config("eagle3", target.cfg, feature_layers=(1, 2, 3), d_ff=D_FF)
  head = make_head(cfg, rngs=nnx.Rngs(4))
  again = _roundtrip(head, target, tmp_path)
  np.testing.assert_array_equal(_draft(target, head, prompts), _draft(target, again, prompts))
  with open(tmp_path / "exported" / "config.json") as f:
    assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
  reference = specjax.autoregressive_generate(
    target, *prompts, max_new_tokens=MAX_NEW, sampling=GREEDY
  )
  _assert_decodes_exactly(
    target, load_drafter(str(tmp_path / "exported"), target), prompts, reference
  )


def test_specjax_heads_save_in_their_own_layout_and_refuse_the_hub_one(target, tmp_path):
  head = make_head(head_config("eagle", target.cfg), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no hub layout computes this eagle head exactly"):
    save_head(head, str(tmp_path / "hub"))
  assert not os.path.exists(tmp_path / "hub")
  _roundtrip(head, target, tmp_path, layout="specjax")
  with pytest.raises(ValueError, match="layout must be 'hub' or 'specjax'"):
    save_head(head, str(tmp_path / "x"), layout="vllm")


def _perturbed(head, seed, biases=True):
  """`head` with every parameter moved off its initial value (biases too unless
  `biases` is False), so a saver that skipped one would be caught."""
  graphdef, state = nnx.split(head)
  flat = nnx.to_flat_state(state)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  moved = []
  for k, (path, v) in zip(keys, flat):
    x = v.get_value()
    if jnp.issubdtype(x.dtype, jnp.floating) and (biases or path[-1] != "bias"):
      x = x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
    moved.append((path, v.replace(x)))
  return nnx.merge(graphdef, nnx.from_flat_state(moved))


@pytest.mark.parametrize(
  "kind, layout",
  [
    ("eagle", "specjax"),
    ("medusa", "specjax"),
    ("early_exit", "specjax"),
    ("eagle3", "hub"),
    ("eagle", "hub"),
    ("medusa", "hub"),
  ],
)
def test_save_head_takes_what_either_loader_returns(prompts, tmp_path, kind, layout):
  """`save_head` takes `load_head`'s module or `load_drafter`'s drafter: both write the
  same bytes, and what they wrote drafts the same tokens as the head saved first."""
  from specjax import heads

  target = specjax.Transformer(specjax.ModelConfig(**{**TINY, "n_layers": 3}), rngs=nnx.Rngs(6))
  hub = dict(normed_features=True, embed_first=True, input_norm=False)
  hub = {} if layout == "specjax" or kind == "eagle3" else hub
  hub = {k: v for k, v in hub.items() if kind == "eagle" or k == "normed_features"}
  fields = dict(feature_layers=(1, 2, 3), d_ff=D_FF) if kind == "eagle3" else {}
  cfg = head_config(kind, target.cfg, **fields, **hub)
  head = _perturbed(make_head(cfg, rngs=nnx.Rngs(4)), 7, biases=layout == "specjax")
  if hub:  # a hub head's copies of the target's final norm and head are the target's
    head = load_head(_saved(head, tmp_path / "first", layout), target)
  first = _saved(head, tmp_path / "first", layout)
  module, drafter = load_head(first, target), load_drafter(first, target)
  assert heads.module_of(drafter) is not None and not hasattr(module, "target")
  from_module = _saved(module, tmp_path / "module", layout)
  from_drafter = _saved(drafter, tmp_path / "drafter", layout)
  for name in sorted(os.listdir(from_module)):
    with (
      open(os.path.join(from_module, name), "rb") as a,
      open(os.path.join(from_drafter, name), "rb") as b,
    ):
      assert a.read() == b.read(), name
  again = heads.module_of(load_drafter(from_drafter, target))
  np.testing.assert_array_equal(_draft(target, head, prompts), _draft(target, again, prompts))
  with pytest.raises(TypeError, match="a head module or a head's drafter, got Transformer"):
    save_head(target, str(tmp_path / "x"))


def _saved(head, directory, layout) -> str:
  save_head(head, str(directory), layout=layout)
  return str(directory)


# Target shapes a head is exported for: plain Llama blocks, blocks with every bias
# (attention_bias, mlp_bias), q/k/v biases alone, and a tied embedding / lm_head.
SHAPES = {
  "plain": {},
  "biased": dict(qkv_bias=True, out_bias=True, mlp_bias=True),
  "qkv_biased": dict(qkv_bias=True),  # Qwen2's blocks
  "tied": dict(tie_embeddings=True),
}
EXPORTS = [("eagle3", "hub"), ("eagle", "hub"), ("medusa", "hub")]
EXPORTS += [(k, "specjax") for k in ("eagle", "medusa", "early_exit", "eagle3")]


# Q/K/V biases alone: EAGLE-3's layout (attention_bias, o's zero); a Llama config
# (EAGLE-1's, Medusa's base) cannot say it, and save_model refuses it.
CASES = [(s, k, lay) for s in SHAPES for k, lay in EXPORTS if s != "qkv_biased" or k == "eagle3"]


# The plain target's cases: the slow tier (the biased and tied ones take every tensor it has).
@pytest.mark.sample(*("-".join(case) for case in CASES if case[0] != "plain"))
@pytest.mark.parametrize("shape, kind, layout", CASES)
def test_export_then_import_computes_the_same_or_names_the_tensor(
  prompts, tmp_path, shape, kind, layout
):
  """Every parameter, biases included, survives export then import (identical tensors
  and drafts), or `save_head` refuses naming the tensor its layout cannot hold (a
  hub drafter whose copies of its target's final norm and head are not the target's)."""
  config = specjax.ModelConfig(**{**TINY, "n_layers": 3, **SHAPES[shape]})
  target = specjax.Transformer(config, rngs=nnx.Rngs(6))
  hub = {"eagle": dict(normed_features=True, embed_first=True, input_norm=False)}
  hub = hub.get(kind, dict(normed_features=True)) if layout == "hub" and kind != "eagle3" else {}
  fields = dict(feature_layers=(1, 2, 3), d_ff=D_FF) if kind == "eagle3" else {}
  head = _perturbed(make_head(head_config(kind, target.cfg, **fields, **hub), rngs=nnx.Rngs(4)), 8)
  if hub:  # as read from the hub: its copies of the target's final norm and head
    head = load_head(_saved(head, tmp_path / "read", layout), target)
  again = _roundtrip(head, target, tmp_path, layout)
  np.testing.assert_array_equal(_draft(target, head, prompts), _draft(target, again, prompts))
  if hub:  # a drafter whose head's copies are not its target's: named, not dropped
    head.feature_norm.scale[...] = head.feature_norm.scale[...] + 0.5
    with pytest.raises(ValueError, match="feature_norm.scale: the .* layout takes it from"):
      save_head(specjax.heads.drafter(target, head), str(tmp_path / "copies"))


def test_a_cached_repo_id_loads_offline(target, tmp_path, monkeypatch):
  from huggingface_hub import constants

  source = write(tmp_path / "eagle", *eagle1_layout(target.cfg))
  monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache(tmp_path / "hub", "org/eagle", source))
  mine, local = (
    _params(load_head("org/eagle", target)),
    _params(load_head(source, target)),
  )
  assert all(np.array_equal(mine[k], local[k]) for k in local)


def _bad_eagle(t, change):
  config, tensors = eagle1_layout(t)
  change(config, tensors)
  return config, tensors


@pytest.mark.parametrize(
  "change, message",
  [
    (
      lambda c, w: w.pop("layers.0.mlp.up_proj.weight"),
      r"tensor layers.0.mlp.up_proj.weight is missing",
    ),
    (
      lambda c, w: w.update({"fc.weight": w["fc.weight"][:, :10]}),
      r"tensor fc.weight has shape \(64, 10\); this target needs \(64, 128\)",
    ),
    (
      lambda c, w: w.update({"layers.0.input_layernorm.weight": np.ones(64, np.float32)}),
      r"tensors \['layers.0.input_layernorm.weight'\] are not part of the layout",
    ),
    (
      lambda c, w: c.update(hidden_size=128),
      r"config.json hidden_size is 128; the target needs 64",
    ),
    (
      lambda c, w: c.update(num_key_value_heads=4),
      r"config.json num_key_value_heads is 4; the target needs 2",
    ),
    (
      lambda c, w: c.update(rope_theta=5e5),
      r"config.json rope_theta is 500000.0; the target needs 10000.0",
    ),
    (
      lambda c, w: w.update({"embed_tokens.weight": np.zeros((512, 64), np.float32)}),
      r"tensor embed_tokens.weight is not the target's embedding",
    ),
  ],
)
def test_bad_eagle1_layouts_are_refused_naming_the_file_and_tensor_or_field(
  target, tmp_path, change, message
):
  path = write(tmp_path / "bad", *_bad_eagle(target.cfg, change))
  with pytest.raises(ValueError, match=rf"{tmp_path}/bad \(model.safetensors\): {message}"):
    load_drafter(path, target)


def test_bad_medusa_layouts_and_other_targets_are_refused(target, tmp_path):
  config, tensors = medusa_layout(target.cfg, vllm=True)
  with pytest.raises(ValueError, match=r"truncated_vocab_size is 100; the target needs 512"):
    load_drafter(write(tmp_path / "trunc", config | {"truncated_vocab_size": 100}, tensors), target)
  config, tensors = medusa_layout(target.cfg, layers=1)
  tensors["0.1.weight"] = tensors["0.1.weight"][:100]
  with pytest.raises(
    ValueError, match=r"medusa_lm_head.safetensors\): tensor 0.1.weight has shape"
  ):
    load_drafter(write(tmp_path / "short", config, tensors, "medusa_lm_head.safetensors"), target)
  # A specjax head for another target shape: the field that differs is named.
  other = specjax.ModelConfig(**{**TINY, "d_ff": 64})
  head = make_head(head_config("medusa", other), rngs=nnx.Rngs(0))
  save_head(head, str(tmp_path / "other"), layout="specjax")
  with pytest.raises(ValueError, match=r"d_ff 128 \(head trained for 64\)"):
    load_drafter(str(tmp_path / "other"), target)
  write(tmp_path / "none", {"model_type": "llama"}, {"x.weight": np.ones(2, np.float32)})
  with pytest.raises(ValueError, match=r"not a head layout specjax reads"):
    load_drafter(str(tmp_path / "none"), target)
  with pytest.raises(FileNotFoundError, match="neither head_config.json"):
    load_drafter(str(tmp_path), target)


def test_a_training_run_and_its_export_load_by_path(target, prompts, tmp_path):
  from specjax.training.checkpoint import Checkpointer, save_head_config

  cfg = head_config("medusa", target.cfg, num_heads=3)
  graphdef, params = nnx.split(make_head(cfg, rngs=nnx.Rngs(2)), nnx.Param)
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), params)
  run = str(tmp_path / "run")
  save_head_config(run, cfg)
  saver = Checkpointer(run, save_every=1, keep=1)
  saver.save(2, params, {"count": jnp.zeros(())}, {"step": 2})
  saver.close()
  head = nnx.merge(graphdef, params)
  loaded = load_drafter(run, target)
  assert _params(loaded.heads).keys() == _params(head).keys()
  assert all(np.array_equal(_params(loaded.heads)[k], v) for k, v in _params(head).items())
  exported = _roundtrip(loaded.heads, target, tmp_path, layout="specjax")
  np.testing.assert_array_equal(_draft(target, head, prompts), _draft(target, exported, prompts))
  bf16 = load_head(run, target, jnp.bfloat16)
  assert all(v.dtype == jnp.bfloat16 for v in _params(bf16).values())

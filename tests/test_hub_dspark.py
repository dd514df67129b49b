"""The sequential block drafter's hub layout (`specjax.heads.dspark`: DeepSpec's
`Qwen3DSparkModel`, issue 64 requirement 5).

A fixture checkpoint written by a small torch implementation of the published forward
pass (DFlash's block, test_hub_dflash's torch reading, plus the Markov bias chained over
the block from the anchor and the confidence sigmoid), in DeepSpec's flat config and with
the reference's copies of the target's embedding and head, gives through
`specjax.hf.load_drafter` the greedy drafts and confidences torch computes; export then
import gives identical parameters and drafts for each head variant; what does not fit or
is not computed is refused naming the field or tensor; a DSpark checkpoint is never read
as a plain DFlash head.
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
from test_hub_dflash import MASK, _features, _perturbed, _target, _torch_target, torch_dflash

import specjax
from helpers import TINY
from specjax import heads
from specjax.heads import config as head_config
from specjax.heads import dflash, dspark, make_head
from specjax.heads.dspark import DSparkDrafter, DSparkHead
from specjax.hf import load_drafter, load_head, save_head

BLOCK, RANK = 4, 8
GREEDY = specjax.SamplingParams(temperature=0.0)
# Head variants exported: both heads, no confidence head, a confidence head on h alone,
# no Markov head (markov_rank 0), and three drafter layers reading features out of order.
VARIANTS = {
  "both": {},
  "no_confidence": dict(confidence_head=False),
  "confidence_alone": dict(confidence_with_markov=False),
  "no_markov": dict(markov_rank=0),
  "three_layers": dict(draft_layers=3, feature_layers=(3, 1, 4)),
  "block_drafter_alignment": dict(anchor_first=False),
}


def _head(target, **fields) -> DSparkHead:
  settings = dict(block_size=BLOCK, draft_layers=2, mask_token_id=MASK, d_ff=96, markov_rank=RANK)
  settings["anchor_first"] = True  # the published checkpoints' alignment
  cfg = head_config("dspark", target.cfg, **(settings | fields))
  return _perturbed(make_head(cfg, rngs=nnx.Rngs(4)))


def _params(module) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def _drafts(drafter, target, tokens, last):
  """Greedy proposal of a whole block after `last [B]` (B - 1 tokens, or B anchor-first),
  the context `tokens [B, T]`: (tokens, confidences) as NumPy arrays."""
  b, t = tokens.shape
  hidden = _features(target, tokens, drafter.target_features)
  state = drafter.init(tokens, jnp.full((b,), t, jnp.int32), last, t + BLOCK + 1, hidden=hidden)
  gamma = drafter.head.drafts_per_call
  proposal, _ = drafter.propose(
    state, last[:, None], jax.random.key(0), jnp.full((b,), gamma), gamma=gamma, sampling=GREEDY
  )
  return np.asarray(proposal.tokens), np.asarray(proposal.confidence)


def _inputs():
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, TINY["vocab_size"], jnp.int32)
  return tokens, jnp.array([7, 300], jnp.int32)


@pytest.mark.sample("both", "no_markov", "block_drafter_alignment")  # the rest: slow tier
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_then_import_is_identical(tmp_path, variant):
  target = _target()
  head = _head(target, **VARIANTS[variant])
  save_head(head, str(tmp_path / "hub"))
  again = load_head(str(tmp_path / "hub"), target)
  assert type(again) is DSparkHead
  assert again.cfg == dataclasses.replace(
    head.cfg, feature_layers=tuple(sorted(head.cfg.feature_layers))
  )
  mine, theirs = _params(head), _params(again)
  assert mine.keys() == theirs.keys()
  for key in mine:
    np.testing.assert_array_equal(mine[key], theirs[key], err_msg=str(key))
  tokens, last = _inputs()
  drafter = load_drafter(str(tmp_path / "hub"), target)
  assert isinstance(drafter, DSparkDrafter)
  want = _drafts(heads.drafter(target, head), target, tokens, last)
  for a, b in zip(want, _drafts(drafter, target, tokens, last)):
    np.testing.assert_array_equal(a, b)
  # Saving the drafter adds the target's embedding and head, as the reference's files
  # hold them; they read back (they are the target's) to the same head.
  save_head(drafter, str(tmp_path / "drafter"))
  written = load_file(str(tmp_path / "drafter" / "model.safetensors"))
  np.testing.assert_array_equal(written["embed_tokens.weight"], target.embed.embedding[...])
  np.testing.assert_array_equal(written["lm_head.weight"], np.asarray(target.lm_head[...]).T)
  for key, value in _params(load_head(str(tmp_path / "drafter"), target)).items():
    np.testing.assert_array_equal(mine[key], value, err_msg=str(key))


def test_the_files_are_the_published_layout(tmp_path):
  target = _target()
  head = _head(target)
  save_head(head, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
  own = dict(markov_rank=RANK, markov_head_type="vanilla", enable_confidence_head=True)
  own |= dict(confidence_head_with_markov=True, mask_token_id=MASK, block_size=BLOCK)
  own["target_layer_ids"] = [c - 1 for c in head.cfg.feature_layers]
  for key, value in own.items():  # at the top level (DeepSpec's) and in dspark_config
    assert config[key] == value and config["dspark_config"][key] == value, key
  assert config["dflash_config"]["mask_token_id"] == MASK  # DFlash's own, as dflash writes
  tensors = load_file(str(tmp_path / "model.safetensors"))
  v, d = TINY["vocab_size"], TINY["d_model"]
  assert tensors["markov_head.markov_w1.weight"].shape == (v, RANK)
  assert tensors["markov_head.markov_w2.weight"].shape == (v, RANK)  # torch Linear r -> V
  np.testing.assert_array_equal(tensors["markov_head.markov_w2.weight"], head.markov_w2[...].T)
  proj = tensors["confidence_head.proj.weight"]
  assert proj.shape == (1, d + RANK) and tensors["confidence_head.proj.bias"].shape == (1,)
  np.testing.assert_array_equal(proj[0, :d], head.confidence_hidden.kernel[...][:, 0])
  np.testing.assert_array_equal(proj[0, d:], head.confidence_markov.kernel[...][:, 0])
  assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)  # no target here
  assert "fc.weight" in tensors and "layers.1.mlp.down_proj.weight" in tensors
  # No Markov head: no Markov tensors, markov_rank 0; the confidence head reads h alone.
  save_head(_head(target, markov_rank=0), str(tmp_path / "bare"))
  with open(tmp_path / "bare" / "config.json") as f:
    config = json.load(f)
  assert config["markov_rank"] == 0 and not config["confidence_head_with_markov"]
  tensors = load_file(str(tmp_path / "bare" / "model.safetensors"))
  assert not any(k.startswith("markov_head.") for k in tensors)
  assert tensors["confidence_head.proj.weight"].shape == (1, d)


# ---------------------------------------------------------------------------------------
# A checkpoint written by a torch implementation of the published forward pass.


def _torch_checkpoint(torch, target, ids, layers=2, d_ff=96, seed=0):
  """A DSpark checkpoint's config (DeepSpec's flat fields) and random tensors, named as
  the published files name them, with the reference's copies of the target's
  embedding and head."""
  c = target.cfg
  d, h, v = c.d_model, c.resolved_head_dim, c.vocab_size
  config = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": d,
    "intermediate_size": d_ff,
    "num_hidden_layers": layers,
    "num_attention_heads": c.n_heads,
    "num_key_value_heads": c.n_kv_heads,
    "head_dim": h,
    "hidden_act": "silu",
    "rms_norm_eps": c.norm_eps,
    "rope_theta": c.rope_theta,
    "rope_scaling": None,
    "vocab_size": v,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_target_layers": c.n_layers,
    "block_size": BLOCK,
    "mask_token_id": MASK,
    "target_layer_ids": ids,
    "num_anchors": 512,
    "markov_rank": RANK,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
  }
  g = torch.Generator().manual_seed(seed)

  def rand(*shape, scale=0.1, mean=0.0):
    return mean + scale * torch.randn(*shape, generator=g)

  nq, nkv = c.n_heads * h, c.n_kv_heads * h
  state = {"fc.weight": rand(d, len(ids) * d), "hidden_norm.weight": rand(d, mean=1.0)}
  state["norm.weight"] = rand(d, mean=1.0)
  for i in range(layers):
    at = f"layers.{i}."
    shapes = {
      "self_attn.q_proj.weight": (nq, d),
      "self_attn.k_proj.weight": (nkv, d),
      "self_attn.v_proj.weight": (nkv, d),
      "self_attn.o_proj.weight": (d, nq),
      "mlp.gate_proj.weight": (d_ff, d),
      "mlp.up_proj.weight": (d_ff, d),
      "mlp.down_proj.weight": (d, d_ff),
    }
    state |= {at + k: rand(*s) for k, s in shapes.items()}
    for norm, width in [("self_attn.q_norm", h), ("self_attn.k_norm", h)]:
      state[f"{at}{norm}.weight"] = rand(width, mean=1.0)
    for norm in ("input_layernorm", "post_attention_layernorm"):
      state[f"{at}{norm}.weight"] = rand(d, mean=1.0)
  state["markov_head.markov_w1.weight"] = rand(v, RANK, scale=1.0)  # nn.Embedding(V, r)
  state["markov_head.markov_w2.weight"] = rand(v, RANK, scale=2.0)  # nn.Linear(r, V)
  state["confidence_head.proj.weight"] = rand(1, d + RANK, scale=0.5)  # Linear(D + r, 1)
  state["confidence_head.proj.bias"] = rand(1, scale=0.5)
  head = target.embed.embedding[...] if c.tie_embeddings else np.asarray(target.lm_head[...]).T
  state["embed_tokens.weight"] = torch.from_numpy(np.array(target.embed.embedding[...]))
  state["lm_head.weight"] = torch.from_numpy(np.array(head))
  return config, state


def torch_dspark_drafts(torch, config, state, hidden, embed, last, start):
  """Greedy DSpark drafts and confidences `[B, B_size]` after `last [B]`, reading the
  context at positions 0 .. start - 1: DFlash's block forward, anchor-first (slot j, the
  anchor's too, gives the law of the token after it), then per slot logits +
  markov_w2(markov_w1[prev]) with prev the anchor, then each argmax before it, and
  sigmoid(proj(concat(h, markov_w1[prev])))."""
  ids = [[int(f)] + [config["mask_token_id"]] * (config["block_size"] - 1) for f in last]
  view = {**config, "dflash_config": {"target_layer_ids": config["target_layer_ids"]}}
  out = torch_dflash(torch, view, state, hidden, embed[torch.tensor(ids)], start)
  base = out @ state["lm_head.weight"].T
  w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
  proj, bias = state["confidence_head.proj.weight"], state["confidence_head.proj.bias"]
  prev, tokens, confidence = torch.from_numpy(np.array(last)).long(), [], []
  for i in range(base.shape[1]):
    e = w1[prev]
    logits = base[:, i] + e @ w2.T
    confidence.append(torch.sigmoid(torch.cat([out[:, i], e], -1) @ proj.T + bias)[:, 0])
    prev = logits.argmax(-1)
    tokens.append(prev)
  return torch.stack(tokens, 1).numpy(), torch.stack(confidence, 1).numpy()


@pytest.mark.parametrize("ids", [[0, 2], [3, 1]], ids=["ascending", "out_of_order"])
def test_a_torch_written_checkpoint_drafts_as_torch_computes(tmp_path, ids):
  torch = pytest.importorskip("torch")
  target = _target()
  config, state = _torch_checkpoint(torch, target, ids)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  save_file(
    {k: v.contiguous().numpy() for k, v in state.items()}, str(tmp_path / "model.safetensors")
  )
  tokens, last = _inputs()
  hidden, embed, _ = _torch_target(torch, target, tokens)
  want_tokens, want_confidence = torch_dspark_drafts(
    torch, config, state, hidden, embed, last, tokens.shape[1]
  )
  drafter = load_drafter(str(tmp_path), target)
  assert isinstance(drafter, DSparkDrafter) and drafter.head.cfg.markov_rank == RANK
  got_tokens, got_confidence = _drafts(drafter, target, tokens, last)
  np.testing.assert_array_equal(got_tokens, want_tokens)
  np.testing.assert_allclose(got_confidence, want_confidence, rtol=1e-4, atol=1e-5)
  # The Markov head matters here: without it (W2 = 0) torch drafts other tokens.
  state["markov_head.markov_w2.weight"] = torch.zeros_like(state["markov_head.markov_w2.weight"])
  plain, _ = torch_dspark_drafts(torch, config, state, hidden, embed, last, tokens.shape[1])
  assert np.any(plain != want_tokens)


# ---------------------------------------------------------------------------------------
# Refusals, and DFlash's reader leaving DSpark files alone.


def _edited(tmp_path, head, config=None, tensors=None, sections=()) -> str:
  """`head` exported to a fresh directory with `config` fields changed at the top level
  and in each of `sections`, and `tensors` changed (a tensor None: removed)."""
  directory = tmp_path / f"edited{len(os.listdir(tmp_path))}"
  save_head(head, str(directory))
  with open(directory / "config.json") as f:
    written = json.load(f)
  written |= config or {}
  for section in sections:
    written[section] = {**written[section], **(config or {})}
  with open(directory / "config.json", "w") as f:
    json.dump(written, f)
  file = str(directory / "model.safetensors")
  edited = {**load_file(file), **(tensors or {})}
  save_file({k: v for k, v in edited.items() if v is not None}, file)
  return str(directory)


def test_what_specjax_does_not_compute_is_refused_naming_the_field_or_tensor(tmp_path):
  target = _target()
  head = _head(target)
  v, d = TINY["vocab_size"], TINY["d_model"]
  both = ("dspark_config",)
  cases = [
    (dict(markov_head_type="gated"), None, both, "dspark_config.markov_head_type is 'gated'"),
    (dict(markov_head_type="rnn"), None, both, "config dspark_config.markov_head_type is 'rnn'"),
    (dict(markov_rank=-1), None, both, r"dspark_config.markov_rank is -1; specjax reads an int"),
    (dict(markov_rank=0), None, both, "markov_rank is 0, but the file holds tensor markov_head"),
    (dict(enable_confidence_head="yes"), None, both, "enable_confidence_head is 'yes'"),
    (dict(draft_vocab_size=256), None, (), "draft_vocab_size is 256; specjax's drafter"),
    (dict(architectures=["DSpark2Model"]), None, (), r"reads Qwen3DSparkModel or DSparkDraftM"),
    (
      None,
      {"markov_head.markov_w2.weight": np.zeros((v, 4), np.float32)},
      (),
      r"tensor markov_head.markov_w2.weight has shape \(512, 4\); this target needs \(512, 8\)",
    ),
    (None, {"markov_head.markov_w1.weight": None}, (), "tensor markov_head.markov_w1.weight is m"),
    (
      None,
      {"confidence_head.proj.weight": np.zeros((1, d), np.float32)},
      (),
      r"tensor confidence_head.proj.weight has shape \(1, 64\); this target needs \(1, 72\)",
    ),
    (
      dict(confidence_head_with_markov=False),
      None,
      both,
      r"proj.weight has shape \(1, 72\); this target needs \(1, 64\)",
    ),
    (
      None,
      {"lm_head.weight": np.ones((v, d), np.float32)},
      (),
      "tensor lm_head.weight is not this target's",
    ),
    (dict(enable_confidence_head=False), None, both, r"tensors \['confidence_head.proj.bias'"),
  ]
  for config, tensors, sections, message in cases:
    path = _edited(tmp_path, head, config, tensors, sections)
    with pytest.raises(ValueError, match=message):
      load_head(path, target)
  # The message names where the field was found: dspark_config before the top level.
  path = _edited(tmp_path, head, dict(markov_head_type="gated"), None, both)
  with pytest.raises(ValueError, match=r"\(model\.safetensors\): config dspark_config\.markov"):
    load_head(path, target)
  # A bias-less proj (DeepSeek-V4's) reads as a zero bias.
  again = load_head(_edited(tmp_path, head, None, {"confidence_head.proj.bias": None}), target)
  assert not np.any(again.confidence_bias[...])


def test_fields_are_read_from_dspark_config_then_dflash_config_then_the_top_level(tmp_path):
  target = _target()
  head = _head(target)
  directory = tmp_path / "hub"
  save_head(head, str(directory))
  with open(directory / "config.json") as f:
    written = json.load(f)
  keys = ("mask_token_id", "target_layer_ids", "block_size", "markov_rank", "markov_head_type")
  keys += ("enable_confidence_head", "confidence_head_with_markov")
  flat = {k: v for k, v in written.items() if k not in ("dspark_config", "dflash_config")}
  nested = {k: v for k, v in flat.items() if k not in keys}
  layouts = {
    "flat": flat,  # DeepSpec's
    "dspark_config": nested | {"dspark_config": written["dspark_config"]},
    "dflash_config": nested | {"dflash_config": {k: written[k] for k in keys}},
    "DSparkDraftModel": flat | {"architectures": ["DSparkDraftModel"]},
  }
  for name, config in layouts.items():
    with open(directory / "config.json", "w") as f:
      json.dump(config, f)
    again = load_head(str(directory), target)
    assert type(again) is DSparkHead and again.cfg == head.cfg, name
  # dspark_config wins over the top level.
  config = flat | {"dspark_config": {"markov_rank": 4}}
  with open(directory / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(
    ValueError, match=r"proj.weight has shape \(1, 72\); this target needs \(1, 68"
  ):
    load_head(str(directory), target)


def test_a_dspark_checkpoint_is_never_read_as_a_block_drafter(tmp_path):
  target = _target()
  save_head(_head(target), str(tmp_path / "dspark"))
  with open(tmp_path / "dspark" / "config.json") as f:
    config = json.load(f)
  keys = load_file(str(tmp_path / "dspark" / "model.safetensors")).keys()
  assert dspark.recognises(config, "model.safetensors", keys)
  assert not dflash.recognises(config, "model.safetensors", keys)
  # Any one mark is enough: dspark_config, a DSpark architecture, or its tensors.
  plain = {k: v for k, v in config.items() if k != "dspark_config"}
  plain["architectures"] = ["DFlashDraftModel"]
  assert not dflash.recognises(plain, "model.safetensors", keys)
  assert not dflash.recognises({**plain, "dspark_config": {}}, "model.safetensors", ())
  assert not dflash.recognises({**plain, "architectures": ["Qwen3DSparkModel"]}, "x", ())
  assert dflash.recognises(plain, "model.safetensors", [k for k in keys if "_head." not in k])
  # DFlash's reader refuses the architecture; relabelled as DFlash, DSpark's reader refuses.
  with pytest.raises(ValueError, match=r"config architectures is \['Qwen3DSparkModel'\]"):
    dflash.from_hub(
      config, dict(load_file(str(tmp_path / "dspark" / "model.safetensors"))), target, jnp.float32
    )
  with open(tmp_path / "dspark" / "config.json", "w") as f:
    json.dump(plain, f)
  with pytest.raises(ValueError, match=r"config architectures is \['DFlashDraftModel'\]"):
    load_head(str(tmp_path / "dspark"), target)
  # A DFlash checkpoint stays DFlash's.
  block = make_head(
    head_config("dflash", target.cfg, block_size=BLOCK, mask_token_id=MASK), rngs=nnx.Rngs(0)
  )
  save_head(block, str(tmp_path / "dflash"))
  assert type(load_head(str(tmp_path / "dflash"), target)) is dflash.DFlashHead

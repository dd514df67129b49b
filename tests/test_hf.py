"""Hugging Face import: parity with transformers for Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 2, Gemma 3 (text and multimodal), SmolLM (Llama architecture) and GPT-2.

Checkpoints are small random models made here with transformers and written
with `save_pretrained` (no downloads). Norm weights and biases are moved away
from their init so a missing term cannot hide.
"""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file

import specjax
import specjax.hf

VOCAB, WIDTH, NEW = 256, 32, 24
SMALL = dict(
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=128,
)
TINY = dict(
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
  max_position_embeddings=128,
)
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
}


GEMMA = dict(
  sliding_window=8,
  query_pre_attn_scalar=24,
  attn_logit_softcapping=5.0,
  final_logit_softcapping=3.0,
)
GEMMA3_ROPE = {
  "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
}


def hf_model(arch: str, size: dict, seed: int):
  torch.manual_seed(seed)
  if arch.startswith("gemma"):  # head_dim is its own key (default 256)
    size = dict(size, head_dim=size["hidden_size"] // size["num_attention_heads"])
  if arch == "llama":  # Llama 3.2 style: tied embeddings, llama3 rope scaling
    cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, **size
    )
    model = transformers.LlamaForCausalLM(cfg)
  elif arch == "mistral":  # window well below the 56 positions the tests reach
    cfg = transformers.MistralConfig(vocab_size=VOCAB, sliding_window=8, **size)
    model = transformers.MistralForCausalLM(cfg)
  elif arch == "qwen2":
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, **size)
    model = transformers.Qwen2ForCausalLM(cfg)
  elif arch == "qwen3":  # q/k norms; head_dim is its own key (default 128)
    head_dim = size["hidden_size"] // size["num_attention_heads"]
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, head_dim=head_dim, **size)
    model = transformers.Qwen3ForCausalLM(cfg)
  elif arch == "phi3":  # fused qkv and gate/up projections, a sliding window
    cfg = transformers.Phi3Config(
      vocab_size=VOCAB, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **size
    )
    model = transformers.Phi3ForCausalLM(cfg)
  elif arch == "gemma2":  # tight soft-caps so they bite; alternating 8-token windows
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, **GEMMA, **size)
    model = transformers.Gemma2ForCausalLM(cfg)
  elif arch == "gemma3":  # q/k norms, a RoPE base per layer type, linear scaling
    cfg = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE, **GEMMA, **size
    )
    model = transformers.Gemma3ForCausalLM(cfg)
  elif arch == "smollm":  # SmolLM2: the Llama architecture, tied, 3 query heads per kv head
    small = dict(size, num_attention_heads=3 * size["num_key_value_heads"])
    small["hidden_size"] = 16 * small["num_attention_heads"]
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **small)
    model = transformers.LlamaForCausalLM(cfg)
  else:
    cfg = transformers.GPT2Config(
      vocab_size=VOCAB,
      n_embd=size["hidden_size"],
      n_layer=size["num_hidden_layers"],
      n_head=size["num_attention_heads"],
      n_positions=128,
      bos_token_id=0,
      eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if param.ndim == 1:  # norm scales and biases
        param.add_(0.2 * torch.randn_like(param))
      elif arch == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
        param.mul_(30)  # scores of order 10, so the attention soft-cap bites
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model.eval()


@pytest.fixture(
  scope="module",
  params=["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm", "gpt2"],
)
def checkpoint(request, tmp_path_factory):
  """(arch, transformers target, target dir, draft dir)."""
  arch = request.param
  target = hf_model(arch, SMALL, 0)
  target_dir = str(tmp_path_factory.mktemp(f"{arch}_target"))
  target.save_pretrained(target_dir)
  draft_dir = str(tmp_path_factory.mktemp(f"{arch}_draft"))
  hf_model(arch, TINY, 1).save_pretrained(draft_dir)
  return arch, target, target_dir, draft_dir


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, VOCAB, (2, WIDTH))


def test_full_and_cached_logits_match_transformers(checkpoint, tokens):
  arch, reference, path, _ = checkpoint
  model, tokenizer = specjax.hf.load_model(path, dtype=jnp.float32)
  assert tokenizer is None  # no tokenizer.json in these directories
  with torch.no_grad():
    expected = reference(torch.tensor(tokens)).logits.numpy()
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
  assert np.max(np.abs(full - expected)) < 1e-4
  # Cached: prefill 12, then 12 single tokens, then a chunk of 8.
  forward = jax.jit(model.forward_cached)
  cache = model.init_cache(2, WIDTH)
  outs, start = [], 0
  for size in [12] + [1] * 12 + [8]:
    logits, cache = forward(jnp.asarray(tokens[:, start : start + size], jnp.int32), cache)
    outs.append(np.asarray(logits))
    start += size
  assert np.max(np.abs(np.concatenate(outs, axis=1) - expected)) < 1e-4


@pytest.mark.sample("llama", "gemma3")  # all nine: the logits test above
def test_greedy_and_speculative_match_transformers_generate(checkpoint, tokens):
  arch, reference, path, draft_path = checkpoint
  model, _ = specjax.hf.load_model(path, dtype=jnp.float32)
  draft, _ = specjax.hf.load_model(draft_path, dtype=jnp.float32)
  with torch.no_grad():
    # An explicit mask: otherwise generate masks every prompt id equal to pad.
    ids = torch.tensor(tokens)
    expected = reference.generate(
      ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
    )[:, WIDTH:].numpy()
  prompts = jnp.asarray(tokens, jnp.int32)
  lengths = jnp.full((2,), WIDTH, jnp.int32)
  ar = specjax.autoregressive_generate(
    model, prompts, lengths, max_new_tokens=NEW, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(ar.tokens, expected)
  spec = specjax.speculative_generate(
    model, draft, prompts, lengths, gamma=3, max_new_tokens=NEW, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(spec.tokens, expected)


@pytest.mark.sample("llama")
def test_bfloat16_load(checkpoint, tokens):
  arch, _, path, _ = checkpoint
  model, _ = specjax.hf.load_model(path)  # default dtype: bfloat16
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(p.dtype == jnp.bfloat16 for p in params)
  reference, _ = specjax.hf.load_model(path, dtype=jnp.float32)
  x = jnp.asarray(tokens, jnp.int32)
  error = np.max(np.abs(np.asarray(model(x)) - np.asarray(reference(x))))
  assert 0 < error < 0.1


def test_config_translation(checkpoint):
  arch, _, path, _ = checkpoint
  cfg = specjax.hf.model_config(specjax.hf.read_config(path), "float32")
  expected = {
    "llama": dict(tie_embeddings=True, qkv_bias=False, n_kv_heads=2),
    "mistral": dict(sliding_window=8, tie_embeddings=False),
    "qwen2": dict(qkv_bias=True, out_bias=False),
    "qwen3": dict(qk_norm=True, qkv_bias=False, head_dim=16),
    "phi3": dict(sliding_window=8, tie_embeddings=False, qk_norm=False),
    "gemma2": dict(
      local_layers=(0,), sliding_window=8, attn_softcap=5.0, logit_softcap=3.0, qk_norm=False
    ),
    "gemma3": dict(local_layers=(0,), rope_local_theta=100.0, rope_theta=10_000.0, qk_norm=True),
    "smollm": dict(tie_embeddings=True, n_heads=6, n_kv_heads=2, rope_scaling=None),
    "gpt2": dict(norm="layernorm", positions="learned", mlp="gelu", tie_embeddings=True),
  }[arch]
  for key, value in expected.items():
    assert getattr(cfg, key) == value, key
  if arch == "llama":
    assert cfg.rope_scaling == specjax.models.config.RopeScaling(8.0, 1.0, 4.0, 16)


@pytest.mark.parametrize(
  "arch, change",
  [
    ("llama", "rope_scaling"),
    ("mistral", "sliding_window"),
    ("gemma2", "attn_softcap"),
    ("gemma2", "logit_softcap"),
    ("gemma2", "local_layers"),  # None: every layer local
    ("gemma3", "rope_local_theta"),
    ("gemma3", "rope_scaling"),
  ],
)
def test_features_change_the_logits(arch, change, tmp_path, tokens):
  """Without each feature the logits differ: the parity tests above do exercise it."""
  hf_model(arch, SMALL, 0).save_pretrained(tmp_path)
  model, _ = specjax.hf.load_model(str(tmp_path), dtype=jnp.float32)
  plain = specjax.Transformer(model.cfg.replace(**{change: None}), rngs=nnx.Rngs(0))
  nnx.update(plain, nnx.state(model))
  x = jnp.asarray(tokens, jnp.int32)
  assert np.max(np.abs(np.asarray(model(x)) - np.asarray(plain(x)))) > 1e-3


def test_sharded_checkpoint_loads(tmp_path, tokens):
  reference = hf_model("qwen2", SMALL, 0)
  reference.save_pretrained(tmp_path, max_shard_size="100KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  model, _ = specjax.hf.load_model(str(tmp_path), dtype=jnp.float32)
  with torch.no_grad():
    expected = reference(torch.tensor(tokens)).logits.numpy()
  assert np.max(np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - expected)) < 1e-4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama_errors")
  hf_model("llama", TINY, 0).save_pretrained(path)
  return path


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _edit_config(path, **changes):
  file = path / "config.json"
  config = json.loads(file.read_text())
  config.update(changes)
  file.write_text(json.dumps(config))


def test_errors_name_the_problem(llama_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    specjax.hf.load_model(str(tmp_path / "nowhere"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=r"no config.json in .*empty"):
    specjax.hf.load_model(str(empty))

  bert = _copy(llama_dir, tmp_path / "bert")
  _edit_config(bert, model_type="bert")
  with pytest.raises(
    ValueError,
    match=r"model_type 'bert' is not supported; supported: "
    r"llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, gemma3, gpt2",
  ):
    specjax.hf.load_model(str(bert))

  yarn = _copy(llama_dir, tmp_path / "yarn")
  _edit_config(yarn, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
  with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
    specjax.hf.load_model(str(yarn))

  no_weights = _copy(llama_dir, tmp_path / "no_weights")
  os.remove(no_weights / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    specjax.hf.load_model(str(no_weights))

  wrong_shape = _copy(llama_dir, tmp_path / "wrong_shape")
  _edit_config(wrong_shape, intermediate_size=96)
  with pytest.raises(
    ValueError,
    match=r"tensor 'model.layers.0.mlp.down_proj.weight' has "
    r"shape \(32, 64\).*implies \(96, 32\)",
  ):
    specjax.hf.load_model(str(wrong_shape))

  # A projection that fills part of a fused parameter is checked on its own.
  wrong_part = _copy(llama_dir, tmp_path / "wrong_part")
  _edit_config(wrong_part, num_key_value_heads=2)
  with pytest.raises(
    ValueError,
    match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(16, 32\), which "
    r"gives \(32, 16\) for layers/0/attn/qkv_proj/kernel \(its k_proj part\); "
    r"config.json implies \(32, 32\)",
  ):
    specjax.hf.load_model(str(wrong_part))

  extra = _copy(llama_dir, tmp_path / "extra")
  save_file(
    {
      "model.embed_tokens.weight": np.zeros((VOCAB, 32), np.float32),
      "model.vision_tower.weight": np.zeros((2, 2), np.float32),
    },
    str(extra / "model.safetensors"),
  )
  with pytest.raises(ValueError, match="tensor 'model.vision_tower.weight' does not belong"):
    specjax.hf.load_model(str(extra))

  missing = _copy(llama_dir, tmp_path / "missing")
  save_file(
    {"model.embed_tokens.weight": np.zeros((VOCAB, 32), np.float32)},
    str(missing / "model.safetensors"),
  )
  with pytest.raises(ValueError, match=r"lacks tensors: \['model.norm.weight'"):
    specjax.hf.load_model(str(missing))

  corrupt = _copy(llama_dir, tmp_path / "corrupt")
  (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
  with pytest.raises(ValueError, match=r"cannot read safetensors file .*corrupt"):
    specjax.hf.load_model(str(corrupt))


def _word_tokenizer(words):
  from tokenizers import Tokenizer, models, pre_tokenizers

  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return tok


def test_tokenizer_is_loaded_and_pairs_are_checked(llama_dir, tmp_path):
  a = _copy(llama_dir, tmp_path / "a")
  b = _copy(llama_dir, tmp_path / "b")
  _word_tokenizer(["<unk>", "hello", "world"]).save(str(a / "tokenizer.json"))
  _word_tokenizer(["<unk>", "world", "hello"]).save(str(b / "tokenizer.json"))
  _, tok_a = specjax.hf.load_model(str(a))
  _, tok_b = specjax.hf.load_model(str(b))
  assert tok_a.encode("hello world") == [1, 2]
  specjax.hf.check_same_tokenizer(tok_a, tok_a, str(a), str(a))
  with pytest.raises(
    ValueError,
    match=r"target \(.*a\) and draft \(.*b\) use different "
    r"tokenizers",
  ):
    specjax.hf.check_same_tokenizer(tok_a, tok_b, str(a), str(b))


def test_draft_with_smaller_vocabulary(tmp_path, tokens):
  """Qwen2.5 0.5B vs 7B style: same tokenizer, the draft has fewer rows."""
  target_dir, draft_dir = tmp_path / "t", tmp_path / "d"
  hf_model("qwen2", SMALL, 0).save_pretrained(target_dir)
  torch.manual_seed(1)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=200, **TINY)).save_pretrained(
    draft_dir
  )
  target, _ = specjax.hf.load_model(str(target_dir), dtype=jnp.float32)
  draft, _ = specjax.hf.load_model(str(draft_dir), dtype=jnp.float32)
  prompts = jnp.asarray(tokens % 200, jnp.int32)
  lengths = jnp.full((2,), WIDTH, jnp.int32)
  ar = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=NEW, sampling=specjax.GREEDY
  )
  spec = specjax.speculative_generate(
    target, draft, prompts, lengths, gamma=3, max_new_tokens=NEW, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(spec.tokens, ar.tokens)


def test_legacy_rope_keys_and_refusals():
  """Older config.json files keep rope_theta / rope_scaling at the top level."""
  legacy = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=500000.0,
    rope_scaling={
      "type": "llama3",
      "factor": 32.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
    },
  )
  cfg = specjax.hf.model_config(legacy, "float32")
  assert cfg.rope_theta == 500000.0
  assert cfg.rope_scaling == specjax.models.config.RopeScaling(32.0, 1.0, 4.0, 8192)
  plain = dict(legacy, rope_scaling=None)
  assert specjax.hf.model_config(plain, "float32").rope_scaling is None
  with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
    specjax.hf.model_config(dict(legacy, hidden_act="gelu"), "float32")
  with pytest.raises(ValueError, match="qwen2 use_sliding_window=true"):
    specjax.hf.model_config(dict(legacy, model_type="qwen2", use_sliding_window=True), "float32")
  with pytest.raises(ValueError, match="qwen3 use_sliding_window=true"):
    specjax.hf.model_config(dict(legacy, model_type="qwen3", use_sliding_window=True), "float32")
  with pytest.raises(ValueError, match="phi3 partial_rotary_factor=0.75 is not supported"):
    specjax.hf.model_config(dict(legacy, model_type="phi3", partial_rotary_factor=0.75), "float32")
  with pytest.raises(ValueError, match="model_type 'falcon' is not supported"):
    specjax.hf.model_config(dict(legacy, model_type="falcon"), "float32")


def test_gemma_configs_as_the_hub_writes_them_and_refusals():
  """gemma-3-1b's config.json keeps the older keys (rope_local_base_freq,
  sliding_window_pattern, a top-level rope_scaling); Gemma 2 leaves the
  soft-caps to their defaults."""
  gemma3 = dict(
    model_type="gemma3_text",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    sliding_window=512,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
  )
  cfg = specjax.hf.model_config(gemma3, "float32")
  assert cfg.local_layers == (0, 1, 2, 3, 4, 6)
  assert [cfg.layer_rope(i)[0] for i in (0, 5)] == [10_000.0, 1_000_000.0]
  assert cfg.layer_rope(0)[1] is None
  assert cfg.layer_rope(5)[1] == specjax.models.config.RopeScaling(8.0, kind="linear")
  assert (cfg.attn_softcap, cfg.logit_softcap, cfg.attn_scale) == (None, None, 1 / 16)
  assert (cfg.norm_offset, cfg.sandwich_norms, cfg.scale_embeddings, cfg.mlp) == (
    1.0,
    True,
    True,
    "geglu",
  )
  gemma2 = dict(gemma3, model_type="gemma2", rope_theta=10_000.0, rope_scaling=None)
  cfg = specjax.hf.model_config(gemma2, "float32")
  assert (cfg.attn_softcap, cfg.logit_softcap, cfg.local_layers) == (50.0, 30.0, (0, 2, 4, 6))
  assert cfg.rope_local_theta is None and not cfg.qk_norm
  refusals = {
    "use_bidirectional_attention=true": dict(use_bidirectional_attention=True),
    "hidden_activation 'gelu' is not supported": dict(hidden_activation="gelu"),
    r"rope_parameters.sliding_attention.rope_type 'linear'": dict(
      rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}
    ),
    "layer_types must list 7 entries": dict(layer_types=["chunked_attention"] * 7),
    "'final_logit_softcapping' must be null or a number > 0": dict(final_logit_softcapping=-1),
    "'query_pre_attn_scalar' must be > 0": dict(query_pre_attn_scalar=0),
    "rope scaling type 'yarn' is not supported": dict(rope_scaling={"rope_type": "yarn"}),
  }
  for message, change in refusals.items():
    with pytest.raises(ValueError, match=message):
      specjax.hf.model_config(dict(gemma3, **change), "float32")
  with pytest.raises(ValueError, match="needs a 'text_config' object"):
    specjax.hf.model_config(dict(model_type="gemma3"), "float32")


def test_multimodal_gemma3_loads_its_language_model(tmp_path, tokens):
  """A Gemma 3 image-text checkpoint (gemma-3-4b and up): specjax decodes its
  text model, skipping the vision tower, with parity on text-only input."""
  torch.manual_seed(0)
  text = dict(SMALL, head_dim=16, vocab_size=VOCAB, sliding_window_pattern=2, **GEMMA)
  vision = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
  )
  cfg = transformers.Gemma3Config(
    text_config=text,
    vision_config=vision,
    mm_tokens_per_image=4,
    image_token_index=VOCAB - 1,
    boi_token_index=VOCAB - 3,
    eoi_token_index=VOCAB - 2,
  )
  reference = transformers.Gemma3ForConditionalGeneration(cfg).eval()
  reference.save_pretrained(tmp_path)
  ids = tokens % (VOCAB - 3)  # no image tokens
  with torch.no_grad():
    expected = reference(input_ids=torch.tensor(ids)).logits.numpy()
  model, _ = specjax.hf.load_model(str(tmp_path), dtype=jnp.float32)
  assert model.cfg.qk_norm and model.cfg.local_layers == (0,)
  assert np.max(np.abs(np.asarray(model(jnp.asarray(ids, jnp.int32))) - expected)) < 1e-4


def test_load_model_returns_the_library_tokenizer(llama_dir, tmp_path):
  """The same `Tokenizer` class as `specjax.pretrained.load_pair` returns."""
  from specjax.data.tokenizer import Tokenizer

  path = _copy(llama_dir, tmp_path / "tok")
  _word_tokenizer(["<pad>", "<bos>", "<eos>", "hello"]).save(str(path / "tokenizer.json"))
  _, tokenizer = specjax.hf.load_model(str(path))
  assert isinstance(tokenizer, Tokenizer)
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
  assert tokenizer.encode("hello") == [3] and tokenizer.vocab_size == 4


def test_corrupt_tokenizer_json_names_the_path(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / "bad_tokenizer")
  (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
  with pytest.raises(ValueError, match=r"cannot read tokenizer .*bad_tokenizer.tokenizer.json"):
    specjax.hf.load_model(str(path))


@pytest.mark.parametrize(
  "arch, field", [("llama", "hidden_size"), ("llama", "vocab_size"), ("gpt2", "n_embd")]
)
def test_config_without_a_required_field_names_file_and_field(llama_dir, tmp_path, arch, field):
  path = _copy(llama_dir, tmp_path / "cfg")
  file = path / "config.json"
  config = json.loads(file.read_text())
  config["model_type"] = arch
  config.pop(field, None)
  file.write_text(json.dumps(config))
  with pytest.raises(ValueError, match=rf"cfg.config\.json.* '{field}'"):
    specjax.hf.load_model(str(path))


@pytest.mark.parametrize("text", ['{"model_type": "llama",', "[1, 2]", "\udcff"])
def test_config_that_is_not_a_json_object_names_the_file(llama_dir, tmp_path, text):
  path = _copy(llama_dir, tmp_path / "cfg")
  (path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
  with pytest.raises(ValueError, match=r"cfg.config\.json"):
    specjax.hf.load_model(str(path))


def test_config_with_a_bad_field_value_names_the_field(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / "cfg")
  _edit_config(path, num_hidden_layers="2")
  with pytest.raises(ValueError, match=r"cfg.config\.json.*num_hidden_layers"):
    specjax.hf.load_model(str(path))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused(llama_dir, tmp_path, bad):
  from safetensors.numpy import load_file

  path = _copy(llama_dir, tmp_path / "nan")
  tensors = load_file(str(path / "model.safetensors"))
  tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = bad
  save_file(tensors, str(path / "model.safetensors"))
  with pytest.raises(
    ValueError,
    match=r"nan.model\.safetensors: tensor "
    r"'model.layers.0.mlp.up_proj.weight' .*non-finite",
  ):
    specjax.hf.load_model(str(path))


def test_read_tensors_gives_each_tensor_as_written(tmp_path):
  """NumPy views of the mapped file: every dtype the loader meets, bfloat16
  included (which safetensors' own NumPy reader refuses), empty tensors too, in
  name order; a dtype without a NumPy type is named."""
  from safetensors.flax import save_file as save_jax

  from specjax.hf.weights import read_tensors

  tensors = {
    "b16": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 3,
    "a32": jnp.linspace(-1, 1, 5, dtype=jnp.float32),
    "c16": jnp.ones((3,), jnp.float16) / 3,
    "d64": jnp.arange(4, dtype=jnp.int32),
    "empty": jnp.zeros((0, 4), jnp.float32),
  }
  path = str(tmp_path / "t.safetensors")
  save_jax(tensors, path)
  read = list(read_tensors([path]))
  assert [name for _, name, _ in read] == sorted(tensors)
  for file, name, array in read:
    assert file == path and isinstance(array, np.ndarray)
    assert array.dtype == tensors[name].dtype and array.shape == tensors[name].shape
    np.testing.assert_array_equal(array, np.asarray(tensors[name]))
  raw = (tmp_path / "t.safetensors").read_bytes()
  at = raw.index(b'"F16"')
  (tmp_path / "u.safetensors").write_bytes(raw[:at] + b'"U16"' + raw[at + 5 :])
  with pytest.raises(ValueError, match=r"u\.safetensors"):
    list(read_tensors([str(tmp_path / "u.safetensors")]))


def test_corrupt_safetensors_header_names_the_path(llama_dir, tmp_path):
  """A changed dtype in the header reinterprets the float bytes as integers."""
  path = _copy(llama_dir, tmp_path / "header")
  raw = (path / "model.safetensors").read_bytes()
  header = raw.index(b'"F32"')
  (path / "model.safetensors").write_bytes(raw[:header] + b'"I32"' + raw[header + 5 :])
  with pytest.raises(ValueError, match=r"header.model\.safetensors: tensor .* has dtype int32"):
    specjax.hf.load_model(str(path))
  (path / "model.safetensors").write_bytes(raw[:-3])  # truncated
  with pytest.raises(ValueError, match=r"cannot read safetensors file .*header"):
    specjax.hf.load_model(str(path))


def test_corrupt_shard_index_names_the_path(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / "index")
  (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
  with pytest.raises(ValueError, match=r"index.model\.safetensors\.index\.json.*weight_map"):
    specjax.hf.load_model(str(path))


def test_dtype_names_come_from_the_one_table(llama_dir, tmp_path, tokens, target):
  """float16 is in `specjax.dtypes`, so export writes it; other names are refused early."""
  from specjax.hf.export import save_model
  from specjax.hf.transformers_baseline import time_transformers

  model = target  # conftest's tiny Llama-style model
  save_model(model, str(tmp_path / "f16"), dtype="float16")
  half, _ = specjax.hf.load_model(str(tmp_path / "f16"), dtype=jnp.float32)
  x = jnp.asarray(tokens, jnp.int32)
  assert np.max(np.abs(np.asarray(half(x)) - np.asarray(model(x)))) < 0.05
  with pytest.raises(ValueError, match="dtype must be one of"):
    save_model(model, str(tmp_path / "int8"), dtype="int8")
  gemma = specjax.Transformer(
    model.cfg.replace(sliding_window=4, local_layers=(0,), logit_softcap=30.0), rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match=r"cannot express .*local_layers=\(0,\), logit_softcap=30.0"):
    save_model(gemma, str(tmp_path / "gemma"), dtype="float32")
  with pytest.raises(ValueError, match="dtype must be one of"):
    specjax.hf.load_model(str(llama_dir), dtype=jnp.int8)
  with pytest.raises(ValueError, match="dtype must be one of"):
    time_transformers(
      str(tmp_path / "nowhere"),
      str(tmp_path / "nowhere"),
      [1],
      gamma=2,
      max_new_tokens=4,
      sampling=specjax.GREEDY,
      dtype="int8",
      num_runs=3,
    )


def test_make_hf_checkpoint_uses_the_library_tokenizer(tmp_path):
  from experiments import make_hf_checkpoint
  from specjax.data import tokenizer as tokenizer_lib

  assert make_hf_checkpoint.train_tokenizer is tokenizer_lib.train_tokenizer
  # The library's check: the BPE needs 256 byte ids plus the specials.
  with pytest.raises(ValueError, match=r"vocab_size must be >= 259"):
    make_hf_checkpoint.make_checkpoint(str(tmp_path / "small"), "llama", "tiny", 100)
  with pytest.raises(ValueError, match=r"arch must be one of"):
    make_hf_checkpoint.make_checkpoint(str(tmp_path / "bert"), "bert", "tiny", 300)
  with pytest.raises(ValueError, match=r"size must be one of"):
    make_hf_checkpoint.make_checkpoint(str(tmp_path / "huge"), "llama", "huge", 300)
  assert not os.path.exists(tmp_path / "small")


def test_missing_checkpoints_are_one_line_naming_the_flag(tmp_path, monkeypatch):
  """Issue 28: a path whose directory exists (runs/target) is reported as a
  missing checkpoint directory, a repo id as missing from the local cache with
  no network download; each message is one line and names the flag."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()
  cache = str(tmp_path / "hub")
  cases = (
    ("runs/target", "--target", r"^--target: runs/target: no such checkpoint directory "),
    (
      "org/model",
      "--config.target",
      r"^--config.target: org/model: no such local directory, and the Hugging Face cache "
      r".*hub has no snapshot of repo 'org/model' .* no network download",
    ),
    (
      "/no/such/dir",
      "--config.draft",
      r"^--config.draft: checkpoint directory /no/such/dir does not exist",
    ),
  )
  for name, flag, message in cases:
    with pytest.raises(FileNotFoundError, match=message) as error:
      specjax.hf.resolve_checkpoint(name, cache_dir=cache, flag=flag)
    assert "\n" not in str(error.value) and "allow_download" not in str(error.value)


def test_missing_torch_or_transformers_is_one_line_on_installing_them(tmp_path, monkeypatch):
  """Issue 28: make_hf_checkpoint and the transformers comparison fail before any
  work with the packages to install and how (PyTorch's CPU index where no local
  wheel exists); a ValueError too, so launchers print it as one line."""
  from experiments.make_hf_checkpoint import make_checkpoint
  from specjax.hf.optional import MissingPackagesError
  from specjax.hf.transformers_baseline import time_transformers

  monkeypatch.setitem(sys.modules, "torch", None)
  out = tmp_path / "ckpt"
  with pytest.raises(
    MissingPackagesError,
    match=r"^make_hf_checkpoint needs torch, which is not installed: pip install "
    r"torch==2.13.0 transformers \(.*pip install torch --index-url "
    r"https://download.pytorch.org/whl/cpu, then pip install transformers\)$",
  ) as error:
    make_checkpoint(str(out), "llama", "tiny", 512)
  assert isinstance(error.value, ValueError) and not out.exists()
  monkeypatch.setitem(sys.modules, "transformers", None)
  with pytest.raises(ValueError, match=r"needs torch and transformers, which are not installed"):
    time_transformers(
      "t",
      "d",
      [1],
      gamma=1,
      max_new_tokens=1,
      sampling=specjax.GREEDY,
      dtype="float32",
      num_runs=1,
    )
  monkeypatch.setitem(sys.modules, "torch", torch)
  with pytest.raises(
    ValueError,
    match=r"needs transformers, which is not installed: pip install "
    r"transformers$",
  ):
    make_checkpoint(str(out), "llama", "tiny", 512)

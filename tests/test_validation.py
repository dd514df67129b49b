"""Bad inputs: a ValueError naming the argument and its range, before any compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import traces

PROMPTS = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]], jnp.int32)
LENGTHS = jnp.array([3, 2], jnp.int32)
KEY = jax.random.key(0)


def _spec(target, draft, **overrides):
  kwargs = dict(
    prompts=PROMPTS,
    prompt_lengths=LENGTHS,
    gamma=2,
    max_new_tokens=8,
    sampling=specjax.SamplingParams(),
    key=KEY,
  )
  kwargs.update(overrides)
  prompts, lengths = kwargs.pop("prompts"), kwargs.pop("prompt_lengths")
  return specjax.speculative_generate(target, draft, prompts, lengths, **kwargs)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(gamma=0), r"gamma must be an integer >= 1, got 0"),
    (dict(gamma=2.5), r"gamma must be an integer >= 1"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(prompt_lengths=jnp.array([3, 0])), r"prompt_lengths must be in \[1, P=4\]"),
    (dict(prompt_lengths=jnp.array([5, 2])), r"prompt_lengths must be in \[1, P=4\]"),
    (
      dict(prompts=PROMPTS.at[1, 1].set(512)),
      r"prompts must hold token ids in \[0, vocab_size=512\).*row 1, column 1",
    ),
    (dict(prompts=PROMPTS.at[0, 0].set(-1)), r"token ids in \[0, vocab_size=512\)"),
    (dict(prompts=PROMPTS.astype(jnp.float32)), r"prompts must have an integer dtype"),
    (dict(prompts=PROMPTS[0]), r"prompts must have rank 2"),
    (dict(prompts=[[1, 2]]), r"prompts must be an integer array"),
    (dict(prompt_lengths=LENGTHS[None]), r"prompt_lengths must have rank 1"),
    (dict(prompt_lengths=jnp.array([3, 2, 1])), r"prompt_lengths has 3 rows but prompts has 2"),
    (
      dict(max_new_tokens=200),
      r"prompt width \(4\) \+ max_new_tokens \(200\) \+ gamma \+ 1 "
      r"\(3\) = 207 exceeds max_seq_len=128",
    ),
    (dict(sampling=specjax.SamplingParams(top_k=513)), r"top_k must be in \[0, vocab_size=512\]"),
    (dict(sampling=0.5), r"sampling must be a specjax.SamplingParams"),
    (dict(eos_id=512), r"eos_id must be None or an integer in \[0, vocab_size=512\)"),
    (dict(eos_id=[]), r"eos_id must be None, an integer or a non-empty list of distinct"),
    (dict(eos_id=[2, 2]), r"eos_id must be None, an integer or a non-empty list of distinct"),
    (dict(eos_id=[2, 512]), r"in \[0, vocab_size=512\), got \[2, 512\]"),
    (dict(verifier="beam"), r"verifier must be one of"),
    (dict(key=None), r"key must be a jax.random key when temperature > 0"),
    (dict(key=5), r"key must be a jax.random.key"),
  ],
)
def test_speculative_generate_rejects(target, draft, overrides, message):
  with traces() as traced, pytest.raises(ValueError, match=message):
    _spec(target, draft, **overrides)
  assert not traced  # raised before tracing or compiling


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(temperature=-0.1), r"temperature must be a number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be an integer >= 0"),
  ],
)
def test_sampling_params_reject(kwargs, message):
  with pytest.raises(ValueError, match=message):
    specjax.SamplingParams(**kwargs)


def test_draft_capacity_is_checked_too(target, tiny_cfg):
  short = specjax.Transformer(tiny_cfg.replace(max_seq_len=16, n_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"draft: prompt width \(4\) \+ max_new_tokens "
    r"\(10\) \+ gamma \+ 1 \(3\) = 17 exceeds "
    r"max_seq_len=16",
  ):
    _spec(target, short, max_new_tokens=10)


def test_autoregressive_generate_rejects(target):
  with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1"):
    specjax.autoregressive_generate(
      target, PROMPTS, LENGTHS, max_new_tokens=0, sampling=specjax.GREEDY
    )
  with pytest.raises(
    ValueError,
    match=r"prompt width \(4\) \+ max_new_tokens \(125\) = "
    r"129 exceeds max_seq_len=128",
  ):
    specjax.autoregressive_generate(
      target, PROMPTS, LENGTHS, max_new_tokens=125, sampling=specjax.GREEDY
    )


def test_padding_beyond_lengths_is_ignored(target):
  """Padding ids are never read: out-of-range padding is allowed and changes nothing."""
  padded = PROMPTS.at[1, 2:].set(-5)
  a = specjax.autoregressive_generate(
    target, PROMPTS, LENGTHS, max_new_tokens=4, sampling=specjax.GREEDY
  )
  b = specjax.autoregressive_generate(
    target, padded, LENGTHS, max_new_tokens=4, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      dict(key=jax.random.split(KEY, 3)),  # two rows
      r"key must be a single jax.random.key \(shape \(\)\), or one per row \(keys \[2\]",
    ),
    (dict(key=jax.random.split(KEY, 2), verifier="token"), r"cannot use one key per row"),
    (dict(pad_id=2**31), r"pad_id must be an integer in \[-2147483648, 2147483647\]"),
    (dict(pad_id=0.5), r"pad_id must be an integer"),
    (dict(adaptive="confidence", confidence_threshold=0.0), r"confidence_threshold must be"),
  ],
)
def test_more_arguments_are_named(target, draft, overrides, message):
  with traces() as traced, pytest.raises(ValueError, match=message):
    _spec(target, draft, **overrides)
  assert not traced


@pytest.mark.parametrize("draft", [None, "draft", 3])
def test_draft_must_be_a_model_or_drafter(target, draft):
  with pytest.raises(ValueError, match="draft must be a specjax.Transformer or a"):
    _spec(target, draft)


def test_numpy_scalars_are_accepted(target, draft):
  """np.int64 / np.float32 arguments work like Python numbers, and compile once."""
  plain = _spec(
    target,
    draft,
    gamma=2,
    max_new_tokens=6,
    eos_id=7,
    pad_id=1,
    sampling=specjax.SamplingParams(temperature=0.5, top_k=20),
  )
  with traces() as traced:
    numpy = _spec(
      target,
      draft,
      gamma=np.int64(2),
      max_new_tokens=np.int32(6),
      eos_id=np.int64(7),
      pad_id=np.int64(1),
      sampling=specjax.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(20)),
    )
  np.testing.assert_array_equal(numpy.tokens, plain.tokens)
  assert not traced  # the same static configuration


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(max_ngram=0), r"max_ngram must be an integer in \[1, inf\]"),
    (dict(min_ngram=0), r"min_ngram must be an integer in \[1, inf\]"),
    (dict(max_ngram=2, min_ngram=3), r"max_ngram must be an integer in \[3, inf\]"),
    (dict(max_ngram=2.0), r"max_ngram must be an integer"),
  ],
)
def test_ngram_drafter_settings_are_checked(kwargs, message):
  with pytest.raises(ValueError, match=message):
    specjax.drafting.NGramDrafter(512, **kwargs)

"""Sampling warps against a plain numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.sampling import sample_tokens, warp_probs


def _reference(logits, temperature, top_k, top_p):
  z = logits.astype(np.float64) / temperature
  if top_k:
    z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  if top_p < 1:
    order = np.argsort(-p, kind="stable")
    keep = np.cumsum(p[order]) - p[order] < top_p
    mask = np.zeros_like(p, bool)
    mask[order[keep]] = True
    p = np.where(mask, p, 0)
    p /= p.sum()
  return p


@pytest.mark.parametrize(
  "temperature, top_k, top_p",
  [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 0, 0.6),
    (0.8, 10, 0.9),
    (1.0, 1, 1.0),
    (1.0, 0, 1e-6),
  ],
)
def test_warp_matches_reference(temperature, top_k, top_p):
  logits = np.asarray(jax.random.normal(jax.random.key(1), (6, 40))) * 3
  params = specjax.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  probs = np.asarray(warp_probs(jnp.asarray(logits), params))
  for row, p in zip(logits, probs):
    np.testing.assert_allclose(p, _reference(row, temperature, top_k, top_p), atol=1e-6)
  if top_k and top_p == 1:
    assert np.all((probs > 0).sum(-1) == top_k)
  if top_p == 1e-6 or top_k == 1:
    assert np.all((probs > 0).sum(-1) == 1)  # only the argmax survives


def test_temperature_zero_is_one_hot_argmax_with_low_index_ties():
  logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]], jnp.bfloat16)
  probs = warp_probs(logits, specjax.GREEDY)
  assert probs.dtype == jnp.float32
  np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])
  tokens, _ = sample_tokens(jax.random.key(0), logits, specjax.GREEDY)
  np.testing.assert_array_equal(tokens, [1, 0])


def test_bfloat16_logits_give_float32_probabilities():
  logits = jax.random.normal(jax.random.key(0), (3, 50)).astype(jnp.bfloat16)
  probs = warp_probs(logits, specjax.SamplingParams(temperature=0.9, top_p=0.9))
  assert probs.dtype == jnp.float32
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)


def test_sample_tokens_draws_from_the_returned_probs():
  """Empirical frequencies of 2e5 draws match the probabilities returned alongside."""
  logits = jnp.tile(jnp.array([[2.0, 1.0, 0.0, -1.0, -9.0]]), (200_000, 1))
  params = specjax.SamplingParams(temperature=1.0, top_k=3)
  tokens, probs = sample_tokens(jax.random.key(3), logits, params)
  freq = np.bincount(np.asarray(tokens), minlength=5) / tokens.shape[0]
  np.testing.assert_allclose(freq, probs[0], atol=5e-3)
  assert freq[3] == 0 and freq[4] == 0


def test_sample_never_draws_zero_probability_tokens():
  """Mass at the edges and tiny masses next to zeros: only positive tokens come out."""
  probs = np.zeros((4, 1000), np.float32)
  probs[0, -1] = 1.0  # all mass on the last id
  probs[1, 0] = 1.0  # all mass on the first id
  probs[2, [3, 500, 999]] = [1e-7, 0.5, 0.5 - 1e-7]
  probs[3, ::97] = 1.0 / len(range(0, 1000, 97))
  keys = jax.random.split(jax.random.key(0), 20_000)
  draws = np.asarray(jax.vmap(lambda k: specjax.sampling.sample(k, jnp.asarray(probs)))(keys))
  assert np.all(probs[np.arange(4)[None, :], draws] > 0)
  np.testing.assert_array_equal(draws[:, 0], 999)
  np.testing.assert_array_equal(draws[:, 1], 0)
  assert abs(np.mean(draws[:, 2] == 500) - 0.5) < 0.02


@pytest.mark.parametrize("temperature", [1e-8, 1e-10, 1e-20, 1e-37])
@pytest.mark.parametrize("vocab", [16, 256])
def test_tiny_temperatures_stay_finite(temperature, vocab):
  """Any positive temperature gives a law (issue 10: NaN and token 0 under jit)."""
  logits = 40.0 * jax.random.normal(jax.random.key(3), (8, vocab))
  params = specjax.SamplingParams(temperature=temperature)
  probs = np.asarray(jax.jit(lambda x: warp_probs(x, params))(logits))
  assert np.all(np.isfinite(probs))
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  # No ties among random logits: all the mass is on the argmax.
  np.testing.assert_array_equal(probs.argmax(-1), np.asarray(logits).argmax(-1))
  assert probs.max(-1).min() > 0.999


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300])
def test_temperature_below_float32_resolution_is_greedy(temperature):
  params = specjax.SamplingParams(temperature=temperature)
  assert params.greedy
  logits = jnp.array([[0.0, 2.0, 2.0, 1.0]])  # a tie breaks to the lowest id, as argmax
  np.testing.assert_array_equal(
    jax.jit(lambda x: warp_probs(x, params))(logits), [[0.0, 1.0, 0.0, 0.0]]
  )


def test_tiny_temperature_generation_is_greedy(target):
  prompts = jnp.array([[5, 17, 3, 9]], jnp.int32)
  lengths = jnp.array([4], jnp.int32)
  greedy = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=8, sampling=specjax.GREEDY
  )
  for t in (1e-10, 1e-40):
    out = specjax.autoregressive_generate(
      target,
      prompts,
      lengths,
      max_new_tokens=8,
      sampling=specjax.SamplingParams(temperature=t),
      key=jax.random.key(0),
    )
    np.testing.assert_array_equal(out.tokens, greedy.tokens)


def test_numpy_scalars_are_numbers():
  params = specjax.SamplingParams(
    temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9)
  )
  assert params == specjax.SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
  assert hash(params) == hash(specjax.SamplingParams(temperature=0.5, top_k=3, top_p=0.9))
  with pytest.raises(ValueError, match="temperature must be a number"):
    specjax.SamplingParams(temperature=float("inf"))
  with pytest.raises(ValueError, match="top_k must be an integer"):
    specjax.SamplingParams(top_k=True)


def test_row_settings_warp_each_row_as_its_static_form():
  """`RowSampling`: each row gets its own `SamplingParams` warp, the very same
  tokens kept (the bisection thresholds equal the sorted ones) with ties, -inf
  logits, greedy rows and several positions per row."""
  settings = [
    specjax.GREEDY,
    specjax.SamplingParams(0.7, top_k=5),
    specjax.SamplingParams(1.0, top_p=0.8),
    specjax.SamplingParams(1.3, top_k=10, top_p=0.5),
    specjax.SamplingParams(1.0),
    specjax.SamplingParams(0.5, top_k=1),
    specjax.SamplingParams(2.0, top_p=0.05),
    specjax.SamplingParams(1.0, top_k=300, top_p=0.999),
  ]
  logits = 3 * jax.random.normal(jax.random.key(1), (len(settings), 3, 300))
  logits = logits.at[0, 0, :5].set(9.0).at[1, 1, 3].set(-jnp.inf)
  logits = logits.at[3].set(jnp.round(logits[3]))  # many ties at the thresholds
  rows = specjax.RowSampling.of(settings)
  warped = jax.jit(warp_probs)(logits, rows)
  # Each row's static warp, all in one program rather than op by op.
  static = jax.jit(lambda logits: [warp_probs(logits[i], s) for i, s in enumerate(settings)])
  for i, expected in enumerate(static(logits)):
    np.testing.assert_array_equal(warped[i] > 0, expected > 0)  # the same tokens kept
    np.testing.assert_allclose(warped[i], expected, rtol=1e-6, atol=1e-7)


def test_row_settings_are_checked_per_row():
  rows = specjax.RowSampling.of([specjax.GREEDY, specjax.SamplingParams(top_k=9)])
  with pytest.raises(
    ValueError, match=r"sampling.top_k must be an integer in \[0, vocab_size=8\]; row 1"
  ):
    rows.check(vocab_size=8, batch=2)
  with pytest.raises(ValueError, match="sampling has 2 rows but the batch has 3"):
    rows.check(vocab_size=16, batch=3)
  bad = rows.replace(temperature=jnp.array([0.0, -1.0]))
  with pytest.raises(ValueError, match="sampling.temperature must be a number >= 0.*row 1"):
    bad.check(vocab_size=16, batch=2)
  with pytest.raises(ValueError, match="batch is needed"):
    specjax.RowSampling.of(specjax.GREEDY)

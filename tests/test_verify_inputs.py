"""What the verifiers do with input no correct drafter produces (issue 10).

Shapes are checked before compiling and raise a ValueError naming the argument;
values a drafter cannot have produced (an id outside [0, V), a non-finite q) are
rejections, never acceptances, in every verifier; g = 0 works everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.verify import VERIFIERS, block_verify, get_verifier, greedy_verify, token_verify

B, G, V = 4, 3, 8
ALL = [token_verify, block_verify, greedy_verify]
IDS = ["token", "block", "greedy"]


def _inputs(seed=0):
  """A block where p == q == one-hot at the drafted tokens: every verifier accepts it all."""
  tokens = jax.random.randint(jax.random.key(seed), (B, G), 0, V, jnp.int32)
  q = jax.nn.one_hot(tokens, V, dtype=jnp.float32)
  p = jnp.concatenate([q, jnp.full((B, 1, V), 1.0 / V)], axis=1)
  return tokens, q, p


@pytest.mark.parametrize("verify", ALL, ids=IDS)
def test_the_reference_block_is_fully_accepted(verify):
  tokens, q, p = _inputs()
  n, _ = jax.jit(verify)(jax.random.key(1), tokens, q, p)  # the program the checks below run
  np.testing.assert_array_equal(n, G)  # so the rejections below are the guards' doing


@pytest.mark.parametrize("verify", ALL, ids=IDS)
@pytest.mark.parametrize("first_bad", [0, 1, 2])
def test_nan_draft_probs_are_rejected(verify, first_bad):
  tokens, q, p = _inputs()
  q = q.at[:, first_bad:, :].set(jnp.nan)  # the laws from position first_bad on are garbage
  for seed in range(8):
    n, y = jax.jit(verify)(jax.random.key(seed), tokens, q, p)
    np.testing.assert_array_equal(n, first_bad)
    assert np.all((np.asarray(y) >= 0) & (np.asarray(y) < V))


@pytest.mark.parametrize("verify", ALL, ids=IDS)
@pytest.mark.parametrize("bad", [-1, V, 2 * V])
def test_out_of_range_draft_tokens_are_rejected(verify, bad):
  tokens, q, p = _inputs()
  # Uniform laws at position 1: whatever id an out-of-range index were read as,
  # it would look like a perfectly good draft there.
  q = q.at[:, 0].set(1.0 / V)
  p = p.at[:, 0].set(1.0 / V)
  tokens = tokens.at[:, 0].set(bad)
  n, y = jax.jit(verify)(jax.random.key(0), tokens, q, p)
  np.testing.assert_array_equal(n, 0)
  assert np.all((np.asarray(y) >= 0) & (np.asarray(y) < V))


@pytest.mark.parametrize("verify", ALL, ids=IDS)
def test_zero_drafted_tokens_give_the_bonus_token(verify):
  p = jax.nn.one_hot(jnp.arange(B) + 2, V, dtype=jnp.float32)[:, None, :]  # [B, 1, V]
  n, y = verify(
    jax.random.key(0), jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V), jnp.float32), p
  )
  np.testing.assert_array_equal(n, 0)
  np.testing.assert_array_equal(y, np.arange(B) + 2)


@pytest.mark.parametrize("verify", ALL, ids=IDS)
@pytest.mark.parametrize(
  "change, name",
  [
    (lambda t, q, p: (t, q, p[:, :G]), "target_probs"),  # no bonus row
    (lambda t, q, p: (t, q, p[:, :, : V - 1]), "draft_probs"),  # V disagrees
    (lambda t, q, p: (t, q[: B - 1], p), "draft_probs"),  # batch disagrees
    (lambda t, q, p: (t[: B - 1], q, p), "target_probs"),  # batch disagrees
    (lambda t, q, p: (t.astype(jnp.float32), q, p), "draft_tokens"),  # not ids
    (lambda t, q, p: (t[0], q, p), "draft_tokens"),  # rank
  ],
)
def test_shapes_are_checked_naming_the_argument(verify, change, name):
  tokens, q, p = change(*_inputs())
  with pytest.raises(ValueError, match=name):
    verify(jax.random.key(0), tokens, q, p)


@pytest.mark.parametrize("verify", [token_verify, block_verify], ids=["token", "block"])
def test_sampling_verifiers_need_one_key(verify):
  with pytest.raises(ValueError, match="key"):
    verify(None, *_inputs())
  with pytest.raises(ValueError, match="key"):
    verify(jax.random.split(jax.random.key(0), 2), *_inputs())


def test_registry_takes_names_and_functions():
  assert get_verifier("block") is block_verify
  assert get_verifier(token_verify) is token_verify
  assert set(VERIFIERS) == {"token", "block", "greedy", "coupled"}
  with pytest.raises(ValueError, match="verifier must be one of"):
    get_verifier("tree")

"""Every drafter x every verifier through the one `speculative_step` (issue 5).

Greedy decoding must equal autoregressive decoding for each combination, in a
batch with ragged prompts and ragged acceptance; sampling exactness per
drafter is in test_distribution.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import specjax
from helpers import forward_cached, full_logits, make_drafter
from specjax import GREEDY, trees
from specjax.drafting import DrafterBase, NGramDrafter, Proposal, layer_skip, lookup

MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts():
  # Repeating patterns, so prompt lookup has something to find.
  pattern = jnp.array(
    [
      [3, 17, 99, 4, 3, 17, 99, 4, 3],
      [250, 251, 250, 251, 250, 0, 0, 0, 0],
      [7, 8, 9, 10, 11, 12, 0, 0, 0],
      [42, 0, 0, 0, 0, 0, 0, 0, 0],
    ],
    jnp.int32,
  )
  return pattern, jnp.array([9, 5, 6, 1], jnp.int32)


@pytest.fixture(scope="module")
def reference(target, prompts):
  return specjax.autoregressive_generate(target, *prompts, max_new_tokens=MAX_NEW, sampling=GREEDY)


def test_lookup_finds_the_most_recent_longest_match():
  history = jnp.array(
    [
      [5, 6, 7, 8, 5, 6, 0, 0, 0, 0],
      [1, 2, 3, 1, 2, 9, 1, 2, 0, 0],
      [4, 4, 4, 4, 0, 0, 0, 0, 0, 0],
      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0],
    ],
    jnp.int32,
  )
  find = jax.jit(lookup, static_argnames=("max_ngram", "min_ngram"))  # one program, not op by op
  start, size = find(history, jnp.array([6, 8, 4, 4]), max_ngram=3, min_ngram=1)
  # [5, 6] -> 7; [1, 2] last seen at 3 -> 9; [4, 4, 4] at 0 -> 4; nothing.
  np.testing.assert_array_equal(start, [2, 5, 3, -1])
  np.testing.assert_array_equal(size, [2, 2, 3, 0])


@pytest.mark.sample("model-token", "ngram-block", "layer_skip-greedy")
@pytest.mark.parametrize("verifier", ["token", "block", "greedy"])
@pytest.mark.parametrize("name", ["model", "ngram", "layer_skip"])
def test_greedy_equals_autoregressive(target, noisy_target, prompts, reference, name, verifier):
  drafter = make_drafter(name, target, noisy_target)
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY, verifier=verifier
  )
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.num_generated, reference.num_generated)
  stats = out.stats
  proposed, accepted = np.asarray(stats.proposed), np.asarray(stats.accepted)
  assert (accepted <= proposed).all() and proposed.sum() > 0
  if name in ("model", "ngram"):
    assert 0 < float(stats.acceptance_rate) < 1  # ragged acceptance really happened
  if name == "ngram":
    assert int(stats.draft_calls) == 0  # model-free


@pytest.mark.sample("model-schedule", "model-confidence")
@pytest.mark.parametrize("adaptive", ["schedule", "confidence"])
@pytest.mark.parametrize("name", ["model", "layer_skip"])
def test_adaptive_greedy_equals_autoregressive(
  target, noisy_target, prompts, reference, name, adaptive
):
  out = specjax.speculative_generate(
    target,
    make_drafter(name, target, noisy_target),
    *prompts,
    gamma=4,
    max_new_tokens=MAX_NEW,
    sampling=GREEDY,
    adaptive=adaptive,
    confidence_threshold=0.9,
  )
  np.testing.assert_array_equal(out.tokens, reference.tokens)


def test_schedule_adapts_the_draft_length(target, draft, prompts):
  kwargs = dict(gamma=6, max_new_tokens=32, sampling=GREEDY, adaptive="schedule")
  perfect = specjax.speculative_generate(target, target, *prompts, **kwargs).stats
  # Everything accepted: the limit stays at gamma.
  np.testing.assert_array_equal(perfect.proposed, np.asarray(perfect.row_iterations) * 6)
  poor = specjax.speculative_generate(target, draft, *prompts, **kwargs).stats
  assert float(poor.acceptance_rate) < 0.2
  # Mostly rejected: the limit falls toward 1 (gamma 6 would propose 6 per iteration).
  assert np.sum(poor.proposed) / np.sum(poor.row_iterations) < 2.5


def test_confidence_threshold_stops_drafting(target, noisy_target, prompts):
  sampled = specjax.SamplingParams(temperature=1.0)
  kwargs = dict(gamma=4, max_new_tokens=16, sampling=sampled, key=jax.random.key(2))
  fixed = specjax.speculative_generate(target, noisy_target, *prompts, **kwargs).stats
  strict = specjax.speculative_generate(
    target, noisy_target, *prompts, adaptive="confidence", confidence_threshold=0.999, **kwargs
  ).stats
  assert np.sum(fixed.proposed) == 4 * np.sum(fixed.row_iterations)
  # A flat random draft is never 99.9% sure: nothing is proposed, no draft calls
  # after the first of each iteration.
  assert np.sum(strict.proposed) == 0
  assert int(strict.draft_calls) == int(strict.iterations) + 1


@pytest.mark.parametrize(
  "changes, error, message",
  [
    (
      dict(adaptive="oracle"),
      ValueError,
      r"adaptive must be one of \(None, 'schedule', 'confidence'\)",
    ),
    (
      dict(adaptive="confidence", confidence_threshold=0.0),
      ValueError,
      r"confidence_threshold must be in \(0, 1\]",
    ),
  ],
)
def test_adaptive_arguments_rejected(target, draft, prompts, changes, error, message):
  with pytest.raises(error, match=message):
    specjax.speculative_generate(target, draft, *prompts, gamma=2, max_new_tokens=4, **changes)


def test_confidence_needs_a_model_drafter(target, prompts):
  with pytest.raises(ValueError, match="adaptive='confidence' needs a model drafter"):
    specjax.speculative_generate(
      target, NGramDrafter(512), *prompts, gamma=2, max_new_tokens=4, adaptive="confidence"
    )


def test_layer_skip_shares_the_target_weights(target):
  drafter = layer_skip(target, 1)
  assert drafter.model is target  # the same parameters, no copy
  tokens = jnp.array([[5, 9, 2]], jnp.int32)
  cache = target.init_cache(1, 8, num_layers=1)
  logits, cache = forward_cached(target, tokens, cache, num_layers=1)
  assert len(cache.k) == 1
  from specjax.models.transformer import attention_mask

  @jax.jit
  def by_hand(model, tokens):  # first block, final norm, tied or untied head
    positions = jnp.arange(3)[None]
    x = model._embed(tokens, positions)
    mask = {None: attention_mask(positions, positions[0])}
    return model._logits(model.layers[0](x, positions, mask, None, None)[0])

  np.testing.assert_allclose(logits, by_hand(target, tokens), atol=1e-5)
  for bad in (0, 2, 1.5):
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 1\]"):
      layer_skip(target, bad)


def test_a_verifier_function_works_like_its_name(target, noisy_target, prompts):
  kwargs = dict(
    gamma=3, max_new_tokens=MAX_NEW, sampling=specjax.SamplingParams(), key=jax.random.key(4)
  )
  by_name = specjax.speculative_generate(target, noisy_target, *prompts, verifier="block", **kwargs)
  by_function = specjax.speculative_generate(
    target, noisy_target, *prompts, verifier=specjax.verify.block_verify, **kwargs
  )
  np.testing.assert_array_equal(by_function.tokens, by_name.tokens)
  with pytest.raises(ValueError, match="verifier='greedy' needs temperature 0"):
    specjax.speculative_generate(
      target, noisy_target, *prompts, verifier=specjax.verify.greedy_verify, **kwargs
    )


@struct.dataclass
class _Repeat(DrafterBase):
  """Proposes s[-1] gamma times; keeps what `commit` hands it as its state."""

  vocab_size: int = struct.field(pytree_node=False)
  target_features: bool = struct.field(pytree_node=False, default=True)
  tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    return None

  def propose(self, state, recent, key, limit, *, gamma, sampling):
    b = recent.shape[0]
    return Proposal(
      jnp.tile(recent[:, 1:], (1, gamma)),
      None,
      jnp.full((b,), gamma),
      jnp.int32(0),
      None if self.tree is None else trees.Tree.static(self.tree),
    ), state

  def commit(self, state, commit):
    return commit.hidden


def test_commit_hands_the_target_hidden_states(target, prompts):
  gamma = 3
  config = specjax.SpecConfig(
    gamma=gamma, max_new_tokens=MAX_NEW, sampling=GREEDY, verifier="greedy"
  )
  drafter = _Repeat(target.cfg.vocab_size)
  prompt, lengths = prompts
  state = jax.jit(
    lambda: specjax.generation.init_state(
      target, drafter, prompt, lengths, jax.random.key(0), config
    )
  )()
  new = jax.jit(lambda s: specjax.speculative_step(target, drafter, s, config))(state)
  hidden = new.drafter_state
  assert hidden.shape == (4, gamma + 1, target.cfg.d_model)
  # The features at s[-1], x_1..x_g give, through the final norm and head, the
  # target's own logits there, as a full forward over the sequence does.
  block = jnp.tile(state.recent[:, 1:], (1, gamma + 1))
  logits, _ = forward_cached(target, block, state.target_cache)
  to_logits = jax.jit(lambda model, features: model.features_to_logits(features))
  np.testing.assert_allclose(to_logits(target, hidden), logits, atol=1e-4)
  row = 0  # prompt of 9 + the first token + 3 repeats: compare with no cache at all
  full = jnp.concatenate([prompt[row, :9], block[row]])[None]
  np.testing.assert_allclose(
    to_logits(target, hidden)[row : row + 1], full_logits(target, full)[:, -4:], atol=1e-4
  )


def test_a_protocol_drafter_may_propose_a_tree(target, prompts):
  """Any drafter that sets `tree` goes through the same step: its features come back
  along s[-1] and the accepted path, depth + 1 positions."""
  config = specjax.SpecConfig(gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY, verifier="tree")
  drafter = _Repeat(target.cfg.vocab_size, tree=(-1, -1, 0))
  state = jax.jit(
    lambda: specjax.generation.init_state(target, drafter, *prompts, jax.random.key(0), config)
  )()
  new = jax.jit(lambda s: specjax.speculative_step(target, drafter, s, config))(state)
  assert new.drafter_state.shape == (4, 3, target.cfg.d_model)
  logits, _ = forward_cached(target, state.recent[:, 1:], state.target_cache)
  to_logits = jax.jit(lambda model, features: model.features_to_logits(features))
  np.testing.assert_allclose(to_logits(target, new.drafter_state)[:, 0], logits[:, 0], atol=1e-4)

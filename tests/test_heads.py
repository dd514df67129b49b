"""Drafters that read the target (EAGLE, Medusa, early exit) through the one step.

Greedy decoding equals autoregressive decoding on a ragged batch; the heads'
state after a commit equals recomputing it from scratch over the committed
text, for fully accepted, partly accepted and finished rows; bad heads and
arguments are refused before compiling. Sampling exactness is in
test_distribution.py; training in test_head_training.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import forward_cached, head_drafter
from specjax import GREEDY
from specjax.drafting import Commit
from specjax.heads import config as head_config

MAX_NEW = 16


@pytest.mark.sample(
  "eagle-settings0-greedy", "medusa-settings2-block", "early_exit-settings3-greedy"
)
@pytest.mark.parametrize(
  "kind, settings, verifier",
  [
    ("eagle", {}, "greedy"),
    ("eagle", {"feature_layers": (1, 2)}, "token"),  # EAGLE-3-style fused features
    ("medusa", {"num_heads": 3}, "block"),
    ("early_exit", {"exit_layer": 1}, "greedy"),
    ("eagle", {"vocab_subset": 64}, "greedy"),  # FR-Spec: the 64 first ids only
  ],
)
def test_greedy_equals_autoregressive(target, prompts, greedy_reference, kind, settings, verifier):
  subset = settings.pop("vocab_subset", None)
  drafter = head_drafter(kind, target, **settings)
  if subset:
    drafter = drafter.with_vocab_subset(np.arange(subset))
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY, verifier=verifier
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  np.testing.assert_array_equal(out.num_generated, greedy_reference.num_generated)
  assert np.sum(out.stats.proposed) > 0


def test_a_vocabulary_subset_gives_the_heads_logits_there_and_minus_inf_elsewhere(target):
  features = jax.random.normal(jax.random.key(4), (3, target.cfg.d_model))
  ids = jnp.array([7, 1, 300], jnp.int32)
  full = target.features_to_logits(features)
  sub = target.features_to_logits(features, ids)
  np.testing.assert_allclose(sub[:, ids], full[:, ids], atol=1e-5)
  assert np.isneginf(np.delete(np.asarray(sub), np.asarray(ids), axis=1)).all()


def test_target_features_are_the_residual_stream(target, prompts):
  tokens, _ = prompts
  cache = target.init_cache(4, 16)
  logits, _, last = target.forward_cached(tokens, cache, return_hidden=True)
  _, _, both = target.forward_cached(tokens, cache, return_hidden=(1, 2))
  assert last.shape == (4, 9, target.cfg.d_model) and both.shape == (4, 9, 2 * target.cfg.d_model)
  np.testing.assert_allclose(both[..., target.cfg.d_model :], last, atol=1e-6)
  np.testing.assert_allclose(target.features_to_logits(last), logits, atol=1e-4)
  with pytest.raises(ValueError, match=r"return_hidden must be .* in \[1, 2\]"):
    target.forward_cached(tokens, cache, return_hidden=(3,))


@functools.partial(jax.jit, static_argnames=("gamma",))
def _commit_once(target, drafter, tokens, lengths, kept, goes_on, *, gamma):
  """One draft and commit from the prompts' state, compiled as one program:
  (drafter state before, after, the state's `recent` ids, the emitted block)."""
  config = specjax.SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW, sampling=GREEDY)
  state = specjax.generation.init_state(target, drafter, tokens, lengths, jax.random.key(0), config)
  b = kept.shape[0]
  block = jnp.concatenate(
    [state.recent[:, 1:], jax.random.randint(jax.random.key(8), (b, gamma), 0, 512)], axis=1
  )
  _, _, hidden = target.forward_cached(
    block, state.target_cache, return_hidden=drafter.target_features
  )
  old = state.target_cache.lengths + 1
  emitted = jnp.concatenate([block[:, 1:], jnp.full((b, 1), 5, jnp.int32)], axis=1)  # [B, g+1]
  commit = Commit(emitted, old, old + kept, goes_on, hidden)
  # Drafting first writes the head's cache past s; the commit must overwrite it.
  _, drafted = drafter.propose(
    state.drafter_state,
    state.recent,
    jax.random.key(1),
    jnp.full((b,), gamma),
    gamma=gamma,
    sampling=GREEDY,
  )
  return state.drafter_state, drafter.commit(drafted, commit), state.recent, emitted


def _committed(target, drafter, prompts, gamma, kept, goes_on):
  """The drafter's state after one commit in which row b kept `kept[b]` tokens,
  and the committed sequences s' (lists of ids)."""
  b = len(kept)
  old_state, new_state, recent, emitted = _commit_once(
    target,
    drafter,
    *prompts,
    jnp.asarray(kept, jnp.int32),
    jnp.asarray(goes_on),
    gamma=gamma,
  )
  emitted, recent = np.asarray(emitted), np.asarray(recent)
  tokens, lengths = map(np.asarray, prompts)
  sequences = []
  for row in range(b):
    s = list(tokens[row, : lengths[row]]) + [int(recent[row, 1])]
    if goes_on[row]:
      s += list(emitted[row, : int(kept[row])])
    sequences.append(s)
  return old_state, new_state, sequences


def _scratch_features(target, drafter, sequence, width):
  """The target's features `[1, width - 1, F]` over `sequence` (all but its last
  token) from scratch, right-padded to `width` tokens: one shape for every row
  (a causal model's features at a position ignore what follows it)."""
  ids = np.zeros((1, width - 1), np.int32)
  ids[0, : len(sequence) - 1] = sequence[:-1]
  cache = target.init_cache(1, width)
  return forward_cached(target, jnp.asarray(ids), cache, return_hidden=drafter.target_features)[2]


@jax.jit
def _head_from_scratch(target, head, features, pairs, cache):
  return head.forward_cached(target, head.feature_space(features), pairs, cache)


# Row 0 keeps every drafted token and the bonus (full acceptance), row 1 one
# drafted token and a correction, row 2 only the correction, row 3 has stopped.
KEPT, GOES_ON = [4, 2, 1, 3], [True, True, True, False]


@pytest.mark.sample(1)
@pytest.mark.parametrize("settings", [{}, {"feature_layers": (1, 2)}])
def test_eagle_state_matches_recomputing_from_scratch(target, prompts, settings):
  drafter = head_drafter("eagle", target, **settings)
  old, new, sequences = _committed(target, drafter, prompts, 3, KEPT, GOES_ON)
  head = drafter.head
  width = max(map(len, sequences))
  for row, s in enumerate(sequences):
    if not GOES_ON[row]:
      assert int(new.cache.lengths[row]) == int(old.cache.lengths[row])
      np.testing.assert_array_equal(new.next_feature[row], old.next_feature[row])
      continue
    # Pairs (feature at t, token t + 1) for t < len(s') - 1, through a fresh head cache.
    features = _scratch_features(target, drafter, s, width)
    pairs = np.zeros((1, width - 1), np.int32)
    pairs[0, : len(s) - 1] = s[1:]
    predicted, cache = _head_from_scratch(
      target, head, features, jnp.asarray(pairs), head.init_cache(1, width)
    )
    n = len(s) - 1
    assert int(new.cache.lengths[row]) == n
    np.testing.assert_allclose(new.cache.k[0][row, :, :n], cache.k[0][0, :, :n], atol=1e-4)
    np.testing.assert_allclose(new.cache.v[0][row, :, :n], cache.v[0][0, :, :n], atol=1e-4)
    np.testing.assert_allclose(new.next_feature[row], predicted[0, n - 1], atol=1e-4)


def test_medusa_state_is_the_feature_before_the_last_token(target, prompts):
  drafter = head_drafter("medusa", target)
  old, new, sequences = _committed(target, drafter, prompts, 3, KEPT, GOES_ON)
  width = max(map(len, sequences))
  for row, s in enumerate(sequences):
    if not GOES_ON[row]:
      np.testing.assert_array_equal(new[row], old[row])
      continue
    features = _scratch_features(target, drafter, s, width)
    np.testing.assert_allclose(new[row], features[0, len(s) - 2], atol=1e-4)


def test_early_exit_shares_the_target_weights(target):
  drafter = head_drafter("early_exit", target, exit_layer=1)
  assert drafter.target is target  # the same parameters, no copy
  leaves = jax.tree.leaves(drafter.adapter)
  assert sum(x.size for x in leaves) < target.num_params / 2


def test_bad_heads_and_arguments_are_refused(target, prompts):
  other = target.cfg.replace(d_model=32, n_heads=2, n_kv_heads=1)
  wrong = head_drafter("eagle", specjax.Transformer(other, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"trained for another target: d_model 64 \(head trained"):
    specjax.heads.drafter(target, wrong.head)
  medusa = head_drafter("medusa", target, num_heads=2)
  with pytest.raises(ValueError, match=r"gamma must be in \[1, 2\] for 2 Medusa heads"):
    specjax.speculative_generate(
      target, medusa, *prompts, gamma=3, max_new_tokens=4, sampling=GREEDY
    )
  eagle = head_drafter("eagle", target)
  for ids in ([], [[1, 2]], [3, 3], [0, 512], [0.5]):
    with pytest.raises(ValueError, match=r"vocab_subset must be a non-empty 1-D array of distinct"):
      eagle.with_vocab_subset(ids)
  with pytest.raises(ValueError, match=r"exit_layer must be an int in \[1, 1\]"):
    head_config("early_exit", target.cfg, exit_layer=2)
  with pytest.raises(ValueError, match="kind must be one of"):
    head_config("hydra", target.cfg)
  with pytest.raises(ValueError, match=r"feature_layers must be distinct layer counts in \[1, 2\]"):
    head_config("eagle", target.cfg, feature_layers=(0, 2))


def test_head_config_files_one_reader_and_writer(tmp_path):
  """Every bundled head_config.json (a release before the per-kind settings wrote
  every kind's fields in one record) reads into its kind's own config, writes and
  reads back unchanged; a field no kind has, or an unknown kind, is one
  HeadConfigError naming the file."""
  import json
  import os

  from specjax import heads, pretrained

  for kind in heads.bundled():
    cfg = heads.read_config(os.path.join(pretrained.HEADS_DIR, kind))
    assert type(cfg) is heads.kind(kind).config
    assert heads.read_config(heads.write_config(str(tmp_path / kind), cfg)) == cfg
  with open(os.path.join(pretrained.HEADS_DIR, "eagle", heads.CONFIG_FILE)) as f:
    legacy = json.load(f)
  for bad, match in (
    ({**legacy, "heads_per_layer": 3}, r"has no settings \['heads_per_layer'\]"),
    ({**legacy, "kind": "hydra"}, "head kind must be one of"),
    ({**legacy, "d_ff": -1}, "d_ff must be an int >= 0"),
  ):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(heads.HeadConfigError, match=rf"{path} is not a head config: .*{match}"):
      heads.read_config(str(path))
  target = heads.read_config(os.path.join(pretrained.HEADS_DIR, "eagle")).target
  match = r"a medusa head has no settings \['exit_layer'\]"
  with pytest.raises(heads.HeadConfigError, match=match):
    heads.config("medusa", target, exit_layer=1)

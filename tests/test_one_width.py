"""A model drafter's iteration with one call site of its model (issue 72).

On an accelerator `ModelDrafter.propose` feeds `recent` inside its draft loop, the
model at width 2 on every trip (`CachedDrafting._propose_one_width`); on the CPU it
feeds `recent` before a width-1 loop. Both must propose the same tokens, laws,
lengths and calls; on an accelerator one iteration must trace the draft model at one
width only, so XLA holds one layout of its cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import specjax
from specjax import GREEDY, compiler_options
from specjax.drafting import ModelDrafter, layer_skip
from specjax.generation import SpecConfig, init_state, speculative_step

MAX_NEW = 14
WARM = specjax.SamplingParams(temperature=0.8, top_p=0.95)


def _drafter(name: str, target, draft, one_width: bool | None, **fields) -> ModelDrafter:
  if name == "layer_skip":
    return layer_skip(target, 1).replace(one_width=one_width, **fields)
  return ModelDrafter(draft, one_width=one_width, **fields)


@pytest.mark.sample("model-greedy-while", "layer_skip-warm-chunked")
@pytest.mark.parametrize("loop", ["while", "chunked"])
@pytest.mark.parametrize("warp", ["greedy", "warm"])
@pytest.mark.parametrize("name", ["model", "layer_skip"])
def test_one_width_decodes_what_two_widths_decode(target, draft, prompts, name, warp, loop):
  # The same key: the same draws, so the same text and statistics, call for call.
  sampling = GREEDY if warp == "greedy" else WARM
  outs = [
    specjax.speculative_generate(
      target,
      _drafter(name, target, draft, one_width),
      *prompts,
      gamma=3,
      max_new_tokens=MAX_NEW,
      sampling=sampling,
      key=jax.random.key(7),
      loop=loop,
    )
    for one_width in (False, True)
  ]
  two, one = outs
  np.testing.assert_array_equal(one.tokens, two.tokens)
  np.testing.assert_array_equal(one.num_generated, two.num_generated)
  assert one.stats.summary() == two.stats.summary()
  assert int(one.stats.draft_calls) > 0


@pytest.mark.sample("schedule")
@pytest.mark.parametrize("adaptive", ["schedule", "confidence"])
def test_one_width_keeps_the_row_limits_and_early_stop(target, draft, prompts, adaptive):
  # The schedule's per-row limits and the confidence threshold's early stop: rows
  # stop drafting at different trips (and the loop before gamma).
  outs = [
    specjax.speculative_generate(
      target,
      ModelDrafter(draft, one_width=one_width),
      *prompts,
      gamma=4,
      max_new_tokens=MAX_NEW,
      sampling=WARM,
      key=jax.random.key(2),
      adaptive=adaptive,
      confidence_threshold=0.3 if adaptive == "confidence" else None,
    )
    for one_width in (False, True)
  ]
  np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
  assert outs[1].stats.summary() == outs[0].stats.summary()


@struct.dataclass
class WidthRecorder(ModelDrafter):
  """A `ModelDrafter` that records the width of every model call it traces."""

  widths: list = struct.field(pytree_node=False, default_factory=list)

  def _forward(self, tokens, cache, logit_indices=None):
    self.widths.append(tokens.shape[1])
    return super()._forward(tokens, cache, logit_indices)


def _iteration_widths(target, draft, prompts, one_width: bool | None) -> list[int]:
  """The widths of the draft model calls one traced speculative iteration makes."""
  drafter = WidthRecorder(draft, one_width=one_width)
  config = SpecConfig(gamma=4, max_new_tokens=MAX_NEW, sampling=WARM)
  state = init_state(target, drafter, *prompts, jax.random.key(0), config)
  drafter.widths.clear()  # the prefill's
  jax.make_jaxpr(lambda s: speculative_step(target, drafter, s, config))(state)
  return drafter.widths


def test_an_iteration_traces_the_draft_model_at_one_width(target, draft, prompts):
  assert _iteration_widths(target, draft, prompts, one_width=True) == [2]
  # The CPU's form: `recent` at width 2, then the loop's width 1.
  assert _iteration_widths(target, draft, prompts, one_width=False) == [2, 1]


def test_one_width_is_chosen_by_the_platform(draft):
  drafter = ModelDrafter(draft)
  assert not drafter._runs_one_width()  # the tests run on the CPU
  for platform in ("gpu", "tpu"):
    with compiler_options.target_platform(platform):
      assert drafter._runs_one_width()
  with compiler_options.target_platform("gpu"):
    assert not drafter.replace(one_width=False)._runs_one_width()
  assert drafter.replace(one_width=True)._runs_one_width()


def test_one_width_proposal_matches_per_row_limits(target, draft, prompts):
  # `propose` itself, rows with limits 0..3 under a fixed trip count: the same
  # tokens, laws, lengths, calls and confidences from both forms.
  capacity = prompts[0].shape[1] + MAX_NEW + 5
  first = jnp.array([5, 6, 7, 8], jnp.int32)
  limit = jnp.array([0, 1, 3, 2], jnp.int32)
  recent = jnp.stack([prompts[0][jnp.arange(4), prompts[1] - 1], first], axis=1)

  def propose(one_width: bool):
    drafter = ModelDrafter(draft, one_width=one_width)
    state = drafter.init(*prompts, first, capacity)
    with specjax.drafting.fixed_trip_loops():
      return jax.jit(
        lambda s: drafter.propose(s, recent, jax.random.key(4), limit, gamma=3, sampling=WARM)
      )(state)

  (two, two_state), (one, one_state) = propose(False), propose(True)
  np.testing.assert_array_equal(one.lengths, [0, 1, 3, 2])
  np.testing.assert_array_equal(one.lengths, two.lengths)
  assert int(one.calls) == int(two.calls) == 3
  valid = np.arange(3)[None, :] < np.asarray(one.lengths)[:, None]
  np.testing.assert_array_equal(np.where(valid, one.tokens, 0), np.where(valid, two.tokens, 0))
  np.testing.assert_allclose(one.probs, two.probs, atol=1e-5)
  np.testing.assert_allclose(one.confidence, two.confidence, atol=1e-5)
  np.testing.assert_array_equal(one_state.lengths, two_state.lengths)

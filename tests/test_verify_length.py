"""Confidence-driven verification length (`specjax.generation.verify_length`).

The length an iteration verifies is chosen from the drafter's own confidence, and
must leave every verifier exact: a chi-square test of the token and block rules
with the choice made per sample (a batch of one: the choice leans on the row's
own drafts as much as it can), on context-dependent p and q tables; greedy and
coupled speculative text equal plain decoding's; and the choice really varies.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from test_distribution import PROMPT, exact_joint, pair  # noqa: F401 (pair: a V = 8 fixture)
from test_verify_exactness import (
  _ctx_rows,
  _draw,
  make_tables,
  num_contexts,
  target_joint,
  to_float32,
)

import specjax
from helpers import SIMULATION_COMPILER_OPTIONS, chisquare_pvalue, dspark_drafter, sequence_counts
from specjax import constraints as C
from specjax.bench.verify_costs import measure_verify_costs
from specjax.drafting import ModelDrafter
from specjax.generation import SpecConfig, init_state, speculative_step
from specjax.generation.verify_length import check_verify_lengths, choose_verify_length
from specjax.verify import block_verify, token_verify

NUM_SAMPLES = 10**6
_choose = jax.jit(choose_verify_length, static_argnames=("verify_lengths", "verify_costs"))
LENGTHS, COSTS = (1, 2, 3), (1.0, 1.05, 1.1)


def _argmax_rule(confidence, lengths, active, verify_lengths, verify_costs):
  """The rule that reads every position's survival (not a stopping time): biased."""
  survival = jnp.cumprod(confidence, axis=1)
  values = [
    jnp.sum(active * (1 + jnp.sum(survival[:, :k], axis=1))) / c
    for k, c in zip(verify_lengths, verify_costs)
  ]
  return jnp.argmax(jnp.stack(values)).astype(jnp.int32)


@functools.partial(
  jax.jit, static_argnames=("verifier", "rule"), compiler_options=SIMULATION_COMPILER_OPTIONS
)
def simulate(key, p_table, q_table, *, verifier, rule=choose_verify_length):
  """`NUM_SAMPLES` iterations (gamma = 3), each a batch of one: drafts from q, the
  confidence q(x_i), the verify length by `rule`, `verifier` on the cut chain,
  the target's completion to 4 tokens. Returns the histogram of the completed
  sequences and of the chosen lengths' indices."""
  vocab, gamma, n_samples = p_table.shape[-1], LENGTHS[-1], NUM_SAMPLES
  draft_key, verify_key, complete_key = jax.random.split(key, 3)
  drafts, q_rows, p_rows = [], [], []
  for k in jax.random.split(draft_key, gamma):
    rows = _ctx_rows(drafts, vocab, n_samples)
    q_rows.append(q_table[rows])
    p_rows.append(p_table[rows])
    drafts.append(_draw(k, q_table[rows]))
  p_rows.append(p_table[_ctx_rows(drafts, vocab, n_samples)])
  tokens, q, p = jnp.stack(drafts, 1), jnp.stack(q_rows, 1), jnp.stack(p_rows, 1)
  confidence = jnp.take_along_axis(q, tokens[..., None], axis=2)[..., 0]  # [N, g]
  one = jnp.ones((1,), bool)
  choose = lambda c: rule(c[None], jnp.full((1,), gamma), one, LENGTHS, COSTS)
  index = jax.vmap(choose)(confidence)
  results = [verifier(verify_key, tokens[:, :k], q[:, :k], p[:, : k + 1]) for k in LENGTHS]
  n = jnp.choose(index, [r.num_accepted for r in results], mode="clip")
  y = jnp.choose(index, [r.next_token for r in results], mode="clip")
  seq = []
  for j, k in enumerate(jax.random.split(complete_key, gamma + 1)):
    token = _draw(k, p_table[_ctx_rows(seq, vocab, n_samples)])
    token = jnp.where(j == n, y, token)
    if j < gamma:
      token = jnp.where(j < n, drafts[j], token)
    seq.append(token)
  code = _ctx_rows(seq, vocab, n_samples) - num_contexts(vocab, gamma)
  return jnp.bincount(code, length=vocab ** (gamma + 1)), jnp.bincount(index, length=len(LENGTHS))


@pytest.mark.parametrize("verifier", [token_verify, block_verify], ids=["token", "block"])
def test_verifiers_stay_exact_with_the_length_choice(verifier):
  (p32, q32), (p64, _) = to_float32(*make_tables("generic", 3, LENGTHS[-1], seed=3))
  counts, chosen = simulate(jax.random.key(1), p32, q32, verifier=verifier)
  assert np.all(np.asarray(chosen) > NUM_SAMPLES // 50)  # every length is chosen often
  assert chisquare_pvalue(np.asarray(counts), target_joint(p64, LENGTHS[-1])) > 1e-4


def test_a_rule_that_reads_later_drafts_is_caught():
  """The harness has the power to see the bias of choosing the length from every
  position's survival (why `choose_verify_length` is a stopping rule)."""
  (p32, q32), (p64, _) = to_float32(*make_tables("generic", 3, LENGTHS[-1], seed=3))
  counts, _ = simulate(jax.random.key(1), p32, q32, verifier=token_verify, rule=_argmax_rule)
  assert chisquare_pvalue(np.asarray(counts), target_joint(p64, LENGTHS[-1])) < 1e-6


@struct.dataclass
class _Hashed(ModelDrafter):
  """A draft model whose confidence is a hash of its drafted tokens (still the
  drafter's own information): on the tiny random models the verify length then
  changes from iteration to iteration."""

  def propose(self, *args, **kwargs):
    proposal, state = super().propose(*args, **kwargs)
    return proposal._replace(confidence=(proposal.tokens % 5) / 4.0), state


RUN_4 = dict(gamma=4, verify_lengths=(1, 2, 4), verify_costs=(1.0, 1.05, 1.1))
RUN = dict(RUN_4, max_new_tokens=16)


def _varied(stats):
  """The verify length varied: some iterations verified 4, some fewer."""
  verified, iterations = np.sum(stats.proposed), np.sum(stats.row_iterations)
  return iterations < verified < 4 * iterations


def test_greedy_text_equals_plain_greedy(target, draft, prompts, greedy_reference):
  out = specjax.speculative_generate(
    target, _Hashed(draft), *prompts, sampling=specjax.GREEDY, **RUN
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  np.testing.assert_array_equal(out.num_generated, greedy_reference.num_generated)
  assert _varied(out.stats)


def test_dspark_chains_verify_by_their_confidence_head(target, prompts, greedy_reference):
  """The confidence head's estimates (an untrained head: survival about 1/2 a
  position) choose the length; the text is plain greedy decoding's."""
  run = dict(RUN, gamma=3, verify_lengths=(1, 3), verify_costs=(1.0, 1.2))
  drafter = dspark_drafter(target)
  out = specjax.speculative_generate(target, drafter, *prompts, sampling=specjax.GREEDY, **run)
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)


def test_coupled_text_equals_plain_coupled_text(target, draft, prompts):
  keys = jax.random.split(jax.random.key(3), prompts[0].shape[0])
  sampling = specjax.SamplingParams(temperature=1.0)
  plain = specjax.autoregressive_generate(
    target, *prompts, max_new_tokens=16, sampling=sampling, key=keys
  )
  out = specjax.speculative_generate(
    target, _Hashed(draft), *prompts, sampling=sampling, key=keys, **RUN
  )
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert _varied(out.stats)


def test_low_confidence_rows_get_short_lengths_unless_verification_is_free():
  sure, unsure = jnp.full((1, 4), 0.9), jnp.full((1, 4), 0.05)
  lengths, active = jnp.full((1,), 4), jnp.ones((1,), bool)
  dear = (1.0, 1.3, 1.8)  # verifying 4 costs nearly twice verifying 1
  choose = functools.partial(_choose, lengths=lengths, active=active)
  assert int(choose(unsure, verify_lengths=(1, 2, 4), verify_costs=dear)) == 0
  assert int(choose(sure, verify_lengths=(1, 2, 4), verify_costs=dear)) == 2
  assert int(choose(unsure, verify_lengths=(1, 2, 4), verify_costs=(1.0, 1.0, 1.0))) == 2
  # Batch-wide: one likely row among unlikely ones earns the long length when it pays.
  batch = jnp.concatenate([sure, unsure, unsure])
  three = dict(lengths=jnp.full((3,), 4), active=jnp.ones((3,), bool))
  assert int(_choose(batch, **three, verify_lengths=(1, 4), verify_costs=(1, 1.2))) == 1
  # ... and only active rows count; a row that proposed 1 token gains nothing from more.
  idle = dict(lengths=jnp.array([4, 4, 4]), active=jnp.array([False, True, True]))
  assert int(_choose(batch, **idle, verify_lengths=(1, 4), verify_costs=(1, 1.2))) == 0
  short = dict(lengths=jnp.array([1, 4, 4]), active=jnp.ones((3,), bool))
  assert int(_choose(batch, **short, verify_lengths=(1, 4), verify_costs=(1, 1.2))) == 0


def test_the_model_drafter_verifies_all_when_free_and_one_when_dear(target, draft, prompts):
  """The draft model's own confidence (near uniform on the random tiny models)."""
  run = dict(RUN, sampling=specjax.GREEDY)
  free = specjax.speculative_generate(target, draft, *prompts, **{**run, "verify_costs": (1, 1, 1)})
  dear = specjax.speculative_generate(target, draft, *prompts, **{**run, "verify_costs": (1, 2, 4)})
  for out, verified in ((free, 4), (dear, 1)):
    np.testing.assert_array_equal(out.stats.proposed, verified * out.stats.row_iterations)


@pytest.mark.parametrize(
  "settings, match",
  [
    (dict(verify_lengths=(1, 2)), r"verify_lengths .* gamma=4"),
    (dict(verify_lengths=(2, 1, 4)), r"verify_lengths .* sorted"),
    (dict(verify_lengths=(0, 4)), r"verify_lengths .* \[1, gamma=4\]"),
    (dict(verify_lengths=(2, 4), verify_costs=(1.0,)), r"verify_costs must be 2 positive"),
    (dict(verify_lengths=(2, 4), verify_costs=(1.0, float("inf"))), r"verify_costs"),
    (dict(verify_lengths=(2, 4), verify_costs=(1.0, -1.0)), r"verify_costs"),
    (dict(verify_lengths=(2, 4)), r"verify_costs"),
    (dict(verify_costs=(1.0, 1.0)), r"verify_costs needs verify_lengths"),
    (dict(verify_lengths=(2, 4), verify_costs=(1, 1), draft="ngram"), r"NGramDrafter"),
  ],
)
def test_bad_settings_are_named_before_compiling(target, draft, prompts, settings, match):
  settings = dict(settings)
  if settings.pop("draft", None) == "ngram":
    draft = specjax.drafting.NGramDrafter(vocab_size=target.cfg.vocab_size)
  with pytest.raises(ValueError, match=match):
    specjax.speculative_generate(
      target, draft, *prompts, gamma=4, max_new_tokens=8, sampling=specjax.GREEDY, **settings
    )


def test_measured_costs_are_one_per_length(target, draft, prompts):
  costs = measure_verify_costs(target, draft, *prompts, gamma=2, lengths=(1, 2), runs=2)
  assert len(costs) == 2 and max(costs) == 1.0 and min(costs) > 0
  assert check_verify_lengths((1, 2), costs, 2) == ((1, 2), costs)


def test_constrained_greedy_text_is_unchanged(target, draft):
  words = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]  # 511: EOS
  regex = C.compile_constraint(C.Regex("[a-f]{2,9}(xy|z)"), words, [511], 512)
  rules = C.row_constraints([regex, None], 512)
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 2])
  run = dict(max_new_tokens=10, sampling=specjax.GREEDY, eos_id=511, constraints=rules)
  plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
  spec = specjax.speculative_generate(target, _Hashed(draft), prompts, lengths, **run, **RUN_4)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_a_cut_step_returns_logits_and_tokens_of_the_full_shape(target, draft, prompts):
  """`with_logits` (serving's log-probabilities): `[B, g+1, V]` and `[B, g+1]`
  whatever the length verified; the rows both score agree."""
  config = SpecConfig(gamma=4, max_new_tokens=8, sampling=specjax.GREEDY)
  state = jax.jit(init_state, static_argnames="config")(
    target, draft, *prompts, jax.random.key(0), config=config
  )
  step = jax.jit(speculative_step, static_argnames=("config", "with_logits"))
  cut = dataclasses.replace(config, verify_lengths=(1,), verify_costs=(1.0,))
  _, full_logits, _ = step(target, draft, state, config, with_logits=True)
  new, logits, emitted = step(target, draft, state, cut, with_logits=True)
  assert logits.shape == full_logits.shape and emitted.shape == (4, 5)
  np.testing.assert_allclose(logits[:, :2], full_logits[:, :2], atol=1e-4)
  np.testing.assert_array_equal(new.stats.proposed, 1)


@pytest.mark.sample("block")  # token verification: the chi-square test above, per sample
@pytest.mark.parametrize("verifier", ["token", "block"])
def test_sampled_text_through_the_cut_step_has_the_targets_law(pair, verifier):  # noqa: F811
  """End to end at temperature 1 (20,000 rows, V = 8): the proposal cut to one
  token (verifying 2 made dear) by `speculative_step` itself."""
  target, draft = pair
  sampling = specjax.SamplingParams(temperature=1.0)
  rows = 20_000
  prompts = jnp.tile(PROMPT, (rows, 1))
  lengths = jnp.full((rows,), len(PROMPT), jnp.int32)
  out = specjax.speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    gamma=2,
    max_new_tokens=3,
    sampling=sampling,
    key=jax.random.key(4),
    verifier=verifier,
    verify_lengths=(1, 2),
    verify_costs=(1.0, 5.0),
  )
  np.testing.assert_array_equal(out.stats.proposed, out.stats.row_iterations)  # cut to 1
  assert 0.05 < float(out.stats.acceptance_rate) < 0.95
  counts = sequence_counts(out.tokens, 8)
  assert chisquare_pvalue(counts, exact_joint(target, sampling)) > 1e-3

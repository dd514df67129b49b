"""Generation loops: greedy equivalence, ragged rows, EOS, determinism, no recompilation,
the chunked loop against the while loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import full_logits, head_drafter, traces
from specjax import GREEDY, trees
from specjax.drafting import TreeDrafter

SAMPLED = specjax.SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
MAX_NEW = 16


def test_autoregressive_greedy_matches_full_forward(target, prompts, greedy_reference):
  """Greedy cached decoding == argmax of a teacher-forced full forward, row by row."""
  tokens, lengths = prompts
  seqs = [
    np.concatenate([np.asarray(tokens[b, : lengths[b]]), np.asarray(greedy_reference.tokens[b])])
    for b in range(4)
  ]
  # One right-padded batch: a causal model's logits at a position ignore what follows.
  padded = np.zeros((4, max(map(len, seqs))), np.int32)
  for b, seq in enumerate(seqs):
    padded[b, : len(seq)] = seq
  logits = np.asarray(full_logits(target, jnp.asarray(padded)))
  for b in range(4):
    expected = np.argmax(logits[b], axis=-1)[lengths[b] - 1 : len(seqs[b]) - 1]
    np.testing.assert_array_equal(greedy_reference.tokens[b], expected)
  np.testing.assert_array_equal(greedy_reference.num_generated, [MAX_NEW] * 4)


@pytest.mark.sample("noisy_target-3", "independent-1", "self-5")
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("which", ["independent", "noisy_target", "self"])
def test_greedy_speculative_equals_autoregressive(
  request, target, draft, prompts, greedy_reference, gamma, which
):
  drafter = {
    "independent": draft,
    "self": target,
    "noisy_target": request.getfixturevalue("noisy_target"),
  }[which]
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=gamma, max_new_tokens=MAX_NEW, sampling=GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  np.testing.assert_array_equal(out.num_generated, greedy_reference.num_generated)
  stats = out.stats
  row_iters = np.asarray(stats.row_iterations)
  if which == "self":
    # A perfect draft: every iteration accepts all gamma and emits gamma + 1.
    iterations = -(-(MAX_NEW - 1) // (gamma + 1))
    assert int(stats.iterations) == iterations
    assert float(stats.acceptance_rate) == 1.0
    assert float(stats.tokens_per_iteration) == pytest.approx((MAX_NEW - 1) / iterations)
    np.testing.assert_array_equal(stats.accepted, row_iters * gamma)
    np.testing.assert_array_equal(stats.accepted_at_position, [row_iters.sum()] * gamma)
  if which == "noisy_target":
    assert 0 < float(stats.acceptance_rate) < 1  # ragged acceptance really happened
  # Bookkeeping identities hold for every draft.
  assert int(stats.target_calls) == int(stats.iterations) + 1
  assert int(stats.draft_calls) == gamma * int(stats.iterations) + 1
  np.testing.assert_array_equal(stats.generated, np.asarray(out.num_generated) - 1)
  accepted, evaluated = np.asarray(stats.accepted), np.asarray(stats.evaluated)
  assert np.all(evaluated >= accepted) and np.all(evaluated <= accepted + row_iters)
  hist = np.asarray(stats.accepted_at_position)
  assert hist.sum() == accepted.sum() and np.all(np.diff(hist) <= 0)


def test_eos_stops_rows_and_pads(target, noisy_target, prompts, greedy_reference):
  """A row stops right after its first EOS (kept, counted), any of a list of ids as
  checkpoints have; the rest is pad; tokens after an EOS inside an accepted block
  are dropped."""
  ref = np.asarray(greedy_reference.tokens)
  # Row 0 emits the first at index 5, row 1 the second at 3 (maybe other rows too).
  eos = [int(ref[0, 5]), int(ref[1, 3])]
  if eos[1] == eos[0]:
    eos = eos[:1]
  expected_n = []
  for b in range(4):
    hits = np.nonzero(np.isin(ref[b], eos))[0]
    expected_n.append(hits[0] + 1 if len(hits) else MAX_NEW)
  pad = 511
  for run in (
    lambda: specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, eos_id=eos, pad_id=pad
    ),
    lambda: specjax.speculative_generate(
      target,
      target,
      *prompts,
      gamma=4,
      max_new_tokens=MAX_NEW,
      sampling=GREEDY,
      eos_id=eos,
      pad_id=pad,
    ),
    lambda: specjax.speculative_generate(
      target,
      noisy_target,
      *prompts,
      gamma=3,
      max_new_tokens=MAX_NEW,
      sampling=GREEDY,
      eos_id=eos,
      pad_id=pad,
    ),
  ):
    out = run()
    np.testing.assert_array_equal(out.num_generated, expected_n)
    for b, n in enumerate(expected_n):
      np.testing.assert_array_equal(out.tokens[b, :n], ref[b, :n])
      assert np.all(np.asarray(out.tokens[b, n:]) == pad)


def test_budget_of_one_token(target, draft, prompts, greedy_reference):
  out = specjax.speculative_generate(
    target, draft, *prompts, gamma=2, max_new_tokens=1, sampling=GREEDY
  )
  np.testing.assert_array_equal(out.tokens[:, 0], greedy_reference.tokens[:, 0])
  assert int(out.stats.iterations) == 0


def test_same_key_same_output_different_key_different_output(target, draft, prompts):
  def run(seed):
    return specjax.speculative_generate(
      target,
      draft,
      *prompts,
      gamma=3,
      max_new_tokens=MAX_NEW,
      sampling=SAMPLED,
      key=jax.random.key(seed),
    )

  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.stats.accepted, b.stats.accepted)
  assert not np.array_equal(a.tokens, c.tokens)
  ar = [
    specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=MAX_NEW, sampling=SAMPLED, key=jax.random.key(s)
    )
    for s in (0, 0, 1)
  ]
  np.testing.assert_array_equal(ar[0].tokens, ar[1].tokens)
  assert not np.array_equal(ar[0].tokens, ar[2].tokens)


def test_no_recompilation_on_second_call(target, draft, prompts):
  """Same shapes and static settings: new prompts, lengths and keys reuse the program."""
  tokens, lengths = prompts
  kwargs = dict(gamma=3, max_new_tokens=MAX_NEW, sampling=SAMPLED)
  specjax.speculative_generate(target, draft, tokens, lengths, key=jax.random.key(0), **kwargs)
  specjax.autoregressive_generate(
    target, tokens, lengths, max_new_tokens=MAX_NEW, sampling=SAMPLED, key=jax.random.key(0)
  )
  other, other_lengths = (tokens + 1) % 512, lengths[::-1]
  keys = jax.random.key(9), jax.random.key(0)
  with traces() as traced:
    specjax.speculative_generate(target, draft, other, other_lengths, key=keys[0], **kwargs)
    specjax.autoregressive_generate(
      target, other, other_lengths, max_new_tokens=MAX_NEW, sampling=SAMPLED, key=keys[0]
    )
  assert not traced
  # A different static setting does compile a new program (the counter works).
  with traces() as traced:
    specjax.speculative_generate(
      target,
      draft,
      tokens,
      lengths,
      key=keys[1],
      gamma=2,
      max_new_tokens=MAX_NEW,
      sampling=SAMPLED,
    )
  assert traced["_speculative_program"] == 1


def test_speculative_step_is_pure(target, draft, prompts):
  """The step is a function of (models, state, config): same inputs, same state."""
  tokens, lengths = prompts
  config = specjax.SpecConfig(gamma=3, max_new_tokens=MAX_NEW, sampling=SAMPLED)
  state = jax.jit(
    lambda key: specjax.generation.init_state(target, draft, tokens, lengths, key, config)
  )(jax.random.key(3))
  step = jax.jit(lambda s: specjax.speculative_step(target, draft, s, config))
  a, b = step(state), step(state)
  a, b = (x.replace(keys=jax.random.key_data(x.keys)) for x in (a, b))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert np.all(np.asarray(a.num_generated) >= 2)
  np.testing.assert_array_equal(a.target_cache.lengths, lengths + a.num_generated - 1)
  np.testing.assert_array_equal(a.drafter_state.lengths, a.target_cache.lengths - 1)


@pytest.mark.slow  # bfloat16 models: tests/test_model.py, tests/test_hf.py
def test_bfloat16_models_generate(tiny_cfg, prompts):
  """The whole speculative loop runs in bfloat16 (probabilities stay float32)."""
  cfg = tiny_cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(cfg.replace(n_layers=1), rngs=nnx.Rngs(1))
  out = specjax.speculative_generate(
    target,
    draft,
    *prompts,
    gamma=3,
    max_new_tokens=MAX_NEW,
    sampling=SAMPLED,
    key=jax.random.key(0),
  )
  np.testing.assert_array_equal(out.num_generated, [MAX_NEW] * 4)
  assert np.all((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < 512))
  assert int(out.stats.iterations) >= (MAX_NEW - 1) // 4


def test_callable_inside_a_user_jit(target, noisy_target, prompts, greedy_reference):
  """Traced prompts skip the host value checks but give the same tokens."""
  run = jax.jit(
    lambda tokens, lengths: (
      specjax.speculative_generate(
        target, noisy_target, tokens, lengths, gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY
      ).tokens
    )
  )
  np.testing.assert_array_equal(run(*prompts), greedy_reference.tokens)


# The chunked loop (loop="chunked") against the while loop: 4 iterations per test
# divide neither run's iteration count, so idle iterations run after the last row.
CHUNK = 4


def _run_both(run, **kwargs):
  """`run(**kwargs)` with loop="while" and with loop="chunked" (chunk `CHUNK` unless given)."""
  chunk = kwargs.pop("loop_chunk", CHUNK)
  return run(loop="while", **kwargs), run(loop="chunked", loop_chunk=chunk, **kwargs)


def _assert_same_output(a, b, skip=()):
  """Tokens, counts and every statistic (but those named in `skip`) are equal."""
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.num_generated, b.num_generated)
  for name, value in vars(a.stats).items():
    if name not in skip:
      np.testing.assert_array_equal(value, getattr(b.stats, name), err_msg=name)


@pytest.mark.sample("ar-greedy", "model-sampled", "eagle-sampled", "tree-greedy")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["ar", "model", "eagle", "tree"])
def test_chunked_loop_equals_while_loop(target, draft, prompts, greedy_reference, name, sampled):
  """Same tokens, counts and statistics for the same key, with rows stopping at
  EOS at different iterations (idle iterations after the last one count nothing
  and draw no random number)."""
  ref = np.asarray(greedy_reference.tokens)
  kwargs = dict(
    max_new_tokens=MAX_NEW,
    sampling=SAMPLED if sampled else GREEDY,
    key=jax.random.key(3),
    eos_id=[int(ref[0, 5]), int(ref[1, 3])],  # rows 0 and 1 stop early when greedy
  )
  if name == "ar":
    run = lambda **kw: specjax.autoregressive_generate(target, *prompts, **kw, **kwargs)
  else:
    tree = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])
    drafter, gamma = {
      "model": (draft, 3),
      "eagle": (head_drafter("eagle", target), 3),
      "tree": (TreeDrafter(draft, tree), len(tree)),
    }[name]
    run = lambda **kw: specjax.speculative_generate(
      target, drafter, *prompts, gamma=gamma, **kw, **kwargs
    )
  a, b = _run_both(run)
  _assert_same_output(a, b)
  if not sampled:
    assert len(set(np.asarray(a.num_generated).tolist())) > 1  # rows stopped unevenly
    assert int(a.stats.iterations) % CHUNK  # idle iterations ran after the last row


def test_chunked_loop_of_one_iteration_and_of_no_iteration(target, noisy_target, prompts):
  """A chunk of 1 is the while loop's schedule; a budget of one token runs no
  iteration (every row is done after the prefill) in either loop."""
  kwargs = dict(gamma=3, sampling=SAMPLED, key=jax.random.key(5))
  run = lambda **kw: specjax.speculative_generate(target, noisy_target, *prompts, **kw, **kwargs)
  _assert_same_output(*_run_both(run, max_new_tokens=MAX_NEW, loop_chunk=1))
  a, b = _run_both(run, max_new_tokens=1)
  _assert_same_output(a, b)
  assert int(b.stats.iterations) == 0


def test_chunked_loop_with_adaptive_draft_lengths(target, noisy_target, prompts):
  """With draft lengths that stop short of gamma, the chunked loop's drafter runs
  all gamma draft calls (a loop of known trip count): the same tokens, with
  draft_calls counting the calls made."""
  kwargs = dict(gamma=4, max_new_tokens=MAX_NEW, sampling=SAMPLED, key=jax.random.key(1))
  run = lambda **kw: specjax.speculative_generate(
    target, noisy_target, *prompts, adaptive="confidence", confidence_threshold=0.5, **kw, **kwargs
  )
  a, b = _run_both(run)
  _assert_same_output(a, b, skip=("draft_calls",))
  assert int(b.stats.draft_calls) == 4 * int(b.stats.iterations) + 1
  assert int(a.stats.draft_calls) < int(b.stats.draft_calls)


def test_chunked_loop_does_not_recompile(target, draft, prompts):
  """New prompts, lengths and keys of the same shapes reuse the chunked programs."""
  tokens, lengths = prompts
  kwargs = dict(max_new_tokens=MAX_NEW, sampling=SAMPLED, loop="chunked", loop_chunk=CHUNK)
  calls = (
    lambda t, n, k: specjax.speculative_generate(target, draft, t, n, gamma=3, key=k, **kwargs),
    lambda t, n, k: specjax.autoregressive_generate(target, t, n, key=k, **kwargs),
  )
  for call in calls:
    call(tokens, lengths, jax.random.key(0))
  other, other_lengths, key = (tokens + 1) % 512, lengths[::-1], jax.random.key(9)
  with traces() as traced:
    for call in calls:
      call(other, other_lengths, key)
  assert not traced
  with traces() as traced:  # another chunk size is another program (the counter works)
    specjax.autoregressive_generate(
      target, tokens, lengths, key=jax.random.key(0), **kwargs | {"loop_chunk": 3}
    )
  assert traced["_autoregressive_program"] == 1


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(loop="for"), r"loop must be one of \('while', 'chunked'\), got 'for'"),
    (dict(loop=None), r"loop must be one of \('while', 'chunked'\), got None"),
    (dict(loop="chunked", loop_chunk=0), "loop_chunk must be an integer >= 1, got 0"),
    (dict(loop_chunk=2.0), "loop_chunk must be an integer >= 1, got 2.0"),
  ],
)
def test_loop_arguments_are_checked(target, draft, prompts, overrides, message):
  for run in (
    lambda: specjax.speculative_generate(
      target, draft, *prompts, gamma=3, max_new_tokens=MAX_NEW, sampling=GREEDY, **overrides
    ),
    lambda: specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, **overrides
    ),
  ):
    with pytest.raises(ValueError, match=message):
      run()

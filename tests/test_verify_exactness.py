"""Exactness of the verifiers: speculative decoding must emit the target's distribution.

Three layers of evidence for `token_verify`:

* An independent float64 numpy reference enumerates every outcome of one
  speculative iteration on a tiny vocabulary with context-dependent p and q
  (tables indexed by the drafted prefix) and proves the rule exact: the emitted
  tokens, completed to length gamma+1 by sampling the target, have exactly the
  target's joint distribution prod_j p(w_j | w_<j).
* The jitted `token_verify`, run on 10^6 samples drawn entirely in JAX, passes
  a chi-square goodness-of-fit test against that joint distribution, and its
  acceptance lengths match the reference's.
* With context-independent p and q, P(num_accepted >= k) = beta^k where
  beta = sum_x min(p(x), q(x)).

`greedy_verify` gets a hand-built deterministic check, and `token_verify` with
one-hot p and q (temperature 0) must agree with it.
"""

import functools
import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SIMULATION_COMPILER_OPTIONS, chisquare_pvalue
from specjax.verify import block_verify, greedy_verify, token_verify

CASES = ["generic", "one_hot_q", "p_equals_q", "disjoint_supports", "q_zeros_where_p_positive"]
NUM_SAMPLES = 10**6
MIN_PVALUE = 1e-4


# ---------------------------------------------------------------------------
# Context-dependent distributions: one row of p and q per drafted prefix.
# ---------------------------------------------------------------------------


def num_contexts(vocab, gamma):
  """Prefixes of length 0..gamma: every context a length-(gamma+1) sequence needs."""
  return (vocab ** (gamma + 1) - 1) // (vocab - 1)


def ctx_index(prefix, vocab):
  """Row of the tables for `prefix`: prefixes grouped by length, then base-`vocab` order."""
  value = 0
  for token in prefix:
    value = value * vocab + token
  return (vocab ** len(prefix) - 1) // (vocab - 1) + value


def make_tables(case, vocab, gamma, seed):
  """Random float64 tables `p, q` of shape `[num_contexts, vocab]` for one edge case."""
  rng = np.random.default_rng(seed)
  rows = num_contexts(vocab, gamma)
  p = rng.dirichlet(np.ones(vocab), size=rows)
  if case == "generic":
    q = rng.dirichlet(np.ones(vocab), size=rows)
  elif case == "one_hot_q":
    q = np.eye(vocab)[rng.integers(vocab, size=rows)]
  elif case == "p_equals_q":
    q = p.copy()
  elif case == "disjoint_supports":
    # Per context, p lives on the first k tokens of a random order and q on the rest;
    # k >= 2 keeps the target joint spread over many sequences (vocab >= 3).
    p, q = np.zeros((rows, vocab)), np.zeros((rows, vocab))
    for r in range(rows):
      order, k = rng.permutation(vocab), rng.integers(2, vocab)
      p[r, order[:k]] = rng.dirichlet(np.ones(k))
      q[r, order[k:]] = rng.dirichlet(np.ones(vocab - k))
  elif case == "q_zeros_where_p_positive":
    # p has full support; q misses one or more tokens (the residual must cover them).
    q = rng.dirichlet(np.ones(vocab), size=rows)
    for r in range(rows):
      q[r, rng.permutation(vocab)[: rng.integers(1, vocab)]] = 0.0
    q /= q.sum(axis=-1, keepdims=True)
  else:
    raise ValueError(case)
  return p, q


def context_free_tables(vocab, gamma, seed):
  """The same random p and q at every position (so acceptance is geometric)."""
  rng = np.random.default_rng(seed)
  rows = num_contexts(vocab, gamma)
  p, q = rng.dirichlet(np.ones(vocab), size=2)
  return np.tile(p, (rows, 1)), np.tile(q, (rows, 1))


def to_float32(p, q):
  """The float32 tables JAX sees, and float64 copies of exactly them for the reference."""
  p32, q32 = p.astype(np.float32), q.astype(np.float32)
  as64 = lambda t: t.astype(np.float64) / t.astype(np.float64).sum(axis=-1, keepdims=True)
  return (p32, q32), (as64(p32), as64(q32))


# ---------------------------------------------------------------------------
# Independent float64 reference: exact enumeration of one iteration.
# ---------------------------------------------------------------------------


def reference_emitted(p_table, q_table, gamma):
  """Exact distribution of one iteration's emitted tokens (x_1..x_n, y) as {tuple: prob}.

  Walks the draft tree: at a prefix, each x is drafted with q(x) and kept with
  min(1, p(x)/q(x)); the rejected mass emits y ~ normalize(max(0, p - q))
  (or p if that is all zero); after gamma accepted drafts a bonus y ~ p.
  """
  vocab = p_table.shape[-1]
  emitted = defaultdict(float)

  def expand(prefix, weight):
    p = p_table[ctx_index(prefix, vocab)]
    if len(prefix) == gamma:
      for y in range(vocab):
        emitted[prefix + (y,)] += weight * p[y]
      return
    q = q_table[ctx_index(prefix, vocab)]
    rejected = 0.0
    for x in range(vocab):
      if q[x] == 0:
        continue  # never drafted
      accept = min(1.0, p[x] / q[x])
      expand(prefix + (x,), weight * q[x] * accept)
      rejected += weight * q[x] * (1.0 - accept)
    residual = np.maximum(p - q, 0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    for y in range(vocab):
      emitted[prefix + (y,)] += rejected * residual[y]

  expand((), 1.0)
  return dict(emitted)


def complete_with_target(emitted, p_table, gamma):
  """Extends each emitted prefix to length gamma+1 by target sampling -> `[V]*(gamma+1)` joint."""
  vocab = p_table.shape[-1]
  joint = np.zeros((vocab,) * (gamma + 1))
  for prefix, mass in emitted.items():
    for tail in itertools.product(range(vocab), repeat=gamma + 1 - len(prefix)):
      seq, weight = prefix + tail, mass
      for j in range(len(prefix), gamma + 1):
        weight *= p_table[ctx_index(seq[:j], vocab)][seq[j]]
      joint[seq] += weight
  return joint


def target_joint(p_table, gamma):
  """The target's own joint prod_j p(w_j | w_<j): completing the empty prefix."""
  return complete_with_target({(): 1.0}, p_table, gamma)


def acceptance_distribution(emitted, gamma):
  """P(num_accepted = k), k = 0..gamma: an emitted prefix of length k+1 accepted k drafts."""
  dist = np.zeros(gamma + 1)
  for prefix, mass in emitted.items():
    dist[len(prefix) - 1] += mass
  return dist


# ---------------------------------------------------------------------------
# The JAX sampling pipeline: draft, verify, complete - one jit.
# ---------------------------------------------------------------------------


def _ctx_rows(prefix, vocab, num_samples):
  """`ctx_index` for a batch: `prefix` is a list of `[N]` int32 token columns -> `[N]`."""
  value = jnp.zeros((num_samples,), jnp.int32)
  for token in prefix:
    value = value * vocab + token
  return (vocab ** len(prefix) - 1) // (vocab - 1) + value


def _draw(key, probs):
  # Drawn with jax.random directly (not specjax.sampling) so the pipeline is independent.
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


@functools.partial(
  jax.jit,
  static_argnames=("gamma", "num_samples", "verifier"),
  compiler_options=SIMULATION_COMPILER_OPTIONS,
)
def simulate(key, p_table, q_table, *, gamma, num_samples, verifier=token_verify):
  """Runs `num_samples` independent iterations of draft + `verifier` + target completion.

  Returns:
    `(sequence_counts [V**(gamma+1)], accepted_counts [gamma+1])`: histograms of
    the completed length-(gamma+1) sequence (base-V code) and of num_accepted.
  """
  vocab = p_table.shape[-1]
  draft_key, verify_key, complete_key = jax.random.split(key, 3)

  drafts, q_rows, p_rows = [], [], []
  for k in jax.random.split(draft_key, gamma):
    rows = _ctx_rows(drafts, vocab, num_samples)
    q_rows.append(q_table[rows])
    p_rows.append(p_table[rows])
    drafts.append(_draw(k, q_table[rows]))
  p_rows.append(p_table[_ctx_rows(drafts, vocab, num_samples)])
  result = verifier(verify_key, jnp.stack(drafts, 1), jnp.stack(q_rows, 1), jnp.stack(p_rows, 1))
  n, y = result.num_accepted, result.next_token

  # Emitted x_1..x_n, y; positions after n+1 are filled by sampling the target.
  seq = []
  for j, k in enumerate(jax.random.split(complete_key, gamma + 1)):
    token = _draw(k, p_table[_ctx_rows(seq, vocab, num_samples)])
    token = jnp.where(j == n, y, token)
    if j < gamma:
      token = jnp.where(j < n, drafts[j], token)
    seq.append(token)
  # Row of a length-(gamma+1) prefix minus the rows of shorter ones: its base-V code.
  code = _ctx_rows(seq, vocab, num_samples) - num_contexts(vocab, gamma)
  return (jnp.bincount(code, length=vocab ** (gamma + 1)), jnp.bincount(n, length=gamma + 1))


def run_simulation(p32, q32, gamma, seed, verifier=token_verify):
  counts, accepted = simulate(
    jax.random.key(seed),
    jnp.asarray(p32),
    jnp.asarray(q32),
    gamma=gamma,
    num_samples=NUM_SAMPLES,
    verifier=verifier,
  )
  return np.asarray(counts, np.int64), np.asarray(accepted, np.int64)


# ---------------------------------------------------------------------------
# (c-i) The rule itself, exactly, in float64.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_reference_enumeration_equals_target_joint(case, gamma):
  """The speculative rule, enumerated exactly, reproduces the target's joint to 1e-9."""
  p, q = make_tables(case, vocab=4, gamma=gamma, seed=100 + gamma)
  emitted = reference_emitted(p, q, gamma)
  assert abs(sum(emitted.values()) - 1.0) < 1e-12
  np.testing.assert_allclose(
    complete_with_target(emitted, p, gamma), target_joint(p, gamma), rtol=0, atol=1e-9
  )
  accepted = acceptance_distribution(emitted, gamma)
  # Edge cases with a known acceptance length: everything / nothing is accepted.
  if case == "p_equals_q":
    assert accepted[gamma] == pytest.approx(1.0, abs=1e-12)
  if case == "disjoint_supports":
    assert accepted[0] == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------
# (c-ii) The jitted verifier, statistically.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [2, 3])
def test_token_verify_matches_target_joint(case, gamma):
  """10^6 jitted iterations: completed sequences fit the target joint, acceptance fits the rule."""
  vocab, seed = 3, 10 * gamma + CASES.index(case)
  (p32, q32), (p64, q64) = to_float32(*make_tables(case, vocab, gamma, seed))
  counts, accepted = run_simulation(p32, q32, gamma, seed)

  assert counts.sum() == NUM_SAMPLES
  assert chisquare_pvalue(counts, target_joint(p64, gamma)) > MIN_PVALUE
  # Output-equivalent but wrong rules (e.g. always reject and sample p) would pass
  # the joint test; the acceptance lengths pin down the rule itself.
  expected_accepted = acceptance_distribution(reference_emitted(p64, q64, gamma), gamma)
  assert chisquare_pvalue(accepted, expected_accepted) > MIN_PVALUE
  if case == "p_equals_q":
    assert accepted[gamma] == NUM_SAMPLES
  if case == "disjoint_supports":
    assert accepted[0] == NUM_SAMPLES


# ---------------------------------------------------------------------------
# (d) Geometric acceptance for context-independent p and q.
# ---------------------------------------------------------------------------


def test_reference_acceptance_is_geometric():
  """Exact enumeration: P(num_accepted >= k) = beta^k, beta = sum_x min(p, q), to 1e-12."""
  for gamma in (1, 2, 3):
    p, q = context_free_tables(vocab=4, gamma=gamma, seed=7)
    beta = np.minimum(p[0], q[0]).sum()
    tail = np.cumsum(acceptance_distribution(reference_emitted(p, q, gamma), gamma)[::-1])[::-1]
    np.testing.assert_allclose(tail, beta ** np.arange(gamma + 1), rtol=0, atol=1e-12)


def test_token_verify_acceptance_is_geometric():
  """10^6 jitted iterations: P(num_accepted >= k) within 5 standard errors of beta^k."""
  gamma, vocab = 3, 3
  (p32, q32), (p64, q64) = to_float32(*context_free_tables(vocab, gamma, seed=11))
  counts, accepted = run_simulation(p32, q32, gamma, seed=11)
  beta = np.minimum(p64[0], q64[0]).sum()
  assert 0.2 < beta < 0.9  # a non-degenerate case, so every k carries information
  tail = np.cumsum(accepted[::-1])[::-1] / NUM_SAMPLES
  expected = beta ** np.arange(gamma + 1)
  stderr = np.sqrt(expected * (1 - expected) / NUM_SAMPLES)
  np.testing.assert_array_less(np.abs(tail - expected), 5 * stderr + 1e-12)
  assert chisquare_pvalue(counts, target_joint(p64, gamma)) > MIN_PVALUE


# ---------------------------------------------------------------------------
# Greedy verification.
# ---------------------------------------------------------------------------


def test_greedy_verify_hand_built():
  """Argmax matching: all match -> bonus = last row's argmax; else the argmax at the mismatch."""
  argmaxes = np.array(
    [
      [2, 0, 4, 1],  # drafts all match -> n = 3, bonus = 1
      [2, 0, 4, 1],  # first draft wrong -> n = 0, next = 2
      [3, 3, 0, 2],
    ]
  )  # second draft wrong -> n = 1, next = 3
  drafts = np.array([[2, 0, 4], [1, 0, 4], [3, 1, 0]], np.int32)
  target = np.full((3, 4, 5), 0.1, np.float32)
  np.put_along_axis(target, argmaxes[..., None], 0.6, axis=-1)
  draft_probs = np.full((3, 3, 5), 0.2, np.float32)
  result = greedy_verify(
    jax.random.key(0), jnp.asarray(drafts), jnp.asarray(draft_probs), jnp.asarray(target)
  )
  np.testing.assert_array_equal(result.num_accepted, [3, 0, 1])
  np.testing.assert_array_equal(result.next_token, [1, 2, 3])


def test_token_verify_with_one_hot_equals_greedy():
  """Temperature 0 (one-hot p and q): the exact rule reduces to argmax matching."""
  batch, gamma, vocab = 512, 4, 6
  rng = np.random.default_rng(3)
  drafts = rng.integers(vocab, size=(batch, gamma)).astype(np.int32)
  # The target agrees with the draft ~70% of the time, so every n in 0..gamma occurs.
  best = rng.integers(vocab, size=(batch, gamma + 1))
  best[:, :gamma] = np.where(rng.random((batch, gamma)) < 0.7, drafts, best[:, :gamma])
  draft_probs = jnp.asarray(np.eye(vocab, dtype=np.float32)[drafts])
  target_probs = jnp.asarray(np.eye(vocab, dtype=np.float32)[best])
  greedy = jax.jit(greedy_verify)(None, jnp.asarray(drafts), draft_probs, target_probs)
  assert len(set(np.asarray(greedy.num_accepted).tolist())) == gamma + 1
  exact_verify = jax.jit(token_verify)  # one program, not one per eager op
  for seed in range(3):
    exact = exact_verify(jax.random.key(seed), jnp.asarray(drafts), draft_probs, target_probs)
    np.testing.assert_array_equal(exact.num_accepted, greedy.num_accepted)
    np.testing.assert_array_equal(exact.next_token, greedy.next_token)


def test_token_verify_guards():
  """A draft with q(x) = 0 is rejected, and a zero residual (p == q) falls back to p.

  Neither can happen with honest drafts, so the statistical tests cannot see them.
  """
  vocab, batch = 4, 256
  p = np.array([0.1, 0.6, 0.2, 0.1], np.float32)
  q_zero_at_0 = np.array([0.0, 0.6, 0.2, 0.2], np.float32)
  one_hot_1 = np.eye(vocab, dtype=np.float32)[1]
  # Row 0: p(0) > 0 = q(0), which u * q < p alone would accept.
  # Row 1: p == q one-hot at 1, so max(0, p - q) is all zero and y must come from p.
  draft_probs = np.stack([q_zero_at_0, one_hot_1])[:, None]  # [2, 1, V]
  target_probs = np.stack([[p, p], [one_hot_1, one_hot_1]])  # [2, 2, V]
  tile = lambda a: jnp.asarray(np.repeat(a, batch // 2, axis=0))
  result = token_verify(
    jax.random.key(5), tile(np.zeros((2, 1), np.int32)), tile(draft_probs), tile(target_probs)
  )
  np.testing.assert_array_equal(result.num_accepted, 0)
  # Row 0's correction comes from max(0, p - q) = [0.1, 0, 0, 0]: token 0.
  np.testing.assert_array_equal(result.next_token[: batch // 2], 0)
  np.testing.assert_array_equal(result.next_token[batch // 2 :], 1)


# ---------------------------------------------------------------------------
# Block verification (Sun et al. 2024): the same three layers of evidence.
# ---------------------------------------------------------------------------


def reference_block_emitted(p_table, q_table, gamma):
  """Exact distribution of one block-verification iteration's emitted tokens, float64.

  Enumerates every draft x_1..x_gamma (probability prod q), computes the
  weights p_i and coin probabilities h_i, and the law of tau (the last heads
  among independent coins): P(tau = i) = h_i prod_{j > i} (1 - h_j).
  """
  vocab = p_table.shape[-1]
  emitted = defaultdict(float)
  for draft in itertools.product(range(vocab), repeat=gamma):
    prefixes = [draft[:i] for i in range(gamma + 1)]
    p_rows = [p_table[ctx_index(c, vocab)] for c in prefixes]
    q_rows = [q_table[ctx_index(c, vocab)] for c in prefixes[:gamma]]
    weight = np.prod([q_rows[i][draft[i]] for i in range(gamma)])
    if weight == 0:
      continue
    w = [1.0]
    for i in range(gamma):
      w.append(min(1.0, w[-1] * p_rows[i][draft[i]] / q_rows[i][draft[i]]))
    residuals, h = [], []
    for i in range(gamma):
      residuals.append(np.maximum(w[i] * p_rows[i] - q_rows[i], 0.0))
      if i > 0:
        s = residuals[i].sum()
        h.append(s / (s + 1 - w[i]) if s + 1 - w[i] > 0 else 1.0)
    h.append(w[gamma])  # h_1..h_gamma
    for tau in range(gamma + 1):
      prob = (h[tau - 1] if tau else 1.0) * np.prod([1 - x for x in h[tau:]])
      if prob == 0:
        continue
      if tau == gamma:
        dist = p_rows[gamma]
      else:
        r = residuals[tau]
        dist = r / r.sum() if r.sum() > 0 else p_rows[tau]
      for y in range(vocab):
        emitted[draft[:tau] + (y,)] += weight * prob * dist[y]
  return dict(emitted)


def expected_accepted(emitted):
  return sum((len(prefix) - 1) * mass for prefix, mass in emitted.items())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_block_reference_equals_target_joint(case, gamma):
  """Block verification, enumerated exactly, reproduces the target's joint to 1e-9,
  and never accepts fewer tokens in expectation than token verification."""
  p, q = make_tables(case, vocab=4, gamma=gamma, seed=200 + gamma)
  emitted = reference_block_emitted(p, q, gamma)
  assert abs(sum(emitted.values()) - 1.0) < 1e-12
  np.testing.assert_allclose(
    complete_with_target(emitted, p, gamma), target_joint(p, gamma), rtol=0, atol=1e-9
  )
  assert expected_accepted(emitted) >= expected_accepted(reference_emitted(p, q, gamma)) - 1e-12


def test_block_beats_token_on_random_context_dependent_tables():
  gains = []
  for seed in range(8):
    p, q = make_tables("generic", vocab=3, gamma=3, seed=300 + seed)
    block = expected_accepted(reference_block_emitted(p, q, 3))
    token = expected_accepted(reference_emitted(p, q, 3))
    assert block >= token - 1e-12
    gains.append(block - token)
  assert max(gains) > 1e-3  # a real gain, not only equality


def test_block_paper_toy_example():
  """Sun et al.'s binary example: p = (1/3, 2/3), q = (2/3, 1/3) at every position,
  gamma = 2: token verification accepts 10/9 tokens in expectation, block 11/9."""
  rows = num_contexts(2, 2)
  p = np.tile([1 / 3, 2 / 3], (rows, 1))
  q = np.tile([2 / 3, 1 / 3], (rows, 1))
  assert expected_accepted(reference_emitted(p, q, 2)) == pytest.approx(10 / 9, abs=1e-12)
  assert expected_accepted(reference_block_emitted(p, q, 2)) == pytest.approx(11 / 9, abs=1e-12)
  (p32, q32), _ = to_float32(p, q)
  _, accepted = run_simulation(p32, q32, 2, seed=5, verifier=block_verify)
  mean = (accepted * np.arange(3)).sum() / NUM_SAMPLES
  assert abs(mean - 11 / 9) < 5 * 0.8 / np.sqrt(NUM_SAMPLES)  # sd of tau < 0.8


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [2, 3])
def test_block_verify_matches_target_joint(case, gamma):
  """10^6 jitted block-verification iterations fit the target joint and the
  reference law of the accepted length."""
  vocab, seed = 3, 50 + 10 * gamma + CASES.index(case)
  (p32, q32), (p64, q64) = to_float32(*make_tables(case, vocab, gamma, seed))
  counts, accepted = run_simulation(p32, q32, gamma, seed, verifier=block_verify)
  assert counts.sum() == NUM_SAMPLES
  assert chisquare_pvalue(counts, target_joint(p64, gamma)) > MIN_PVALUE
  expected = acceptance_distribution(reference_block_emitted(p64, q64, gamma), gamma)
  assert chisquare_pvalue(accepted, expected) > MIN_PVALUE
  if case == "p_equals_q":
    assert accepted[gamma] == NUM_SAMPLES
  if case == "disjoint_supports":
    assert accepted[0] == NUM_SAMPLES


def test_expected_accepted_closed_forms_match_enumeration():
  """specjax.verify.expected's closed forms equal the enumerated expectations on
  the paper's toy example (10/9 and 11/9), averaged over the drafted blocks."""
  from specjax.verify.expected import expected_accepted

  p, q = np.array([1 / 3, 2 / 3]), np.array([2 / 3, 1 / 3])
  drafts = np.array(list(itertools.product(range(2), repeat=2)), np.int32)  # all 4 blocks
  weight = np.prod(q[drafts], axis=1)
  target_probs = jnp.asarray(np.tile(p, (4, 3, 1)), jnp.float32)
  draft_probs = jnp.asarray(np.tile(q, (4, 2, 1)), jnp.float32)
  for rule, value in (("token", 10 / 9), ("block", 11 / 9)):
    per_block = np.asarray(expected_accepted(rule, jnp.asarray(drafts), draft_probs, target_probs))
    assert float(np.sum(weight * per_block)) == pytest.approx(value, abs=1e-6)

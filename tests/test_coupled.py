"""Coupled (Gumbel-max) verification: exact, and the text a function of (key, prompt).

Evidence, as for the other verifiers (tests/test_verify_exactness.py):

* Exhaustive enumeration on a vocabulary of 3: for fixed noise, every possible
  drafted block (every token, every proposed length, tokens q cannot draw) and
  every token assignment of a small tree emits exactly the target's own coupled
  draws along the accepted path. The output is therefore plain Gumbel-max
  sampling whatever the drafter, and
* 10^6 coupled iterations pass a chi-square test against the target's joint
  law; the acceptance rate is the Gumbel coupling's collision probability
  sum_i 1 / sum_j max(p_j / p_i, q_j / q_i), above (1 - TV) / (1 + TV).
* On models (tiny random pair, the bundled pair): the tokens of
  `autoregressive_generate(sampler="coupled")` equal `speculative_generate`'s
  with verifier="coupled" for every drafter, gamma, tree, adaptive length and
  loop mode, and a row's tokens do not depend on the rows beside it.
  tests/test_distribution.py checks the law on a real model by chi-square.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_verify_exactness import (
  _ctx_rows,
  context_free_tables,
  ctx_index,
  make_tables,
  num_contexts,
  target_joint,
  to_float32,
)

import specjax
from helpers import SIMULATION_COMPILER_OPTIONS, chisquare_pvalue, head_drafter, make_drafter
from specjax import coupling, pretrained, theory, trees
from specjax.coupling import Coupling
from specjax.drafting import TreeDrafter
from specjax.verify import coupled_tree_verify, coupled_verify

V = 3
NOISE_DRAWS = 64


def _noise(seed, batch, positions, vocab=V):
  return np.asarray(jax.random.gumbel(jax.random.key(seed), (batch, positions, vocab)), np.float64)


def _target_draws(p_table, gumbel, length):
  """numpy reference: the target's coupled draws y_0..y_{length-1} for each noise row."""
  draws = np.zeros((gumbel.shape[0], length), np.int64)
  for b in range(gumbel.shape[0]):
    prefix = ()
    for j in range(length):
      p = p_table[ctx_index(prefix, V)]
      with np.errstate(divide="ignore"):
        y = int(np.argmax(np.where(p > 0, np.log(p), -np.inf) + gumbel[b, j]))
      draws[b, j] = y
      prefix += (y,)
  return draws


@pytest.mark.parametrize("case", ["generic", "q_zeros_where_p_positive"])
def test_every_drafted_block_emits_the_targets_own_draws(case):
  """Exhaustive over drafts (V = 3, gamma = 2): all 9 blocks x 3 proposed lengths,
  for 64 noise draws. The verifier keeps exactly the drafted prefix that equals
  the target's coupled draws and emits the next draw; a token with q(x) = 0 is
  never kept. So the emitted tokens are a function of the noise alone."""
  gamma = 2
  (p_table, q_table), _ = to_float32(*make_tables(case, V, gamma, seed=3))
  gumbel = _noise(0, NOISE_DRAWS, gamma + 1)
  y = _target_draws(p_table.astype(np.float64), gumbel, gamma + 1)
  blocks = list(itertools.product(range(V), repeat=gamma))
  cases = [(x, k, b) for x in blocks for k in range(gamma + 1) for b in range(NOISE_DRAWS)]
  tokens = np.array([x for x, _, _ in cases], np.int32)
  rows = [[ctx_index(x[:j], V) for j in range(gamma + 1)] for x, _, _ in cases]
  p = p_table[np.array(rows)]
  q = q_table[np.array(rows)[:, :gamma]]
  proposed = np.array([k for _, k, _ in cases])
  q = q * (np.arange(gamma)[None, :, None] < proposed[:, None, None])  # q = 0: not proposed
  noise_rows = np.array([b for _, _, b in cases])
  out = coupled_verify(
    Coupling(jnp.asarray(gumbel[noise_rows], jnp.float32), jax.random.key(0)),
    jnp.asarray(tokens),
    jnp.asarray(q),
    jnp.asarray(p),
  )
  n, nxt = np.asarray(out.num_accepted), np.asarray(out.next_token)
  for i, (x, k, b) in enumerate(cases):
    kept = 0
    while kept < k and x[kept] == y[b, kept] and q_table[ctx_index(x[:kept], V)][x[kept]] > 0:
      kept += 1
    assert n[i] == kept, (x, k, b)
    assert nxt[i] == y[b, kept], (x, k, b)  # the target's own draw after the kept prefix


def test_every_tree_emits_the_targets_own_draws():
  """Exhaustive over a tree's tokens (parents (-1, -1, 0): two children of the
  root, one grandchild; 27 assignments) for 64 noise draws: the accepted path
  is the longest path along the target's draws (the first matching sibling),
  and the next token is the following draw."""
  parents = (-1, -1, 0)
  (p_table, _), _ = to_float32(*make_tables("generic", V, 2, seed=5))
  gumbel = _noise(1, NOISE_DRAWS, 3)
  y = _target_draws(p_table.astype(np.float64), gumbel, 3)
  assignments = list(itertools.product(range(V), repeat=3))
  cases = [(t, b) for t in assignments for b in range(NOISE_DRAWS)]
  # Block rows: the root, then each node's context (node 2 continues node 0).
  rows = np.array([[0, ctx_index((t[0],), V), ctx_index((t[1],), V), 0] for t, _ in cases])
  for i, (t, _) in enumerate(cases):
    rows[i, 3] = ctx_index((t[0], t[2]), V)
  out = coupled_tree_verify(
    Coupling(jnp.asarray(gumbel[[b for _, b in cases]], jnp.float32), jax.random.key(0)),
    jnp.asarray([t for t, _ in cases], jnp.int32),
    parents,
    None,
    jnp.asarray(p_table[rows]),
  )
  n, nxt, path = (np.asarray(x) for x in out[1:] + out[:1])
  for i, (t, b) in enumerate(cases):
    first = 0 if t[0] == y[b, 0] else 1 if t[1] == y[b, 0] else None
    want = [] if first is None else [first]
    if first == 0 and t[2] == y[b, 1]:
      want.append(2)
    assert path[i, : len(want)].tolist() == want and n[i] == len(want), (t, b)
    assert nxt[i] == y[b, len(want)], (t, b)


@functools.partial(
  jax.jit, static_argnames=("gamma", "num_samples"), compiler_options=SIMULATION_COMPILER_OPTIONS
)
def _simulate(key, p_table, q_table, *, gamma, num_samples):
  """`num_samples` coupled iterations: drafts by Gumbel-max from q with the same
  noise, `coupled_verify`, then the target's completion to gamma + 1 tokens.
  Returns `(sequence_counts [V**(gamma+1)], accepted_counts [gamma+1])`."""
  vocab = p_table.shape[-1]
  noise_key, complete_key = jax.random.split(key)
  gumbel = jax.random.gumbel(noise_key, (num_samples, gamma + 1, vocab))
  drafts, q_rows, p_rows = [], [], []
  for j in range(gamma):
    rows = _ctx_rows(drafts, vocab, num_samples)
    q_rows.append(q_table[rows])
    p_rows.append(p_table[rows])
    drafts.append(coupling.gumbel_max(q_table[rows], gumbel[:, j]))
  p_rows.append(p_table[_ctx_rows(drafts, vocab, num_samples)])
  n, y = coupled_verify(
    Coupling(gumbel, key), jnp.stack(drafts, 1), jnp.stack(q_rows, 1), jnp.stack(p_rows, 1)
  )
  seq = []
  for j, k in enumerate(jax.random.split(complete_key, gamma + 1)):
    law = p_table[_ctx_rows(seq, vocab, num_samples)]
    token = jax.random.categorical(k, jnp.log(law), axis=-1).astype(jnp.int32)
    token = jnp.where(j == n, y, token)
    if j < gamma:
      token = jnp.where(j < n, drafts[j], token)
    seq.append(token)
  code = _ctx_rows(seq, vocab, num_samples) - num_contexts(vocab, gamma)
  return jnp.bincount(code, length=vocab ** (gamma + 1)), jnp.bincount(n, length=gamma + 1)


def collision_probability(p, q):
  """P(argmax(log p + G) = argmax(log q + G)) for shared Gumbel noise G, by the
  O(V^2) formula: sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) over ids with p_i, q_i > 0."""
  total = 0.0
  for i in range(len(p)):
    if p[i] > 0 and q[i] > 0:
      total += 1.0 / np.sum(np.maximum(p / p[i], q / q[i]))
  return total


def test_the_exact_acceptance_formula_sorts_what_the_quadratic_one_sums():
  """`theory.gumbel_coupling_acceptance` (O(V log V), ties and zeros included)
  equals the quadratic formula; 1 for p = q; between the bound and 1 - TV."""
  rng = np.random.default_rng(0)
  laws = []
  for v in (2, 3, 9, 40):
    p, q = rng.dirichlet(np.ones(v), size=2)
    q[0], p[-1] = 0.0, 0.0  # ids one law never draws
    laws.append((p / p.sum(), q / q.sum()))
  laws.append((np.array([0.25, 0.25, 0.5]), np.array([0.5, 0.5, 0.0]) / 1.0))  # tied ratios
  for p, q in laws:
    beta = float(theory.gumbel_coupling_acceptance(p, q))
    assert abs(beta - collision_probability(p, q)) < 1e-12
    tv = 0.5 * np.abs(p - q).sum()
    assert theory.coupled_acceptance_bound(tv) - 1e-12 <= beta <= 1 - tv + 1e-12
    assert abs(float(theory.gumbel_coupling_acceptance(p, p)) - 1) < 1e-12
  batch = theory.gumbel_coupling_acceptance(np.stack([p, p]), np.stack([q, p]))
  assert batch.shape == (2,) and abs(batch[1] - 1) < 1e-12
  with pytest.raises(ValueError, match="p and q must be laws of one shape"):
    theory.gumbel_coupling_acceptance(np.ones(3), np.ones(4))


@pytest.mark.parametrize("case", ["generic", "disjoint_supports"])
def test_coupled_verify_matches_target_joint(case):
  """10^6 coupled iterations (gamma = 2, context-dependent p and q on V = 3):
  chi-square against the target's joint law of three tokens."""
  gamma = 2
  (p32, q32), (p64, _) = to_float32(*make_tables(case, V, gamma, seed=7))
  counts, _ = _simulate(
    jax.random.key(21), jnp.asarray(p32), jnp.asarray(q32), gamma=gamma, num_samples=10**6
  )
  joint = target_joint(p64, gamma).reshape(-1)
  assert chisquare_pvalue(np.asarray(counts, np.int64), joint) > 1e-4


def test_acceptance_is_the_gumbel_collision_probability_above_the_papers_bound():
  """Context-free p and q: each drafted token is kept with the collision
  probability beta (so P(n >= k) = beta^k), which is at least (1 - TV) / (1 + TV)
  (Daliri et al., Theorem 2) and at most 1 - TV (the residual rule's)."""
  gamma = 2
  (p32, q32), (p64, q64) = to_float32(*context_free_tables(V, gamma, seed=9))
  p, q = p64[0], q64[0]
  beta = collision_probability(p, q)
  tv = 0.5 * np.abs(p - q).sum()
  assert (1 - tv) / (1 + tv) <= beta <= 1 - tv
  _, accepted = _simulate(
    jax.random.key(22), jnp.asarray(p32), jnp.asarray(q32), gamma=gamma, num_samples=10**6
  )
  at_least = np.cumsum(np.asarray(accepted)[::-1])[::-1] / 10**6  # P(n >= k)
  np.testing.assert_allclose(at_least[1:], beta ** np.arange(1, gamma + 1), atol=3e-3)


def test_coupled_draws_follow_the_law_and_the_index():
  """`gumbel_max` with `noise` is a draw from probs (chi-square over 10^5 rows),
  and the noise of (row key, index) is the same in any call: batch size,
  start and count do not change it."""
  keys = jax.random.split(jax.random.key(4), 100_000)
  probs = jnp.asarray([0.5, 0.3, 0.15, 0.05, 0.0], jnp.float32)
  gumbel = coupling.noise(keys, jnp.zeros((len(keys),), jnp.int32), 1, 5)
  draws = np.asarray(coupling.gumbel_max(jnp.broadcast_to(probs, (len(keys), 5)), gumbel[:, 0]))
  law = np.asarray(probs[:4], np.float64)
  assert chisquare_pvalue(np.bincount(draws, minlength=5)[:4], law) > 1e-3
  wide = coupling.noise(keys[:8], jnp.full((8,), 3, jnp.int32), 4, 5)  # indices 3..6
  narrow = coupling.noise(keys[5:6], jnp.full((1,), 5, jnp.int32), 1, 5)  # row 5, index 5
  np.testing.assert_array_equal(wide[5, 2], narrow[0, 0])


# ---------------------------------------------------------------------------
# Models: the text is the same with any drafter, and a row's own.
# ---------------------------------------------------------------------------

NEW = 14
# Per-row settings: both temperatures of the property, top-k, top-p and a greedy
# row in one batch, one compiled program per drafter.
ROWS = specjax.RowSampling.of(
  [
    specjax.SamplingParams(temperature=0.7),
    specjax.SamplingParams(temperature=1.0),
    specjax.SamplingParams(temperature=1.0, top_k=5),
    specjax.SamplingParams(temperature=0.7, top_p=0.9),
    specjax.SamplingParams(temperature=0.0),
  ]
)
KEYS = jax.random.split(jax.random.key(2026), 5)


@pytest.fixture(scope="module")
def prompts():
  tokens = jax.random.randint(jax.random.key(8), (5, 7), 0, 512)
  return tokens, jnp.asarray([7, 3, 5, 7, 1], jnp.int32)


@pytest.fixture(scope="module")
def reference(target, prompts):
  """`autoregressive_generate` with the coupled sampler (per-row keys: "auto")."""
  return np.asarray(
    specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=NEW, sampling=ROWS, key=KEYS
    ).tokens
  )


TREE = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])
DRAFTERS = {
  "model": lambda t, d: (d, 3),
  "eagle": lambda t, d: (make_drafter("eagle", t, d), 3),
  "medusa": lambda t, d: (make_drafter("medusa", t, d), 3),
  "early_exit": lambda t, d: (make_drafter("early_exit", t, d), 3),
  "dflash": lambda t, d: (make_drafter("dflash", t, d), 3),
  "ngram": lambda t, d: (make_drafter("ngram", t, d), 3),
  "layer_skip": lambda t, d: (make_drafter("layer_skip", t, d), 3),
  "bigram": lambda t, d: (make_drafter("bigram", t, d), 3),
  "static_tree": lambda t, d: (TreeDrafter(d, TREE), len(TREE)),
  "medusa_tree": lambda t, d: (head_drafter("medusa", t, num_heads=3).replace(tree=TREE), 5),
  "dflash_tree": lambda t, d: (make_drafter("dflash", t, d).replace(tree=TREE), len(TREE)),
  "dspark": lambda t, d: (make_drafter("dspark", t, d), 3),
  "dspark_tree": lambda t, d: (make_drafter("dspark", t, d).replace(tree=TREE), len(TREE)),
  "eagle2": lambda t, d: (head_drafter("eagle", t).replace(tree=trees.DynamicTree(5, 3, 3, 2)), 5),
}


# Layer skip and early exit: CachedDrafting as "model", with another model (the slow tier).
@pytest.mark.sample(*(name for name in DRAFTERS if name not in ("layer_skip", "early_exit")))
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_gives_the_plain_coupled_text(target, draft, prompts, reference, name):
  drafter, gamma = DRAFTERS[name](target, draft)
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=gamma, max_new_tokens=NEW, sampling=ROWS, key=KEYS
  )
  np.testing.assert_array_equal(out.tokens, reference)


# Gammas 2, 5 and 6 and the schedule in the while loop: the slow tier.
@pytest.mark.sample("1-chain", "4-chain", "3-confidence-0.3", "3-chunked-3", "3-schedule-chunked")
@pytest.mark.parametrize(
  "gamma, settings",
  [(1, {}), (2, {}), (4, {}), (5, {}), (6, {})]
  + [(3, dict(adaptive="schedule")), (3, dict(adaptive="confidence", confidence_threshold=0.3))]
  + [(3, dict(loop="chunked", loop_chunk=3)), (3, dict(adaptive="schedule", loop="chunked"))],
  ids=lambda x: str(x) if isinstance(x, int) else "-".join(map(str, x.values())) or "chain",
)
def test_every_gamma_adaptive_length_and_loop_give_the_same_text(
  target, draft, prompts, reference, gamma, settings
):
  out = specjax.speculative_generate(
    target, draft, *prompts, gamma=gamma, max_new_tokens=NEW, sampling=ROWS, key=KEYS, **settings
  )
  np.testing.assert_array_equal(out.tokens, reference)


def test_a_rows_text_does_not_depend_on_the_other_rows(target, draft, prompts, reference):
  """Row 1 (its prompt, key and settings) alone, among 3 rows and among 8 rows
  with other prompts and keys: identical tokens, plain or speculative. One key
  for the batch gives row b the key fold_in(key, b)."""
  tokens, lengths = prompts
  others = jax.random.randint(jax.random.key(9), (8, 7), 0, 512)
  params = [specjax.SamplingParams(temperature=1.0)] * 8
  for size in (1, 3, 8):
    batch = others[:size].at[0].set(tokens[1])
    batch_lengths = jnp.full((size,), 7, jnp.int32).at[0].set(lengths[1])
    keys = jax.random.split(jax.random.key(size), size).at[0].set(KEYS[1])
    run = dict(max_new_tokens=NEW, sampling=specjax.RowSampling.of(params[:size]), key=keys)
    plain = specjax.autoregressive_generate(target, batch, batch_lengths, **run)
    spec = specjax.speculative_generate(target, draft, batch, batch_lengths, gamma=3, **run)
    np.testing.assert_array_equal(plain.tokens[0], reference[1])
    np.testing.assert_array_equal(spec.tokens[0], reference[1])
  one_key = jax.random.key(5)
  run = dict(max_new_tokens=NEW, sampling=specjax.SamplingParams(1.0), key=one_key)
  batch = specjax.speculative_generate(
    target, draft, *prompts, gamma=3, verifier="coupled", **run
  ).tokens
  alone = specjax.autoregressive_generate(
    target, tokens[2:3], lengths[2:3], sampler="coupled", **{**run, "key": KEYS[:1]}
  ).tokens
  keyed = specjax.autoregressive_generate(
    target,
    tokens[2:3],
    lengths[2:3],
    **{**run, "key": jax.random.fold_in(one_key, 2)[None]},
  ).tokens
  np.testing.assert_array_equal(batch[2], keyed[0])
  assert not np.array_equal(alone[0], keyed[0])  # the key matters


def test_bundled_pair_gives_the_plain_coupled_text():
  """The bundled pair (trained, so the draft agrees often) at T = 0.7 and 1:
  speculative text with the draft model equals plain coupled decoding."""
  target, draft, tokenizer = pretrained.load_pair()
  prompts = [list(tokenizer.encode(t)) for t in ["def add(a, b):", "The capital of", "for i in"]]
  width = max(map(len, prompts))
  tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  rows = specjax.RowSampling.of([specjax.SamplingParams(t) for t in (0.7, 1.0, 1.0)])
  keys = jax.random.split(jax.random.key(0), 3)
  run = dict(max_new_tokens=24, sampling=rows, key=keys)
  plain = specjax.autoregressive_generate(target, tokens, lengths, **run)
  spec = specjax.speculative_generate(target, draft, tokens, lengths, gamma=4, **run)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert float(spec.stats.acceptance_rate) > 0.3  # the draft is used, not bypassed


def test_coupling_arguments_are_named(target, draft, prompts):
  keys = jax.random.split(jax.random.key(0), 5)
  run = dict(max_new_tokens=4, sampling=ROWS)
  with pytest.raises(ValueError, match="cannot use one key per row"):
    specjax.speculative_generate(
      target, draft, *prompts, gamma=2, key=keys, verifier="token", **run
    )
  with pytest.raises(ValueError, match="cannot use one key per row"):
    specjax.autoregressive_generate(target, *prompts, key=keys, sampler="inverse_cdf", **run)
  with pytest.raises(ValueError, match=r"sampler must be one of \('auto', 'inverse_cdf'"):
    specjax.autoregressive_generate(target, *prompts, key=keys, sampler="gumbel", **run)
  with pytest.raises(ValueError, match=r"or one per row \(keys \[5\]"):
    specjax.autoregressive_generate(target, *prompts, key=keys[:4], **run)
  with pytest.raises(ValueError, match="key must be a specjax.coupling.Coupling"):
    coupled_verify(
      jax.random.key(0), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 4)), jnp.ones((1, 2, 4))
    )

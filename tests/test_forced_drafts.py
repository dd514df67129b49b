"""Drafts the grammar forces (`SpecConfig.forced_drafts`): where a row's constraint
state allows one token, and along the chain of such states, the iteration drafts
those tokens with q one-hot, and the drafter drafts after them.

* The table's forced token per state (`ConstraintTable.forced`, both layouts, and
  the fallback for a table built without it) and `forced_chain` match a walk of
  the automaton on the host.
* On a vocabulary of 8 tokens, under a regex whose states force chains ("a" or
  "c" must be followed by "b" then "d"), 8,000 rows of the token, block and
  coupled rules pass a chi-square test against the constrained target's law of
  the first three tokens, with forced tokens drafted (`stats.forced` > 0).
* Greedy output with forced drafts is plain constrained greedy decoding under a
  JSON schema, for a draft model (also with penalties) and an EAGLE head; the
  draft model spends fewer calls (it feeds the span in its first call), and
  off, nothing is forced.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import chisquare_pvalue, make_drafter, sequence_counts
from specjax import constraints as C

V = 8
LETTERS = [b"a", b"b", b"c", b"d", b"ab", b"ba", b"x", None]  # id 7: EOS
EOS = [7]
PROMPT = jnp.array([1, 5, 2, 0], jnp.int32)
CHAINS = "(a|c)bd(a|c)+"  # after "a" or "c": "b" then "d" forced; after "ab": "d"

# A JSON-capable vocabulary of 512 ids for the tiny models: printable ASCII, a few
# multi-character pieces (so some states allow several spellings), filler, EOS.
JSON_TOKENS = [bytes([c]) for c in range(32, 127)] + [b"ab", b"na", b"me", b'"n', b'{"']
JSON_TOKENS += [b"q" * (2 + i) for i in range(511 - len(JSON_TOKENS))] + [None]
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 4},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
  },
  "required": ["name", "args"],
  "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair():
  cfg = specjax.ModelConfig(
    vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16,
    init_std=0.4,
  )  # fmt: skip
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(cfg, rngs=nnx.Rngs(1))
  params, noise = nnx.state(target, nnx.Param), nnx.state(draft, nnx.Param)
  nnx.update(draft, jax.tree.map(lambda p, n: p + 0.6 * n, params, noise))
  return target, draft


@pytest.fixture(scope="module")
def chains():
  return C.compile_constraint(C.Regex(CHAINS), LETTERS, EOS)


def _host_forced(next_state: np.ndarray) -> np.ndarray:
  ok = next_state >= 0
  return np.where(ok.sum(1) == 1, ok.argmax(1), -1)


def test_forced_tokens_and_chains_match_a_walk_of_the_automaton(chains):
  expected = _host_forced(chains.next_state)
  assert (expected >= 0).sum() == 2  # "b" after "a" or "c", "d" after "ab"
  for layout in ("dense", "sparse"):
    rules = C.row_constraints([chains, None], V, layout=layout)
    forced = np.asarray(rules.table.forced)
    start = int(rules.start[0]) - chains.start  # the automaton's offset in the table
    np.testing.assert_array_equal(forced[start : start + chains.num_states], expected)
    assert forced[C.FREE] == -1  # an unconstrained row is never forced
    # A table built without `forced` derives it: the same chains.
    bare = rules.table.replace(forced=None)
    states = jnp.asarray([start + chains.next_state[chains.start, 0], C.FREE, -1], jnp.int32)
    for table in (rules.table, bare):
      tokens, count, after = C.forced_chain(table, states, 3)
      np.testing.assert_array_equal(count, [2, 0, 0])  # after "a": "b", "d"
      np.testing.assert_array_equal(tokens[0, :2], [1, 3])
      assert not np.asarray(C.allowed(table, after[:1]))[0, 1]  # past the span: (a|c)


@jax.jit
def _logits(target, seqs):
  return target(seqs)


def _joint(target, automaton, sampling) -> np.ndarray:
  """`[V, V, V]` the constrained target's law of the first three tokens (each
  position's warped law masked to what the automaton allows, renormalised)."""
  pairs = jnp.array(list(itertools.product(range(V), repeat=2)), jnp.int32)
  seqs = jnp.concatenate([jnp.tile(PROMPT, (V * V, 1)), pairs], axis=1)
  logits = np.asarray(_logits(target, seqs), np.float64)
  n, nxt = len(PROMPT), automaton.next_state

  def law(row, state):
    masked = np.where(nxt[state] >= 0, row, -np.inf)
    return np.asarray(specjax.warp_probs(jnp.asarray(masked, jnp.float32), sampling), np.float64)

  s0, joint = automaton.start, np.zeros((V, V, V))
  first = law(logits[0, n - 1], s0)
  for t1, t2 in itertools.product(range(V), repeat=2):
    s1 = nxt[s0, t1]
    s2 = nxt[s1, t2] if s1 >= 0 else -1
    if s2 >= 0:
      seq = logits[t1 * V + t2]
      joint[t1, t2] = first[t1] * law(seq[n], s1)[t2] * law(seq[n + 1], s2)
  return joint


@pytest.mark.parametrize("verifier", ["token", "block", "coupled"])
def test_forced_drafts_keep_the_constrained_law(pair, chains, verifier):
  target, draft = pair
  rows = 8_000
  sampling = specjax.SamplingParams(temperature=1.0)
  key = jax.random.key(11)
  if verifier == "coupled":  # per-row keys: rows independent
    key = jax.random.split(key, rows)
  out = specjax.speculative_generate(
    target, draft, jnp.tile(PROMPT, (rows, 1)), jnp.full((rows,), len(PROMPT), jnp.int32),
    gamma=2, max_new_tokens=3, sampling=sampling, key=key, verifier=verifier,
    constraints=C.row_constraints([chains] * rows, V),
  )  # fmt: skip
  assert int(out.stats.forced.sum()) > rows // 4  # forced tokens were drafted
  joint = _joint(target, chains, sampling)
  assert chisquare_pvalue(sequence_counts(out.tokens, V), joint) > 1e-3


# The model with the penalties on: its warp's counts advance over the forced span.
@pytest.mark.sample("model", "eagle")  # with penalties too: slow tier (test_warps has them)
@pytest.mark.parametrize("name", ["model", "eagle", "model_penalties"])
def test_greedy_forced_drafts_are_constrained_greedy_decoding(target, draft, name):
  automaton = C.compile_constraint(C.JsonSchema(SCHEMA), JSON_TOKENS, [511], 512)
  rules = C.row_constraints([automaton, automaton], 512)
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 2])
  sampling = specjax.GREEDY
  if name == "model_penalties":
    sampling = specjax.SamplingParams(0.0, presence_penalty=0.5, repetition_penalty=1.3)
  run = dict(max_new_tokens=40, sampling=sampling, eos_id=511, constraints=rules)
  name = name.removesuffix("_penalties")
  plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
  drafter = make_drafter(name, target, draft)
  on, off = (
    specjax.speculative_generate(
      target, drafter, prompts, lengths, gamma=4, forced_drafts=forced, **run
    )
    for forced in (True, False)
  )
  np.testing.assert_array_equal(on.tokens, plain.tokens)
  np.testing.assert_array_equal(off.tokens, plain.tokens)
  assert int(on.stats.forced.min()) > 0 and int(off.stats.forced.max()) == 0
  assert (np.asarray(on.stats.forced) <= np.asarray(on.stats.accepted)).all()
  if name == "model":  # the span goes in with the first call: fewer draft calls
    assert int(on.stats.draft_calls) < int(off.stats.draft_calls)


def test_forced_drafts_must_be_a_bool(target, draft):
  prompts, lengths = jnp.asarray([[3, 4, 5]], jnp.int32), jnp.asarray([3])
  with pytest.raises(ValueError, match="forced_drafts must be True or False"):
    specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=2, max_new_tokens=4, forced_drafts="yes"
    )

"""Constraints as device tables (`specjax.constraints`): compiled by outlines-core,
masked on p at every scored position, exact for the constrained target law.

* On a vocabulary of 8 single-letter tokens the exact law of the first three
  tokens under a regex is computed from the target's full forward (masked and
  renormalised at every position), and 20,000 rows of speculative (token rule)
  and plain decoding pass a chi-square test against it.
* Greedy constrained speculative decoding is constrained greedy decoding, for
  chains, static trees and EAGLE-2 trees; with per-row keys the coupled
  verifier keeps its drafter invariance under a constraint.
* Sampled outputs of the bundled pair under a JSON schema (100 rows; 1,000
  in the slow tier) all parse and validate, each ending with EOS; EOS is
  allowed only in accepting states; a new constraint in the same table bucket
  does not recompile.
* Drafters that mask q (`constrained_drafts`; tests/test_constrained_drafts.py
  checks their proposals) keep the coupled verifier's drafter invariance:
  their coupled texts are plain coupled decoding's.
"""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import chisquare_pvalue, head_drafter, make_drafter, sequence_counts, traces
from specjax import constraints as C
from specjax import pretrained, trees
from specjax.drafting import TreeDrafter, as_drafter
from specjax.vocab_map import token_bytes

V = 8
LETTERS = [b"a", b"b", b"c", b"d", b"ab", b"ba", b"x", None]  # id 7: EOS
EOS = [7]
PROMPT = jnp.array([1, 5, 2, 0], jnp.int32)


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


def test_compiled_automata_spell_their_language_and_eos_ends_only_complete_text():
  a = C.compile_constraint(C.Regex("(ab|c)+d?"), LETTERS, EOS)
  assert a.next_state.shape[1] == V and a.start == 0
  eos_ok = a.next_state[:, 7] >= 0
  np.testing.assert_array_equal(eos_ok, a.accepting)  # EOS exactly in accepting states
  assert not a.accepting[a.start]  # the empty text is not in the language

  def walk(ids):
    s = a.start
    for i in ids:
      s = a.next_state[s, i]
      if s < 0:
        return None
    return s

  assert a.accepting[walk([0, 1, 2, 3])]  # a b c d = "abcd"
  assert a.accepting[walk([4, 2])]  # "ab" "c"
  assert walk([1]) is None and walk([3]) is None  # "b", "d" cannot start it
  choice = C.compile_constraint(C.Choice(("ab", "x")), LETTERS, EOS)
  assert choice.accepting[choice.next_state[0, 6]] and choice.accepting[choice.next_state[0, 4]]
  for bad, message in [
    (C.Choice(()), "choice must be a non-empty list"),
    (C.Regex(""), "regex must be a non-empty string"),
    (C.JsonSchema("{not json"), "json_schema is not a schema"),
    ("(ab)+", "constraint must be a Regex, JsonSchema, Choice or ToolCalls"),
    (C.Regex("zzz"), "cannot be compiled|accepts no text"),
  ]:
    with pytest.raises(ValueError, match=message):
      C.compile_constraint(bad, LETTERS, EOS)
  with pytest.raises(ValueError, match="eos_ids must name at least one id"):
    C.compile_constraint(C.Regex("a"), LETTERS, [])


def test_a_text_may_go_on_past_an_accepting_state_one_token_at_a_time():
  """outlines-core's index alone drops a token leaving an accepting state for a
  non-accepting one (`grammar.END`): over single-letter tokens "x(ab)?" lost
  "xab" and "(ab|a)" lost "ab". Every state also still reaches an accepting one."""
  for regex, texts in [("x(ab)?", ([6], [6, 0, 1])), ("(ab|a)", ([0], [0, 1], [4]))]:
    a = C.compile_constraint(C.Regex(regex), LETTERS, EOS)
    for ids in texts:
      s = a.start
      for i in ids:
        s = a.next_state[s, i]
        assert s >= 0, (regex, ids)
      assert a.accepting[s], (regex, ids)
    assert (a.next_state[:, :7] >= 0).any(axis=1)[~a.accepting].all()  # no dead ends


@jax.jit
def _logits(target, seqs):
  return target(seqs)


def constrained_joint(target, automaton, sampling):
  """`[V, V, V]` law of the first three tokens: at each position the warped law
  masked to the automaton's allowed tokens and renormalised (the constrained
  target law), from full forwards over every two-token continuation."""
  pairs = jnp.array(list(itertools.product(range(V), repeat=2)), jnp.int32)
  seqs = jnp.concatenate([jnp.tile(PROMPT, (V * V, 1)), pairs], axis=1)
  logits = np.asarray(_logits(target, seqs), np.float64)
  n = len(PROMPT)
  joint = np.zeros((V, V, V))

  def law(row, state):  # the warped law masked to what `state` allows
    masked = np.where(automaton.next_state[state] >= 0, row, -np.inf)
    return np.asarray(specjax.warp_probs(jnp.asarray(masked, jnp.float32), sampling), np.float64)

  s0 = automaton.start
  first = law(logits[0, n - 1], s0)
  for t1, t2 in itertools.product(range(V), repeat=2):
    s1 = automaton.next_state[s0, t1]
    s2 = automaton.next_state[s1, t2] if s1 >= 0 else -1
    if s2 < 0:
      continue  # a continuation the constraint never allows: probability 0
    seq = logits[t1 * V + t2]
    joint[t1, t2] = first[t1] * law(seq[n], s1)[t2] * law(seq[n + 1], s2)
  return joint


def test_constrained_sampling_matches_the_constrained_target_law(pair):
  target, draft = pair
  automaton = C.compile_constraint(C.Regex("(a|ab|c)(b|ba|c)+x?"), LETTERS, EOS)
  rows = 20_000
  rules = C.row_constraints([automaton] * rows, V)
  sampling = specjax.SamplingParams(temperature=1.0)
  joint = constrained_joint(target, automaton, sampling)
  prompts = jnp.tile(PROMPT, (rows, 1))
  lengths = jnp.full((rows,), len(PROMPT), jnp.int32)
  # No eos_id: EOS keeps an accepting state, so every row has three tokens.
  run = dict(max_new_tokens=3, sampling=sampling, constraints=rules)
  spec = specjax.speculative_generate(
    target, draft, prompts, lengths, gamma=2, key=jax.random.key(1), **run
  )
  ar = specjax.autoregressive_generate(target, prompts, lengths, key=jax.random.key(2), **run)
  assert 0.1 < float(spec.stats.acceptance_rate) < 0.95
  for out in (ar, spec):
    tokens = np.asarray(out.tokens)
    assert chisquare_pvalue(sequence_counts(tokens, V), joint) > 1e-3


def test_greedy_and_coupled_constrained_speculation_equal_plain_decoding(target, draft):
  """Tiny random pair, a regex row, a choice row and a free row in one batch:
  greedy speculative = greedy plain; coupled (per-row keys) = plain coupled."""
  tb = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]
  eos = [511]
  regex = C.compile_constraint(C.Regex("[a-e]{2,6}(xy|z)"), tb, eos, 512)
  choice = C.compile_constraint(C.Choice(("aa", "bbb", "cc")), tb, eos, 512)
  rules = C.row_constraints([regex, None, choice], 512)
  prompts = jnp.asarray([[3, 4, 5], [6, 7, 8], [9, 10, 11]], jnp.int32)
  lengths = jnp.asarray([3, 2, 3], jnp.int32)
  keys = jax.random.split(jax.random.key(4), 3)
  for sampling, key in ((specjax.GREEDY, None), (specjax.SamplingParams(0.8), keys)):
    run = dict(max_new_tokens=12, sampling=sampling, key=key, eos_id=eos, constraints=rules)
    plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
    spec = specjax.speculative_generate(target, draft, prompts, lengths, gamma=3, **run)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    n = int(plain.num_generated[2])
    row = np.asarray(plain.tokens)[2, :n]
    assert row[-1] == 511  # the choice is complete: EOS
    assert b"".join(tb[t] for t in row[:-1]).decode() in ("aa", "bbb", "cc")


@pytest.mark.sample(1)  # the default tier: 100 rows (about 10 s); the slow tier: 1,000
@pytest.mark.parametrize("rows", [100, 1000])
def test_bundled_outputs_validate_against_their_schema(rows):
  """Sampled rows of the bundled pair (speculative, T = 1) under a JSON schema:
  every text parses, has the required fields and types, and ends with EOS."""
  target, draft, tok = pretrained.load_pair()
  tb = token_bytes(tok)
  eos = [i for i, b in enumerate(tb) if b is None]
  schema = {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 8},
      "args": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "args"],
  }
  automaton = C.compile_constraint(C.JsonSchema(schema), tb, eos, target.cfg.vocab_size)
  prompt = list(tok.encode("def f(x):"))
  prompts = jnp.asarray([prompt] * rows, jnp.int32)
  lengths = jnp.full((rows,), len(prompt), jnp.int32)
  run = dict(gamma=3, max_new_tokens=48, sampling=specjax.SamplingParams(1.0), eos_id=eos)
  rules = C.row_constraints([automaton] * rows, target.cfg.vocab_size)
  out = specjax.speculative_generate(
    target, draft, prompts, lengths, key=jax.random.key(0), constraints=rules, **run
  )
  tokens, counts = np.asarray(out.tokens), np.asarray(out.num_generated)
  for row, n in zip(tokens, counts):
    assert row[n - 1] in eos, "every row finishes its text within the budget"
    value = json.loads(tok.decode([int(t) for t in row[: n - 1]]))
    assert set(value) == {"name", "args"} and isinstance(value["name"], str)
    assert len(value["name"]) <= 8 and isinstance(value["args"], list) and len(value["args"]) <= 2
    assert all(isinstance(a, str) and len(a) <= 4 for a in value["args"])


@pytest.mark.parametrize("kind", ["static_tree", "eagle2"])
def test_constrained_trees_equal_plain_decoding(target, draft, kind):
  """A static tree (the draft model) and EAGLE-2's per-row trees: each node is
  masked by the state its own path reaches; greedy and coupled outputs equal
  plain constrained decoding."""
  tb = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]
  regex = C.compile_constraint(C.Regex("[a-f]{2,8}(xy|z)"), tb, [511], 512)
  rules = C.row_constraints([regex, None], 512)
  tree = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])
  drafter = {
    "static_tree": lambda: TreeDrafter(draft, tree),
    "eagle2": lambda: head_drafter("eagle", target).replace(tree=trees.DynamicTree(5, 3, 3, 2)),
  }[kind]()
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 2])
  keys = jax.random.split(jax.random.key(9), 2)
  for sampling, key in ((specjax.GREEDY, None), (specjax.SamplingParams(0.9), keys)):
    run = dict(max_new_tokens=10, sampling=sampling, key=key, eos_id=511, constraints=rules)
    plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
    spec = specjax.speculative_generate(target, drafter, prompts, lengths, gamma=5, **run)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_a_new_constraint_in_the_same_bucket_does_not_recompile(target, draft, layout):
  tb = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]
  first = C.compile_constraint(C.Regex("[a-e]{2,6}z"), tb, [511], 512)
  second = C.compile_constraint(C.Choice(("abc", "de")), tb, [511], 512)
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 3])
  run = dict(gamma=2, max_new_tokens=8, sampling=specjax.SamplingParams(0.7), eos_id=511)
  fixed = dict(num_states=64, num_classes=64, layout=layout)  # the buckets fixed
  a = C.row_constraints([first, None], 512, **fixed)
  b = C.row_constraints([second, second], 512, **fixed)
  assert (
    a.table.next_state.shape == b.table.next_state.shape == (64, 512 if layout == "dense" else 64)
  )
  specjax.speculative_generate(target, draft, prompts, lengths, key=jax.random.key(0),
                               constraints=a, **run)  # fmt: skip
  with traces() as traced:
    out = specjax.speculative_generate(
      target, draft, prompts, lengths, key=jax.random.key(1), constraints=b, **run
    )
  assert not traced
  for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_generated)):
    assert b"".join(tb[t] for t in row[: n - 1]).decode() in ("abc", "de")


def test_memory_of_the_table_and_bad_arguments(target, draft):
  tb = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]
  a = C.compile_constraint(C.Regex("[a-z]{1,3}"), tb, [511], 512)
  report = C.memory_report(a)
  assert report["dense_bytes"] == a.num_states * 512 * 4
  assert report["sparse_bytes"] < report["dense_bytes"]
  prompts, lengths = jnp.ones((2, 3), jnp.int32), jnp.asarray([3, 3])
  with pytest.raises(ValueError, match=r"constraints.start must have one state per row, \[2\]"):
    specjax.autoregressive_generate(
      target, prompts, lengths, max_new_tokens=4, sampling=specjax.GREEDY,
      constraints=C.row_constraints([a], 512),
    )  # fmt: skip
  with pytest.raises(ValueError, match="constraints must be a specjax.constraints.RowConstraints"):
    specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=2, max_new_tokens=4, sampling=specjax.GREEDY,
      constraints=a,
    )  # fmt: skip
  with pytest.raises(ValueError, match="automaton has 512 ids; the model's vocabulary has 64"):
    C.row_constraints([a], 64)


# Letters and their doublings, ..., then EOS: a vocabulary of 512 the tiny pair reads.
LETTER_BYTES = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]


@pytest.mark.parametrize(
  "name",
  ["model", "layer_skip", "eagle", "medusa", "early_exit", "bigram", "eagle_subset", "dspark"],
)
def test_masked_drafters_keep_coupled_constrained_output(target, draft, name):
  """Each drafter masks its q by the state its own drafts reach and proposes
  with the rows' noise: coupled output is plain coupled decoding's."""
  drafter = make_drafter(name, target, draft)
  assert as_drafter(drafter).constrained_drafts
  regex = C.compile_constraint(C.Regex("[a-f]{2,8}(xy|z)"), LETTER_BYTES, [511], 512)
  rules = C.row_constraints([regex, None, regex], 512)
  prompts = jnp.asarray([[3, 4, 5], [6, 7, 8], [1, 2, 3]], jnp.int32)
  lengths = jnp.asarray([3, 2, 3], jnp.int32)
  keys = jax.random.split(jax.random.key(5), 3)
  run = dict(max_new_tokens=10, sampling=specjax.SamplingParams(0.9), key=keys, eos_id=511)
  plain = specjax.autoregressive_generate(target, prompts, lengths, constraints=rules, **run)
  spec = specjax.speculative_generate(
    target, drafter, prompts, lengths, gamma=3, constraints=rules, **run
  )
  np.testing.assert_array_equal(spec.tokens, plain.tokens)

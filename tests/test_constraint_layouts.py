"""The two device layouts of a constraint table (`specjax.constraints`): dense
`[S, V]` and by token class (`[S, C]` and a `[V]` class map) are the same table.

* Token classes are exact: an automaton built from random sparse transitions
  gives back every (state, token) transition, and a compiled one lists its
  transitions without a dense table.
* On every (state, token) pair of a batch (two automata, a FREE row, padding
  states, the dead state -1, ids outside the vocabulary) the two layouts give
  the same `allowed`, `advance` and `mask_logits` (logits wider than V too).
* Greedy and coupled outputs of speculative and plain decoding are the same
  under either layout (tests/test_constraints.py checks that a new constraint
  in the same bucket does not recompile, in both).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import constraints as C

V = 512
PIECES = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(V - 1)] + [None]  # id 511: EOS
EOS = [V - 1]


@pytest.fixture(scope="module")
def automata():
  regex = C.compile_constraint(C.Regex("[a-e]{2,6}(xy|z)"), PIECES, EOS, V)
  choice = C.compile_constraint(C.Choice(("aa", "bbb", "cc")), PIECES, EOS, V)
  return regex, choice


def test_token_classes_give_back_every_transition():
  rng = np.random.default_rng(0)
  s, v = 9, 300
  dense = np.where(rng.random((s, v)) < 0.3, rng.integers(0, s, (s, v)), -1).astype(np.int32)
  dense[:, 200:] = dense[:, 199:200]  # ids every state treats alike share a class
  rows = [(np.nonzero(r >= 0)[0], r[r >= 0]) for r in dense]
  a = C.Automaton.from_transitions(rows, v, 2, np.arange(s) % 2 == 0)
  np.testing.assert_array_equal(a.next_state, dense)
  assert a.num_classes <= 201 and a.num_transitions() == int((dense >= 0).sum())
  assert a.start == 2 and a.vocab_size == v


def test_dense_and_sparse_tables_agree_on_every_state_and_token(automata):
  regex, choice = automata
  batch = [regex, None, choice, regex]
  dense = C.row_constraints(batch, V, num_states=32, layout="dense")
  sparse = C.row_constraints(batch, V, num_states=32, layout="sparse")
  assert (dense.table.layout, sparse.table.layout) == ("dense", "sparse")
  assert dense.table.num_states == sparse.table.num_states == 32  # 1 + 9 + 6, padded
  assert sparse.table.vocab_size == V and sparse.table.nbytes() < dense.table.nbytes() / 4
  np.testing.assert_array_equal(dense.start, sparse.start)
  # The dense table is the host automata, offset, behind the FREE row.
  host = np.asarray(dense.table.next_state)
  assert (host[0] == C.FREE).all() and (host[1 + regex.num_states + choice.num_states :] < 0).all()
  for a, first in ((regex, 1), (choice, 1 + regex.num_states)):
    block = host[first : first + a.num_states]
    np.testing.assert_array_equal(block, np.where(a.next_state >= 0, a.next_state + first, -1))
  states = jnp.arange(-1, dense.table.num_states)  # dead, FREE, both automata, padding
  tokens = jnp.arange(-2, V + 2)  # ids outside [0, V) too
  logits = jax.random.normal(jax.random.key(0), (states.size, V + 3))  # a wider drafter
  reads = {
    "allowed": lambda table: C.allowed(table, states),
    "advance": lambda table: C.advance(table, states[:, None], tokens[None, :]),
    "mask_logits": lambda table: C.mask_logits(logits, table, states),
  }
  for name, read in reads.items():
    np.testing.assert_array_equal(read(dense.table), read(sparse.table), err_msg=name)
  mask = np.asarray(C.allowed(dense.table, states))
  assert mask[0].all() and mask[1].all() and not mask[-1].any()  # dead, FREE, padding


def test_auto_layout_follows_the_dense_size_and_bad_layouts_are_refused(automata, monkeypatch):
  regex, _ = automata
  assert C.row_constraints([regex], V).table.layout == "dense"  # 16 x 512 x 4 B: small
  monkeypatch.setattr(C, "DENSE_LIMIT_BYTES", 16 * V * 4 - 1)
  assert C.row_constraints([regex], V).table.layout == "sparse"
  with pytest.raises(ValueError, match="layout must be 'auto', 'dense' or 'sparse'"):
    C.row_constraints([regex], V, layout="csr")
  report = C.memory_report(regex)
  assert report["dense_bytes"] == regex.num_states * V * 4
  assert report["sparse_bytes"] == C.row_constraints([regex], V, layout="sparse").table.nbytes()
  assert report["transitions"] == int((regex.next_state >= 0).sum())


def test_generation_is_the_same_under_either_layout(target, draft, automata):
  regex, choice = automata
  prompts = jnp.asarray([[3, 4, 5], [6, 7, 8], [9, 10, 11]], jnp.int32)
  lengths = jnp.asarray([3, 2, 3], jnp.int32)
  keys = jax.random.split(jax.random.key(4), 3)
  for sampling, key in ((specjax.GREEDY, None), (specjax.SamplingParams(0.8), keys)):
    outs = []
    for layout in ("dense", "sparse"):
      rules = C.row_constraints([regex, None, choice], V, layout=layout)
      run = dict(max_new_tokens=10, sampling=sampling, key=key, eos_id=EOS, constraints=rules)
      plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
      spec = specjax.speculative_generate(target, draft, prompts, lengths, gamma=3, **run)
      outs += [plain.tokens, spec.tokens]
    for out in outs[1:]:
      np.testing.assert_array_equal(out, outs[0])

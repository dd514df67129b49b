"""Drafts with another tokenizer: the vocabulary map, TLI and SLEM.

The target is the shared tiny model with a 512-id byte-level BPE; the draft has
a 300-id BPE trained on other files (some strings shared, others not). The
law at temperature 1 is checked in test_distribution.py.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import specjax
from helpers import TINY_DRAFT, word_tokenizer
from specjax.data import corpus_files, train_tokenizer
from specjax.drafting import CrossTokenizerDrafter
from specjax.generation import SpecConfig, init_state, speculative_step
from specjax.generation.string_level import _propose
from specjax.vocab_map import build_vocab_map, token_bytes


@pytest.fixture(scope="module")
def tokenizers():
  files = corpus_files("train")
  return train_tokenizer(files[40:55], vocab_size=300), train_tokenizer(files[:20], vocab_size=512)


@pytest.fixture(scope="module")
def cross_draft(tiny_cfg):
  return specjax.Transformer(tiny_cfg.replace(**TINY_DRAFT, vocab_size=300), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def drafter(cross_draft, tokenizers):
  return CrossTokenizerDrafter(cross_draft, *tokenizers)


def sentencepiece_tokenizer():
  """Llama-2 style: "▁" for spaces, byte-fallback tokens, an <unk> special."""
  vocab = {"<unk>": 0, "<0x41>": 1, "<0xE2>": 2, "▁": 3, "t": 4, "h": 5, "e": 6, "▁the": 7}
  merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
  vocab.update({"▁t": 8, "he": 9})
  tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
  tok.add_special_tokens(["<unk>"])
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Sequence(
    [
      decoders.Replace("▁", " "),
      decoders.ByteFallback(),
      decoders.Fuse(),
      decoders.Strip(" ", 1, 0),
    ]
  )
  return tok


def test_token_bytes_reads_each_kind_of_vocabulary(tokenizers):
  _, target_tok = tokenizers
  pieces = token_bytes(target_tok)
  assert pieces[:3] == [None, None, None]  # <pad> <bos> <eos>
  text = "def f(x):\n    return x  # é\n"
  ids = target_tok.encode(text)
  assert b"".join(pieces[i] for i in ids) == text.encode()  # byte-level: exact bytes
  sp = token_bytes(sentencepiece_tokenizer())
  assert sp[0] is None and sp[1] == b"A" and sp[2] == b"\xe2"  # byte fallback: one byte
  assert sp[7] == b" the" and sp[3] == b" "


def test_vocab_map_tables_spell_the_same_text(tokenizers):
  draft_tok, target_tok = tokenizers
  m = build_vocab_map(draft_tok, target_tok)
  d_pieces, t_pieces = token_bytes(draft_tok), token_bytes(target_tok)
  shared = np.flatnonzero(m.draft_to_target >= 0)
  assert 0 < m.shared == shared.size < 300  # some strings shared, some not
  for d in shared:
    t = m.draft_to_target[d]
    assert d_pieces[d] == t_pieces[t] and m.target_to_draft[t] == d
    assert m.expansion_lengths[t] == 1 and m.expansion[t, 0] == d
  for t, b in enumerate(t_pieces):
    ids = m.expansion[t, : m.expansion_lengths[t]]
    if b is None:  # specials become the draft's special of the same name
      assert [d_pieces[i] for i in ids] == [None] and ids[0] == t
    else:
      assert b"".join(d_pieces[i] for i in ids) == b
  assert m.uncovered == 0 and m.max_expansion > 1


def test_vocab_map_specials_byte_fallback_and_uncovered_bytes():
  target = word_tokenizer(["<s>", "a", "é", "ab", "zz"], specials=["<s>"])
  draft = sentencepiece_tokenizer()
  m = build_vocab_map(draft, target, draft_vocab_size=12, target_vocab_size=7)
  assert m.shared == 0  # "a" is not a draft token, "▁" is a space
  # "é" = C3 A9: the draft has neither byte; one <unk> stands for the run.
  assert list(m.expansion[2, : m.expansion_lengths[2]]) == [0] and m.uncovered >= 2
  # Ids past the target tokenizer (a model's padding rows) and specials: the fallback.
  assert m.expansion_lengths[5] == m.expansion_lengths[6] == 1
  assert m.expansion[5, 0] == m.expansion[0, 0] == m.fallback == 0
  with pytest.raises(ValueError, match=r"draft_tokenizer has 10 ids.*vocab_size is 8"):
    build_vocab_map(draft, target, draft_vocab_size=8)


def test_tli_greedy_equals_the_targets_greedy_decoding(target, drafter, prompts, greedy_reference):
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=4, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  assert int(out.stats.proposed.sum()) > 0


def test_tli_with_the_coupled_verifier_gives_the_plain_coupled_text(target, drafter, prompts):
  """Drafter invariance reaches another tokenizer: with per-row keys, the
  text equals plain coupled decoding (tests/test_coupled.py has the others)."""
  run = dict(max_new_tokens=16, sampling=specjax.SamplingParams(0.7))
  keys = jax.random.split(jax.random.key(6), prompts[0].shape[0])
  plain = specjax.autoregressive_generate(target, *prompts, key=keys, **run)
  out = specjax.speculative_generate(target, drafter, *prompts, gamma=4, key=keys, **run)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  assert int(out.stats.proposed.sum()) > 0


def disguised(target, tokenizer, seed=3):
  """The target and its tokenizer with every non-special id renamed: another
  tokenizer (same strings, other ids) and a draft that is the target in disguise."""
  v = tokenizer.vocab_size
  perm = np.concatenate([np.arange(3), 3 + np.random.default_rng(seed).permutation(v - 3)])
  spec = json.loads(tokenizer._backend.to_str())
  spec["model"]["vocab"] = {s: int(perm[i]) for s, i in spec["model"]["vocab"].items()}
  renamed = Tokenizer.from_str(json.dumps(spec))
  old = np.argsort(perm)  # old id of each new id
  draft = specjax.Transformer(target.cfg, rngs=nnx.Rngs(0))
  nnx.update(draft, nnx.state(target, nnx.Param))
  draft.embed.embedding[...] = draft.embed.embedding[...][old]
  draft.lm_head[...] = draft.lm_head[...][:, old]
  return draft, renamed


def test_tli_with_a_disguised_target_accepts_everything(
  target, tokenizers, prompts, greedy_reference
):
  """A draft that is the target with its ids renamed: TLI maps them back, so at
  T = 0 every drafted token is accepted until the target's choice is a special
  token, which is never shared (a random target picks one now and then)."""
  draft, renamed = disguised(target, tokenizers[1])
  d = CrossTokenizerDrafter(draft, renamed, tokenizers[1])
  assert d.shared == 512 - 3 and d.max_expansion == 1
  out = specjax.speculative_generate(
    target, d, *prompts, gamma=4, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  assert float(out.stats.acceptance_rate) > 0.95


def test_tli_under_a_constraint_masks_q_over_the_targets_ids(target, drafter, tokenizers, prompts):
  """TLI's draft law is over the target's ids, so a constraint masks it as it
  masks p: greedy output is constrained greedy decoding, coupled output plain
  coupled decoding, and the disguised target (q = p once masked alike) has
  its drafts accepted (unmasked: 0.40)."""
  from specjax import constraints

  pieces = token_bytes(tokenizers[1])
  eos = [i for i, piece in enumerate(pieces) if piece is None]
  regex = constraints.compile_constraint(constraints.Regex("[a-z ]{4,40}\\."), pieces, eos, 512)
  rules = constraints.row_constraints([regex] * prompts[0].shape[0], 512)
  keys = jax.random.split(jax.random.key(6), prompts[0].shape[0])
  for sampling, key in ((specjax.GREEDY, None), (specjax.SamplingParams(0.7), keys)):
    run = dict(max_new_tokens=16, sampling=sampling, key=key, eos_id=eos, constraints=rules)
    plain = specjax.autoregressive_generate(target, *prompts, **run)
    out = specjax.speculative_generate(target, drafter, *prompts, gamma=4, **run)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
  draft, renamed = disguised(target, tokenizers[1])
  run = dict(max_new_tokens=16, sampling=specjax.GREEDY, eos_id=eos, constraints=rules)
  out = specjax.speculative_generate(
    target, CrossTokenizerDrafter(draft, renamed, tokenizers[1]), *prompts, gamma=4, **run
  )
  # Only the target's EOS, a special no draft can spell, is ever rejected.
  assert float(out.stats.acceptance_rate) > 0.95


def test_draft_cache_holds_the_committed_text_in_draft_ids(target, drafter, prompts):
  """After a few iterations the draft's cache equals a fresh prefill of D(s[:-2]):
  rollback and the expansion of the verifier's tokens are pure bookkeeping."""
  config = SpecConfig(4, 16, specjax.GREEDY, "greedy", None, 0, None)

  @functools.partial(jax.jit, static_argnames="config")
  def three_iterations(target, drafter, prompts, lengths, *, config):  # one compile
    state = init_state(target, drafter, prompts, lengths, jax.random.key(0), config)
    step = lambda _, state: speculative_step(target, drafter, state, config)
    return jax.lax.fori_loop(0, 3, step, state)

  state = three_iterations(target, drafter, *prompts, config=config)
  tokens, lengths = prompts
  s = [
    list(np.asarray(tokens[b, : lengths[b]]))
    + list(np.asarray(state.tokens[b, : state.num_generated[b]]))
    for b in range(tokens.shape[0])
  ]
  width = max(map(len, s)) - 2
  committed = np.array([row[:-2] + [0] * (width - len(row) + 2) for row in s], np.int32)

  @jax.jit  # one program for the reference, not one per eager op
  def fresh_prefill(drafter, committed, lengths):
    ids, counts = drafter._pack(committed, lengths)
    ids = ids[:, : drafter.model.cfg.max_seq_len]
    cache = drafter.model.init_cache(ids.shape[0], ids.shape[1])
    _, fresh = drafter.model.forward_cached(ids, cache, jnp.zeros((ids.shape[0], 1), jnp.int32))
    return counts.sum(axis=1), fresh

  base, fresh = fresh_prefill(drafter, committed, np.array([len(row) - 2 for row in s], np.int32))
  base = np.asarray(base)
  ds = state.drafter_state
  np.testing.assert_array_equal(ds.base, base)
  np.testing.assert_array_equal(ds.cache.lengths, base)
  for held, want in zip(ds.cache.k + ds.cache.v, fresh.k + fresh.v):
    held, want = np.asarray(held), np.asarray(want)  # sliced on the host: no program per slice
    for b in range(len(s)):
      np.testing.assert_allclose(held[b, :, : base[b]], want[b, :, : base[b]], atol=1e-5)


def test_no_shared_token_runs_as_plain_decoding(
  target, cross_draft, tokenizers, prompts, greedy_reference
):
  _, target_tok = tokenizers
  words = [f"\u2603snow{i}\u2603" for i in range(300)]
  d = CrossTokenizerDrafter(cross_draft, word_tokenizer(words), target_tok)
  assert d.shared == 0
  out = specjax.speculative_generate(
    target, d, *prompts, gamma=4, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  assert int(out.stats.proposed.sum()) == 0 and float(out.stats.acceptance_rate) == 0


def test_rows_past_the_drafts_cache_fall_back_to_plain_decoding(
  target, cross_draft, tokenizers, prompts, greedy_reference
):
  """A draft whose max_seq_len leaves no room for L ids per target id: rows stop
  drafting when their next iteration would not fit, the output is unchanged."""
  draft = specjax.Transformer(cross_draft.cfg.replace(max_seq_len=30), rngs=nnx.Rngs(1))
  d = CrossTokenizerDrafter(draft, *tokenizers)
  out = specjax.speculative_generate(
    target, d, *prompts, gamma=4, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  proposed = np.asarray(out.stats.proposed)
  assert proposed.min() < 4 * int(out.stats.row_iterations.min())  # some rows stopped


def test_tokenizers_that_disagree_with_their_models_are_refused(
  target, cross_draft, tokenizers, prompts
):
  draft_tok, target_tok = tokenizers
  with pytest.raises(ValueError, match=r"draft_tokenizer has 512 ids.*vocab_size is 300"):
    CrossTokenizerDrafter(cross_draft, target_tok, target_tok)
  with pytest.raises(ValueError, match="draft_tokenizer: expected a tokenizers.Tokenizer"):
    CrossTokenizerDrafter(cross_draft, "gpt2", target_tok)
  small_target = specjax.Transformer(target.cfg.replace(vocab_size=400), rngs=nnx.Rngs(0))
  d = CrossTokenizerDrafter(cross_draft, draft_tok, target_tok)
  tokens, lengths = prompts
  with pytest.raises(ValueError, match=r"target_tokenizer has 512 ids.*vocab_size is 400"):
    specjax.speculative_generate(
      small_target, d, tokens % 400, lengths, gamma=4, max_new_tokens=4, sampling=specjax.GREEDY
    )
  with pytest.raises(ValueError, match=r"target_tokenizer has 512 ids.*vocab_size is 400"):
    specjax.string_level_generate(
      small_target,
      cross_draft,
      draft_tok,
      target_tok,
      tokens % 400,
      lengths,
      gamma=4,
      max_new_tokens=4,
      sampling=specjax.GREEDY,
    )


def test_slem_greedy_equals_the_targets_greedy_decoding(
  target, cross_draft, tokenizers, prompts, greedy_reference
):
  out = specjax.string_level_generate(
    target,
    cross_draft,
    *tokenizers,
    *prompts,
    gamma=4,
    max_new_tokens=16,
    sampling=specjax.GREEDY,
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  t = out.timings
  assert t["iterations"] == int(out.stats.iterations) and t["host_ms_per_iteration"] > 0
  assert int(out.stats.proposed.sum()) > 0


def test_slem_proposes_the_target_spelling_of_the_drafted_text(tokenizers):
  _, target_tok = tokenizers
  backend, pieces = target_tok._backend, token_bytes(target_tok)
  committed = target_tok.encode("def add(a, b):\n    return")
  want = target_tok.encode("def add(a, b):\n    return a + b\n")[len(committed) :]
  assert _propose(backend, pieces, committed, b" a + b\n", 8, 16) == want
  assert _propose(backend, pieces, committed, b" a + b\n", 8, 2) == want[:2]
  assert _propose(backend, pieces, committed, b"", 8, 4) == []

"""Caches written in place (issue 31, requirement 2).

No loop body of autoregressive or speculative decoding (every drafter, both
loop modes) and no serving-engine step copies, selects, concatenates or
transposes a cache-sized buffer: each program is compiled, not run, and its
HLO read with `specjax.bench.hlo.cache_copies`. The caches' writes are in-place
dynamic-update-slice or scatter fusions. Jit boundaries that take a cache
donate it.

Shapes: batch 2, 2 kv heads of head_dim 64, about 130 cache slots. One layer's
K (or V) cache, 2 x 2 x 130 x 64 float32 (133 KB), is larger than any other
buffer of the loop bodies (attention scores `[B, N, T, S]` with T <= 9 are a
seventh of it; logits, laws and token buffers far less), so the size threshold
sees caches only. Batch 1 and single-kv-head models are left out: there XLA:CPU
drops the unit dimension from the attention's operands and copies the caches
of one-token calls (docs/performance.md, "The AR and draft loops copy their KV
caches"); `test_the_check_sees_the_copies_of_a_batch_of_one` shows it.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import specjax
from helpers import head_drafter, word_tokenizer
from specjax import trees
from specjax.bench import hlo
from specjax.bench.compile import lower_autoregressive, lower_speculative
from specjax.drafting import CrossTokenizerDrafter, NGramDrafter, TreeDrafter, layer_skip
from specjax.generation import SpecConfig, string_level
from specjax.sampling import GREEDY, RowSampling
from specjax.serving import slots

BATCH, WIDTH, NEW = 2, 8, 120  # rows, prompt width, new tokens
ATTENTION = dict(n_heads=2, n_kv_heads=2, head_dim=64)
SAMPLED = specjax.SamplingParams(temperature=1.0)
TREE = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])
WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" ", "\n"]


def layer_bytes(capacity: int, batch: int = BATCH) -> int:
  """Bytes of one layer's K (or V) cache of these models."""
  return batch * ATTENTION["n_kv_heads"] * capacity * ATTENTION["head_dim"] * 4


@pytest.fixture(scope="module")
def models():
  """(target, draft): the draft's attention has the target's shape (its caches
  are as large per layer), one layer and a narrower residual stream."""
  cfg = specjax.ModelConfig(
    vocab_size=64, d_model=64, n_layers=2, d_ff=64, max_seq_len=512, **ATTENTION
  )
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(cfg.replace(n_layers=1, d_model=32, d_ff=32), rngs=nnx.Rngs(1))
  return target, draft


def _prompts():
  return jnp.zeros((BATCH, WIDTH), jnp.int32), jnp.array([WIDTH, 3], jnp.int32)


# name -> (drafter, gamma) for (target, draft).
DRAFTERS = {
  "model": lambda t, d: (d, 3),
  "layer_skip": lambda t, d: (layer_skip(t, 1), 3),
  "eagle": lambda t, d: (head_drafter("eagle", t), 3),
  "medusa": lambda t, d: (head_drafter("medusa", t), 3),
  "early_exit": lambda t, d: (head_drafter("early_exit", t, exit_layer=1), 3),
  "ngram": lambda t, d: (NGramDrafter(t.cfg.vocab_size), 3),
  "tree": lambda t, d: (TreeDrafter(d, TREE), len(TREE)),
  "eagle_tree": lambda t, d: (head_drafter("eagle", t).replace(tree=TREE), len(TREE)),
  "eagle2": lambda t, d: (head_drafter("eagle", t).replace(tree=trees.DynamicTree(5, 3, 3, 2)), 5),
  "cross_tokenizer": lambda t, d: (
    CrossTokenizerDrafter(d, word_tokenizer(WORDS), word_tokenizer(WORDS)),
    3,
  ),
}


def _compiled(models, name: str, loop: str) -> tuple[str, int]:
  """(the compiled text of `name`'s generation program, one cache layer's bytes)."""
  target, draft = models
  if name == "ar":
    lowered = lower_autoregressive(target, BATCH, WIDTH, NEW, loop, 4, sampling=SAMPLED)
    return lowered.compile().as_text(), layer_bytes(WIDTH + NEW)
  drafter, gamma = DRAFTERS[name](target, draft)
  lowered = lower_speculative(target, drafter, BATCH, WIDTH, NEW, gamma, loop, 4, SAMPLED)
  return lowered.compile().as_text(), layer_bytes(WIDTH + NEW + gamma + 1)


def test_the_check_flags_a_select_over_a_cache():
  """A loop that selects between two caches before its in-place write is flagged
  (even with the select fused into the write); the write alone is not."""
  cache = jnp.zeros((BATCH, 256, 64))
  update = jnp.ones((BATCH, 1, 64))

  def write(i, cache):
    return jax.lax.dynamic_update_slice(cache, update * i, (0, i, 0))

  def select_then_write(cache, other):
    def body(i, carry):
      cache, other = carry
      return write(i, jnp.where(i % 2 == 0, cache, other)), other

    return jax.lax.fori_loop(0, 10, body, (cache, other))

  bad = jax.jit(select_then_write).lower(cache, cache).compile().as_text()
  assert [op.effective for op in hlo.cache_copies(bad, cache.nbytes)] == ["select"]
  good = jax.jit(lambda c: jax.lax.fori_loop(0, 10, write, c), donate_argnums=0)
  assert not hlo.cache_copies(good.lower(cache).compile().as_text(), cache.nbytes, entry=True)


def test_the_check_sees_the_copies_of_a_batch_of_one(models):
  """At batch 1 XLA:CPU copies the caches of one-token calls (a known backend
  limit, docs/performance.md): the check finds those copies."""
  target, _ = models
  capacity = WIDTH + NEW
  text = lower_autoregressive(target, 1, WIDTH, NEW).compile().as_text()
  assert hlo.cache_copies(text, layer_bytes(capacity, batch=1))


# Layer skip and early exit write caches as "model" does (CachedDrafting); n-gram lookup has none.
SHARED = ("layer_skip", "early_exit", "ngram")


@pytest.mark.sample(
  *(f"chunked-{name}" for name in ["ar", *DRAFTERS] if name not in SHARED),
  "while-ar",
  "while-model",
)
@pytest.mark.parametrize("name", ["ar", *DRAFTERS])
@pytest.mark.parametrize("loop", ["while", "chunked"])
def test_generation_loops_write_caches_in_place(models, loop, name):
  """No cache-sized copy, select, concatenate or transpose in any loop body; the
  chunked loop tests for finished rows once per chunk (its one while loop of
  unknown trip count: a drafter's loop runs a known number of trips)."""
  text, cache_bytes = _compiled(models, name, loop)
  assert not hlo.cache_copies(text, cache_bytes)
  if loop == "chunked":
    assert list(hlo.trip_counts(text).values()).count(None) == 1


@pytest.mark.parametrize("name", ["ar", "model", "eagle", "tree"])
def test_scanned_layers_write_caches_in_place(models, name):
  """Scanned layers (`scan_layers=True`: stacked `[B, L, K, S, H]` caches, a layer
  loop inside the decode loop): each layer writes its new slots into the stack in
  place; nothing copies, selects or concatenates a layer's cache (or the stack)."""
  from specjax.models.scan import scan_model

  scanned = tuple(scan_model(m) for m in models)
  text, cache_bytes = _compiled(scanned, name, "chunked")
  assert not hlo.cache_copies(text, cache_bytes)
  # The layer loop runs a known number of trips: one loop of unknown trip count.
  assert list(hlo.trip_counts(text).values()).count(None) == 1


def _engine(models, width: int = BATCH):
  """(target, drafter, a blank batch of `BATCH` slots, its `SlotConfig`)."""
  target, draft = models
  gamma = 3
  config = slots.SlotConfig(
    spec=SpecConfig(gamma=gamma, max_new_tokens=NEW, sampling=None, verifier="token"),
    capacity=WIDTH + NEW + gamma + 1,
    max_prompt_len=WIDTH,
  )
  drafter = specjax.drafting.as_drafter(draft)
  ones = jnp.ones((BATCH,), jnp.int32)
  state = slots.blank(
    target,
    drafter,
    jnp.zeros((BATCH, 1), jnp.int32),
    ones,
    ones,
    jnp.full((BATCH,), -1, jnp.int32),
    RowSampling.of(GREEDY, BATCH),
    jax.random.key(0),
    config=config,
  )
  return target, drafter, state, config


@pytest.mark.parametrize("gamma", [0, 3], ids=["plain", "speculative"])
def test_the_serving_step_writes_caches_in_place(models, gamma):
  """The engine's step on all its slots, entry computation included (the step is
  the body of the engine's host loop; its batch state is donated)."""
  target, drafter, state, config = _engine(models)
  lowered = slots.step.lower(
    target,
    drafter if gamma else None,
    state,
    jax.random.key(1),
    gamma=gamma,
    width=BATCH,
    config=config,
  )
  text = lowered.compile().as_text()
  assert not hlo.cache_copies(text, layer_bytes(config.capacity), entry=True)


@pytest.mark.xfail(
  strict=True,
  reason="a step on the first `width` < slots rows slices their caches out and writes them "
  "back (`rows.prefix`, `put_prefix`): the model takes a cache of its own batch",
)
def test_the_serving_step_on_fewer_rows_than_slots_does_not_slice_its_caches(models):
  target, drafter, state, config = _engine(models)
  text = (
    slots.step.lower(target, None, state, jax.random.key(1), gamma=0, width=1, config=config)
    .compile()
    .as_text()
  )
  sliced = [
    op
    for op in hlo.hlo_ops(text, entry=True)
    if op.effective == "slice" and op.bytes >= layer_bytes(config.capacity, batch=1)
  ]
  assert not sliced


def test_donated_caches_are_deleted(models):
  """The string-level loop's jitted calls and the engine's step donate what holds
  a cache: the input's buffers are gone after the call (updated in place)."""
  target, draft = models
  graph, params = nnx.split(draft)
  cache = draft.init_cache(BATCH, 64)
  feed = jnp.ones((BATCH, 4), jnp.int32)
  _, new = string_level._draft(
    graph, params, cache, feed, jnp.full((BATCH,), 4), jax.random.key(0), steps=3, sampling=GREEDY
  )
  assert all(x.is_deleted() for x in (*cache.k, *cache.v)) and not new.k[0].is_deleted()

  prompts, lengths = _prompts()
  config = SpecConfig(gamma=2, max_new_tokens=8, sampling=GREEDY, verifier="greedy")
  given = string_level.GivenProposal(gamma=2, vocab_size=target.cfg.vocab_size)
  graph, params = nnx.split(target)
  state = string_level._init(
    graph, params, given, prompts, lengths, jax.random.key(0), config=config
  )
  state = state.replace(
    drafter_state=(jnp.zeros((BATCH, 2), jnp.int32), jnp.ones((BATCH,), jnp.int32))
  )
  new = string_level._step(graph, params, given, state, config=config)
  assert state.target_cache.k[0].is_deleted() and not new.target_cache.k[0].is_deleted()

  target, _, batch, slot_config = _engine(models)
  new, _ = slots.step(
    target, None, batch, jax.random.key(1), gamma=0, width=BATCH, config=slot_config
  )
  assert batch.spec.target_cache.k[0].is_deleted() and not new.spec.target_cache.k[0].is_deleted()

"""The block drafter (DFlash) in the serving engine (issue 46, requirement 8).

* The engine: greedy requests of different lengths arrive at different steps,
  one is cancelled mid-stream, rows move and plain steps mix with drafting
  ones; each request's tokens are plain greedy decoding's, and after every
  drafting step each live row's context cache (the head's keys and values of
  s[:-1]) is the one rebuilt from its committed tokens. Constrained requests
  draft under their automaton and decode as constrained greedy decoding alone.
* Over HTTP with the official openai client: concurrent greedy completions,
  streamed or not, equal plain greedy decoding; a sampled one runs, its seed
  fixing its text.

One engine (random tiny models, a fresh head of block 4: gamma up to 3, byte
tokenizer, EOS = byte 0) serves the module; its engine-level tests run before
the HTTP server takes it over. A fresh head's drafts are mostly rejected, so
the context check, not the acceptance, shows that its state follows each row.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_serving_constraints import PIECES, alone, check_text
from test_serving_openai import TEMPLATE, openai_client, serve

from helpers import Schedule, head_drafter
from specjax import constraints as C
from specjax.data.chat import ChatTemplate
from specjax.serving import Engine, EngineConfig, Request, SpeculationPolicy
from specjax.serving import slots as programs
from specjax.testing import tiny_setup

EOS = 0  # what `alone` (test_serving_constraints) stops at
CONFIG = EngineConfig(
  slots=4, gamma=3, prompt_buckets=(32,), max_new_tokens=16, widths=(2, 4), constraint_states=256
)


@pytest.fixture(scope="module")
def setup():
  target, _, tokenizer = tiny_setup(0)
  drafter = head_drafter("dflash", target, block_size=4, draft_layers=2)
  engine = Engine(target, drafter, CONFIG, eos_ids=EOS)
  engine.warmup(timed_runs=0)
  return engine, target, tokenizer


def arrivals(n: int, seed: int) -> list[Request]:
  """`n` greedy requests: prompts of 1 to 31 ids, budgets of 1 to 16 tokens, a stop
  id on every third."""
  rng = np.random.default_rng(seed)
  return [
    Request(
      prompt=rng.integers(1, 256, int(rng.integers(1, 32))).tolist(),
      max_new_tokens=int(rng.integers(1, CONFIG.max_new_tokens + 1)),
      stop_id=int(rng.integers(1, 256)) if i % 3 == 0 else None,
    )
    for i in range(n)
  ]


def check_context(engine: Engine) -> int:
  """After a drafting step: each live row's DFlash context cache (lengths len(s) - 1,
  keys and values of every head layer) equals the one `slots.resync` rebuilds from
  the row's committed tokens by a prefill (what the engine does after plain
  steps). Reads the engine's batch; returns the rows checked (0 after a plain step:
  the drafter's state is then behind until the next resync)."""
  if engine.runner.drafter_stale:
    return 0
  state = engine.runner.state
  copy = jax.tree.map(jnp.copy, state)  # resync donates its input
  rebuilt = programs.resync(
    engine.target, engine.drafter, copy, width=CONFIG.slots, config=engine.runner.slot_config
  ).spec.drafter_state.cache
  carried = state.spec.drafter_state.cache
  done = np.asarray(state.spec.done)
  checked = 0
  for slot, live in enumerate(engine.scheduler.slots):
    if live is None or done[slot]:
      continue
    n = int(carried.lengths[slot])
    assert n == int(rebuilt.lengths[slot]), f"slot {slot}: context of {n} positions"
    for ours, theirs in zip((*carried.k, *carried.v), (*rebuilt.k, *rebuilt.v)):  # [B, K, S, H]
      np.testing.assert_allclose(ours[slot, :, :n], theirs[slot, :, :n], rtol=1e-4, atol=1e-5)
    checked += 1
  return checked


@pytest.mark.parametrize("gammas", [(3,), (3, 0, 0, 3, 3, 0)], ids=["drafting", "mixed"])
def test_greedy_requests_equal_plain_greedy_as_rows_join_and_leave(setup, gammas):
  engine, target, _ = setup
  engine.policy = Schedule(gammas)
  admitted = engine.counters["admitted_target_only"]
  batch = arrivals(10, seed=len(gammas))
  ids, checked = [], 0
  for i, request in enumerate(batch):  # arrivals spread over the steps
    ids.append(engine.submit(request))
    if i == 5:
      engine.cancel(ids[3])  # mid-stream or still queued: its slot comes back
    if i % 2:
      engine.step()
      checked += check_context(engine)
  while engine.has_work():
    engine.step()
    checked += check_context(engine)
  completions = [engine.pop_completion(i) for i in ids]
  expected = alone(target, batch)
  for i, (completion, tokens) in enumerate(zip(completions, expected)):
    if i == 3:
      assert completion.finish_reason == "cancelled"
      assert completion.tokens == tokens[: len(completion.tokens)]
    else:
      assert completion.tokens == tokens, i
  assert checked > 0 and sum(c.proposed for c in completions) > 0
  assert engine.counters["moves"] > 0  # live rows moved to the front (width 2)
  if 0 in gammas:  # some came in while plain steps ran: the head's context was rebuilt
    assert engine.counters["admitted_target_only"] > admitted


def test_constrained_requests_draft_under_their_automaton(setup):
  """Greedy, every step drafting: choice and regex requests beside free ones decode
  as constrained greedy decoding alone, in their language."""
  engine, target, _ = setup
  engine.policy = Schedule((3,))
  automata = {
    "choice": C.compile_constraint(C.Choice(("yes", "no", "maybe")), PIECES, [EOS], 256),
    "regex": C.compile_constraint(C.Regex("[a-e]{2,5}(xy|z)"), PIECES, [EOS], 256),
  }
  kinds = ["choice", None, "regex", "choice"]
  rng = np.random.default_rng(7)
  batch = [
    Request(
      prompt=rng.integers(1, 256, int(rng.integers(2, 12))).tolist(),
      max_new_tokens=CONFIG.max_new_tokens,
      constraint=None if kind is None else automata[kind],
    )
    for kind in kinds
  ]
  completions = engine.run(batch)
  assert [c.tokens for c in completions] == alone(target, batch)
  for kind, c in zip(kinds, completions):
    if kind is not None:  # each language's texts fit the budget: they end
      check_text(kind, c.tokens)
      assert c.finish_reason == "stop"
  assert sum(c.proposed for c in completions) > 0


# ------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def served(setup):
  engine, target, tokenizer = setup
  engine.policy = SpeculationPolicy("always", (3,))  # every step drafts with the head
  url, _, stop = serve(engine, tokenizer, ChatTemplate(TEMPLATE, {"bos_token": "^"}))
  yield openai_client(url), engine, target, tokenizer
  stop()


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_over_http_equal_plain_greedy(served, stream):
  """Three concurrent greedy completions (continuous batching): each text is plain
  greedy decoding's."""
  client, engine, target, tokenizer = served
  prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
  evaluated = engine.counters["evaluated"]  # drafted tokens verified

  def complete(prompt):
    out = client.completions.create(
      model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=stream
    )
    return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    texts = list(pool.map(complete, prompts))
  expected = alone(target, [Request(tokenizer.encode(p), 16) for p in prompts])
  assert texts == [tokenizer.decode(ids) for ids in expected]
  assert engine.counters["evaluated"] > evaluated


def test_a_sampled_completion_over_http_runs(served):
  client = served[0]

  def sample():
    return client.completions.create(
      model="tiny", prompt="def f(x):\n", max_tokens=16, temperature=0.9, top_p=0.9, seed=3
    )

  out = sample()
  assert 1 <= out.usage.completion_tokens <= 16
  assert out.choices[0].finish_reason in ("stop", "length")
  assert sample().choices[0].text == out.choices[0].text  # its seed fixes its text

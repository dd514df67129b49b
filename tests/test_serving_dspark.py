"""The sequential block drafter (DSpark) in the serving engine (issue 64, requirement 6):
greedy requests arriving at different steps, plain steps mixed with drafting ones,
decode as plain greedy decoding, the head's context cache following each row; over
HTTP with the official openai client, concurrent greedy completions equal plain greedy
decoding. The machinery is the block drafter's (tests/test_serving_dflash.py); this
checks that the sequential head and its confidence ride through it.
"""

import concurrent.futures

import pytest
from test_serving_constraints import alone
from test_serving_dflash import CONFIG, EOS, arrivals, check_context
from test_serving_openai import TEMPLATE, openai_client, serve

from helpers import Schedule, dspark_drafter
from specjax.data.chat import ChatTemplate
from specjax.serving import Engine, Request, SpeculationPolicy
from specjax.testing import tiny_setup


@pytest.fixture(scope="module")
def setup():
  target, _, tokenizer = tiny_setup(0)
  engine = Engine(target, dspark_drafter(target), CONFIG, eos_ids=EOS)
  engine.warmup(timed_runs=0)
  return engine, target, tokenizer


def test_greedy_requests_equal_plain_greedy_as_rows_join_and_leave(setup):
  engine, target, _ = setup
  engine.policy = Schedule((3, 0, 3, 3, 0))
  batch = arrivals(8, seed=11)
  ids, checked = [], 0
  for i, request in enumerate(batch):
    ids.append(engine.submit(request))
    if i % 2:
      engine.step()
      checked += check_context(engine)
  while engine.has_work():
    engine.step()
    checked += check_context(engine)
  completions = [engine.pop_completion(i) for i in ids]
  assert [c.tokens for c in completions] == alone(target, batch)
  assert checked > 0 and sum(c.proposed for c in completions) > 0


def test_greedy_completions_over_http_equal_plain_greedy(setup):
  engine, target, tokenizer = setup
  engine.policy = SpeculationPolicy("always", (3,))
  url, _, stop = serve(engine, tokenizer, ChatTemplate(TEMPLATE, {"bos_token": "^"}))
  try:
    client = openai_client(url)
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]

    def complete(prompt):
      out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
      return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
      texts = list(pool.map(complete, prompts))
  finally:
    stop()
  expected = alone(target, [Request(tokenizer.encode(p), 16) for p in prompts])
  assert texts == [tokenizer.decode(ids) for ids in expected]

"""Structured output in the server: constrained requests with speculation on.

* The engine: regex, choice, JSON-schema and free requests share steps (plain
  and speculative); each greedy request's text is constrained greedy decoding
  alone, each seeded one plain coupled decoding with its key, and every text
  is in its language. The tokens their constraints forced (forced drafts) are
  counted in each request's usage and sum to the engine's counter. New
  constraints recompile nothing; a full table packs the live automata
  (shifting their rows' states) or makes a request wait; equal automata share
  one block, whichever object holds them.
* Over HTTP with the official openai client: `response_format` (json_schema,
  json_object) and the `guided_regex` / `guided_choice` extensions, in
  completions and chat, streamed or not; bad ones get a 400 naming the field.
  A schema's forced tokens are in its usage and in /metrics alike.
* Tool calls over HTTP: "required" and a named function give constrained greedy
  decoding's calls (whole and streamed deltas alike), "auto" text or valid calls.

One engine (random tiny models, byte tokenizer, EOS = byte 0) serves the module;
its engine-level tests run before the HTTP server takes it over.
"""

import dataclasses
import json
import pickle
import re

import httpx
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from test_serving_openai import TEMPLATE, _speculation_counters, openai_client, serve

import specjax
from helpers import Schedule, traces
from specjax import constraints as C
from specjax.data.chat import ChatTemplate
from specjax.serving import Engine, EngineConfig, Request, request_key
from specjax.serving.constraint_table import ConstraintPlacement, content_key
from specjax.serving.tools import ToolCallParser, ToolFormat, ToolOffer
from specjax.testing import tiny_setup

EOS = 0
PIECES = [None] + [bytes([i]) for i in range(1, 256)]  # the byte tokenizer's, EOS special
CONFIG = EngineConfig(
  slots=4, gamma=3, prompt_buckets=(32,), max_new_tokens=64, widths=(4,), constraint_states=2048
)
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
  },
  "required": ["name", "args"],
}
REGEX = "[a-e]{2,5}(xy|z)"
CHOICES = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def setup():
  target, draft, tokenizer = tiny_setup(0)
  engine = Engine(target, draft, CONFIG, eos_ids=EOS)
  engine.warmup(timed_runs=0)
  automata = {
    "schema": C.compile_constraint(C.JsonSchema(SCHEMA), PIECES, [EOS], 256),
    "regex": C.compile_constraint(C.Regex(REGEX), PIECES, [EOS], 256),
    "choice": C.compile_constraint(C.Choice(CHOICES), PIECES, [EOS], 256),
  }
  return engine, target, tokenizer, automata


def alone(target, batch: list[Request]) -> list[list[int]]:
  """Each request decoded without the engine (constrained, greedy or coupled with
  its request key), cut at EOS, its stop id and its budget."""
  expected = []
  for r in batch:
    padded = jnp.asarray([list(r.prompt) + [0] * (32 - len(r.prompt))], jnp.int32)
    seeded = r.seed is not None and not r.sampling.greedy
    out = specjax.autoregressive_generate(
      target,
      padded,
      jnp.asarray([len(r.prompt)]),
      max_new_tokens=CONFIG.max_new_tokens,
      sampling=specjax.RowSampling.of([r.sampling]),
      key=request_key(r.seed, r.choice)[None] if seeded else None,
      eos_id=EOS,
      constraints=None if r.constraint is None else C.row_constraints([r.constraint], 256),
    )
    row = np.asarray(out.tokens)[0, : r.max_new_tokens].tolist()
    ends = [i for i, t in enumerate(row) if t in (EOS, r.stop_id)]
    expected.append(row[: ends[0] + 1] if ends else row)
  return expected


def check_text(kind: str, tokens: list[int]) -> None:
  assert tokens[-1] == EOS, "a constrained text ends where its language accepts"
  text = bytes(tokens[:-1]).decode()
  if kind == "schema":
    jsonschema.validate(json.loads(text), SCHEMA)
  elif kind == "regex":
    assert re.fullmatch(REGEX, text)
  else:
    assert text in CHOICES


@pytest.mark.parametrize("gammas", [(3,), (3, 0, 3)], ids=["speculative", "mixed"])
def test_constrained_requests_equal_constrained_decoding_alone(setup, gammas):
  engine, target, _, automata = setup
  engine.policy = Schedule(gammas)
  rng = np.random.default_rng(len(gammas))
  kinds = ["schema", "regex", None, "choice", "schema", "regex", "choice", None]
  batch = []
  for i, kind in enumerate(kinds):
    sampled = i % 2 == 1
    batch.append(
      Request(
        prompt=rng.integers(1, 256, int(rng.integers(2, 12))).tolist(),
        max_new_tokens=CONFIG.max_new_tokens,
        sampling=specjax.SamplingParams(temperature=0.9) if sampled else specjax.GREEDY,
        seed=100 + i if sampled else None,
        constraint=None if kind is None else automata[kind],
      )
    )
  forced_before = engine.counters["forced"]
  completions = engine.run(batch)
  assert [c.tokens for c in completions] == alone(target, batch)
  for kind, c in zip(kinds, completions):
    if kind is not None:
      check_text(kind, c.tokens)
      assert c.finish_reason == "stop"
    # Forced drafts (on by default) are counted apart, and within the accepted.
    assert 0 <= c.speculation.forced <= c.speculation.accepted
    if kind is None:
      assert c.speculation.forced == 0
  assert sum(c.speculation.forced for c, k in zip(completions, kinds) if k == "schema") > 0
  forced = sum(c.speculation.forced for c in completions)
  assert engine.counters["forced"] - forced_before == forced  # the counter sums the usages
  assert engine.counters["steps_gamma_3"] > 0


def test_new_constraints_recompile_nothing_and_a_full_table_packs_or_waits(setup):
  """Distinct regexes of 400-800 states: the 2,048-state table fills, a request
  whose automaton fits only beside fewer live ones waits (a slot stays free),
  and once the first (short) request ends the table is packed, moving the live
  rows' automata and shifting their states mid-text. Texts stay those decoded
  alone."""
  engine, target, _, _ = setup
  engine.policy = Schedule((3, 0))
  batch = [
    Request(
      prompt=[10 + i, 20, 30],
      max_new_tokens=budget,
      constraint=C.compile_constraint(C.Regex(f"[a-c]{{{n}}}z"), PIECES, [EOS], 256),
    )
    for i, (n, budget) in enumerate([(400, 3), (700, 64), (500, 40), (800, 64), (450, 5), (600, 9)])
  ]
  moved = []
  original = type(engine.scheduler).place

  def spy(self, automaton):
    live = sum(s is not None for s in self.slots)
    start = original(self, automaton)
    moved.append((start.waits, live))
    return start

  type(engine.scheduler).place = spy
  packs = engine.counters["constraint_table_packs"]
  try:
    with traces() as traced:
      completions = engine.run(batch)
  finally:
    type(engine.scheduler).place = original
  # No program of the engine's is traced again; only the host-to-device
  # conversions of a new table's arrays (of a new length) are.
  assert set(traced) <= {"convert_element_type", "stage"}, traced
  assert engine.counters["constraint_table_packs"] > packs
  assert any(waited and live < CONFIG.slots for waited, live in moved), "a request waited"
  # Budgets end them early: the constraint still held for every token committed.
  expected = alone(target, batch)
  assert [c.tokens for c in completions] == expected
  for c in completions:
    assert all(t in b"abc" for t in c.tokens)


def test_engine_refuses_constraints_it_cannot_hold(setup):
  engine, target, _, automata = setup
  big = C.compile_constraint(C.Regex("[a-c]{2100}"), PIECES, [EOS], 256)
  wide = C.compile_constraint(C.Regex("ab"), PIECES + [b"x"], [EOS], 257)
  for constraint, message in [
    (big, r"constraint has 2101 states; this engine's table holds at most 2047"),
    (wide, "constraint covers 257 ids; the model's vocabulary has 256"),
    (C.Regex("ab"), "constraint must be a specjax.constraints.Automaton"),
  ]:
    with pytest.raises(ValueError, match=message):
      engine.check(Request([1, 2], 4, constraint=constraint))
  plain = Engine(target, None, dataclasses.replace(CONFIG, constraint_states=0, policy="never"))
  with pytest.raises(ValueError, match="constraint: this engine has no constraint table"):
    plain.check(Request([1, 2], 4, constraint=automata["regex"]))


def test_equal_automata_share_one_block_whatever_object_holds_them():
  """The table interns automata by content: a copy (as a follower unpickles the
  leader's automaton per message, `specjax.serving.lockstep`) is found where the
  original was placed; a different automaton is not."""
  one = C.compile_constraint(C.Regex("[ab]{3}"), PIECES, [EOS], 256)
  copy = pickle.loads(pickle.dumps(one))
  other = C.compile_constraint(C.Regex("[ab]{4}"), PIECES, [EOS], 256)
  assert content_key(copy) == content_key(one) != content_key(other)
  placement = ConstraintPlacement(256, CONFIG.constraint_states)
  first = placement.plan(one, [])
  placement.commit(first)
  again = placement.plan(copy, [one])
  assert again.start == first.start and again.table is placement.table and not again.shifts
  assert placement.holds(copy) and not placement.holds(other)


# ------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def served(setup):
  engine, target, tokenizer, _ = setup
  engine.policy = specjax.serving.SpeculationPolicy("always", (3,))  # speculation on
  template = ChatTemplate(TOOL_TEMPLATE, {"bos_token": "^"})
  url, _, stop = serve(engine, tokenizer, template, tool_format=COMPACT)
  yield openai_client(url), url, target, tokenizer
  stop()


# Tools as the template names them (without tools: TEMPLATE's text), and calls in a
# short format, so that a call fits the engine's 64 tokens of bytes; a call begins
# with "@", which a logit_bias can make the random model write.
TOOL_TEMPLATE = "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
TOOL_TEMPLATE += TEMPLATE
COMPACT = ToolFormat("compact", "@\n", "\n@", "\n")
TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "f",
      "parameters": {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 2}},
        "required": ["a"],
      },
    },
  },
  {"type": "function", "function": {"name": "g"}},  # no parameters: {}
]


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "sig", "schema": SCHEMA}}
DEEP = {"type": "object", "properties": {}}
for _ in range(19):
  DEEP = {"type": "object", "properties": {"a": DEEP}}  # two levels a step
BIG = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
# The legacy completions endpoint has no response_format in the client: the body's.
FORMATS = {
  "schema": dict(extra_body={"response_format": JSON_SCHEMA}),
  "regex": dict(extra_body={"guided_regex": REGEX}),
  "choice": dict(extra_body={"guided_choice": list(CHOICES)}),
}


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("stream", [False, True])
def test_completions_follow_their_constraint(served, setup, kind, stream):
  """Greedy, speculation on: the text is constrained greedy decoding's, and in
  its language."""
  client, _, target, tokenizer = served
  automaton = setup[3][kind]
  prompt = "def f(x):\n"
  out = client.completions.create(
    model="tiny", prompt=prompt, max_tokens=64, temperature=0, stream=stream, **FORMATS[kind]
  )
  text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
  ids = tokenizer.encode(prompt)
  (expected,) = alone(target, [Request(ids, 64, constraint=automaton)])
  assert text == tokenizer.decode(expected)  # the byte tokenizer decodes EOS as "\x00"
  check_text(kind, tokenizer.encode(text))


def test_forced_tokens_in_usage_add_up_to_the_prometheus_counter(served):
  """A JSON-schema completion's forced tokens (its key names, spelled one byte
  per id, are forced): in its usage, within its accepted drafts, and the change
  in /metrics' `specjax_forced_tokens_total`."""
  client, url, *_ = served
  before = _speculation_counters(url)
  out = client.completions.create(
    model="tiny", prompt="def g(y):\n", max_tokens=64, temperature=0, **FORMATS["schema"]
  )
  after = _speculation_counters(url)
  spec = out.usage.model_extra["speculation"]
  assert 0 < spec["forced"] <= spec["accepted"]
  assert after["specjax_forced_tokens"] - before["specjax_forced_tokens"] == spec["forced"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_object_and_schema(served, stream):
  """Sampled chat choices: a json_object text that ends is a JSON object (one
  that runs out of tokens is cut: finish_reason "length"); a schema's texts
  (bounded: they fit the budget) validate."""
  client = served[0]
  messages = [{"role": "user", "content": "Return a JSON object."}]
  for fmt in ({"type": "json_object"}, JSON_SCHEMA):
    out = client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=64, temperature=0.8, seed=3, n=3,
      stream=stream, response_format=fmt,
    )  # fmt: skip
    texts, reasons = [""] * 3, [None] * 3
    for chunk in out if stream else [out]:
      for c in chunk.choices:
        texts[c.index] += (c.delta.content if stream else c.message.content) or ""
        reasons[c.index] = c.finish_reason or reasons[c.index]
    assert "stop" in reasons
    for text, reason in zip(texts, reasons):
      assert text.startswith("{")
      if reason == "stop":
        value = json.loads(text.removesuffix("\x00"))  # the byte tokenizer's EOS
        assert isinstance(value, dict)
        if fmt is JSON_SCHEMA:
          jsonschema.validate(value, SCHEMA)
      else:
        assert fmt is not JSON_SCHEMA and reason == "length"


@pytest.mark.parametrize(
  "body, param, message",
  [
    (
      {
        "response_format": {
          "type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "nope"}},
        }
      },
      "response_format.json_schema.schema",
      "not a schema outlines-core can compile",
    ),  # fmt: skip
    (
      {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
      "response_format.json_schema.schema",
      "is required",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text"),
    ({"response_format": {"type": "text", "grammar": 1}}, "response_format", "grammar is not"),
    ({"guided_regex": ""}, "guided_regex", "regex must be a non-empty string"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint per request"),
    # Never fits the table (2047 states besides FREE): refused after compiling, not cached.
    ({"guided_regex": "a{1000}b{1000}c{100}"}, "guided_regex", "constraint has 2101 states"),
    # Past a limit: refused before compiling.
    ({"guided_regex": "a{3000}"}, "guided_regex", "makes 3000 copies of one piece"),
    ({"guided_regex": "(a{40}){40}"}, "guided_regex", "makes 1600 copies"),
    ({"guided_regex": "a" * 5000}, "guided_regex", "5000 characters"),
    ({"guided_choice": ["x"] * 300}, "guided_choice", "300 options"),
    ({"guided_choice": ["x" * 9000] * 2}, "guided_choice", "18000 characters together"),
    (
      {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
      "response_format.json_schema.schema",
      "nests more than 32 levels deep",
    ),
    (
      {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG}}},
      "response_format.json_schema.schema",
      "bytes (as JSON)",
    ),
    (
      {
        "response_format": {
          "type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 100000}},
        }
      },
      "response_format.json_schema.schema",
      "repeats a piece",
    ),
  ],
)
def test_bad_constraints_get_a_400_naming_the_field(served, body, param, message):
  url = served[1]
  for path, base in (
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
  ):
    response = httpx.post(url + path, json={**base, "max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def _tool_answer(out, stream: bool, n: int = 1):
  """`[(content, [(id, name, arguments)], finish_reason)]` per choice, whole or
  joined from a stream's deltas (the first delta of a call has its id and name)."""
  if not stream:
    return [
      (
        c.message.content,
        [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
        c.finish_reason,
      )
      for c in out.choices
    ]
  content, calls, reasons = [None] * n, [{} for _ in range(n)], [None] * n
  for chunk in out:
    for c in chunk.choices:
      if c.delta.content:
        content[c.index] = (content[c.index] or "") + c.delta.content
      for t in c.delta.tool_calls or []:
        if t.id is not None:
          assert t.function.name and t.index not in calls[c.index]
          calls[c.index][t.index] = [t.id, t.function.name, ""]
        calls[c.index][t.index][2] += t.function.arguments or ""
      reasons[c.index] = c.finish_reason or reasons[c.index]
  return [(content[i], [tuple(v) for v in calls[i].values()], reasons[i]) for i in range(n)]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_constrained_greedy_decoding(served, setup, stream):
  """tool_choice "required" (one call) and a named function, greedy with
  speculation on: the text is constrained greedy decoding's of the rendered
  prompt, read back as OpenAI's tool_calls (streamed: deltas that join to them);
  the arguments validate."""
  client, _, target, tokenizer = served
  messages = [{"role": "user", "content": "hi"}]
  prompt = ChatTemplate(TOOL_TEMPLATE, {"bos_token": "^"}).render(
    messages, add_generation_prompt=True, tools=TOOLS
  )
  for choice in ("required", {"type": "function", "function": {"name": "g"}}):
    out = client.chat.completions.create(
      model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
      max_tokens=64, stream=stream, parallel_tool_calls=False,
    )  # fmt: skip
    ((content, calls, reason),) = _tool_answer(out, stream)
    offer = ToolOffer.of(TOOLS, choice, False, 8)
    automaton = C.compile_constraint(offer.constraint(COMPACT), PIECES, [EOS], 256)
    (expected,) = alone(target, [Request(tokenizer.encode(prompt), 64, constraint=automaton)])
    parser = ToolCallParser(COMPACT)
    parser.feed(bytes(expected[:-1]).decode(), final=True)
    assert expected[-1] == EOS and parser.finished_calls and len(parser.calls) == 1
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    assert [(name, args) for _, name, args in calls] == want
    assert content is None and reason == "tool_calls" and calls[0][0].startswith("call_")
    name, args = want[0]
    schema = TOOLS[0 if name == "f" else 1]["function"].get("parameters", {"type": "object"})
    jsonschema.validate(json.loads(args), schema)
    assert choice == "required" or name == "g"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_gives_text_or_valid_calls(served, stream):
  """Sampled "auto" choices after a conversation with a past call and its result:
  the random model's text (and then, for some, calls), or, with "@" favoured by a
  logit_bias, calls only; whole calls parse and validate, finish_reason
  "tool_calls" exactly when the calls are whole."""
  client = served[0]
  past = [
    {"role": "user", "content": "hi"},
    {
      "role": "assistant",
      "content": None,
      "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}
      ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
  ]
  answers = {}
  for bias in ({}, {"64": 100}):  # 64: "@"
    out = client.chat.completions.create(
      model="tiny", messages=past, tools=TOOLS, temperature=1.0, seed=5, n=4, max_tokens=64,
      stream=stream, logit_bias=bias,
    )  # fmt: skip
    answers[bool(bias)] = _tool_answer(out, stream, n=4)
  assert all(content and "@" not in content for content, *_ in answers[False])  # text first
  assert all(content is None and calls for content, calls, _ in answers[True])
  assert any(reason == "tool_calls" for *_, reason in answers[True])
  for _, calls, reason in answers[False] + answers[True]:
    for i, (_id, name, args) in enumerate(calls):
      assert name in ("f", "g")
      if i < len(calls) - 1 or reason == "tool_calls":  # whole: the last may be cut
        jsonschema.validate(
          json.loads(args), TOOLS[0]["function"]["parameters"] if name == "f" else {}
        )
    assert (reason == "tool_calls") == (bool(calls) and reason != "length")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_short_says_so_to_the_client(served, stream):
  """A call cut inside its arguments by max_tokens (29 tokens reach them) or a
  stop string: the official client reads finish_reason "length" / "stop" and the
  choice's `incomplete_tool_call`; the arguments written are not whole JSON."""
  client = served[0]
  messages = [{"role": "user", "content": "hi"}]
  f = {"type": "function", "function": {"name": "f"}}
  for cut, reason in (({"max_tokens": 31}, "length"), ({"stop": ['"a"']}, "stop")):
    out = client.chat.completions.create(
      model="tiny", messages=messages, tools=TOOLS, tool_choice=f, temperature=0,
      stream=stream, **{"max_tokens": 64, **cut},
    )  # fmt: skip
    chunks = list(out) if stream else [out]
    ((_, calls, finish),) = _tool_answer(chunks if stream else out, stream)
    last = [c for chunk in chunks for c in chunk.choices if c.finish_reason][-1]
    assert finish == reason and last.model_extra["incomplete_tool_call"] is True
    with pytest.raises(ValueError):
      json.loads(calls[-1][2])


def test_bad_tool_requests_name_the_field(served):
  url = served[1]
  base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
  for body, param, message in [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", '"none", "auto", "required" or'),
    (
      {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}},
      "tool_choice",
      "'h' is not among the tools",
    ),
    ({"tools": TOOLS, "guided_regex": "a"}, "tools", "one constraint per request"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
  ]:
    response = httpx.post(url + "/v1/chat/completions", json={**base, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error

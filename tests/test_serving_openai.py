"""The server as clients call it: the official `openai` client against a real
uvicorn server (127.0.0.1, bounded requests), every endpoint and field: models,
completions and chat (streamed and not, greedy equal to decoding alone), stop
strings, seeds under concurrent load, n choices, log-probabilities (the
target's law under the request's warp) and the Prometheus /metrics.

One engine on random tiny models (byte tokenizer: the text is noise) serves the
module; it records up to 3 alternatives per token, so its programs are its own.
"""

import concurrent.futures
import json
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import specjax
from helpers import serve_app
from specjax.data.chat import ChatTemplate
from specjax.sampling import SamplingParams, warp_probs
from specjax.serving import Engine, EngineConfig, Request, SpeculationPolicy
from specjax.serving.background import BackgroundEngine
from specjax.serving.http import make_app
from specjax.serving.limits import ServerLimits
from specjax.testing import tiny_setup

ENGINE = dict(slots=4, gamma=3, prompt_buckets=(32,), max_new_tokens=16, widths=(4,), logprobs=3)
PROMPT = "def add(a, b):\n"
# A checkpoint's template (tokenizer_config.json), with transformers' variables.
TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}"
  "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system first') }}"
  "{% endif %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
  "{% if add_generation_prompt %}<a>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]


def serve(engine, tokenizer, template, **options):
  """Runs `engine` behind the app (`make_app`'s `options`) on a free port (a
  daemon thread); returns `(url, background, stop)`."""
  engine.warmup(timed_runs=0)
  background = BackgroundEngine(engine)
  # Correctness here, not the limits (tests/test_serving_limits.py): json_object's
  # compile takes seconds, more on a busy machine, so a generous time limit.
  app = make_app(
    background, tokenizer, "tiny", template, limits=ServerLimits(compile_timeout_s=300), **options
  )
  url, server, thread = serve_app(app)

  def stop():
    server.should_exit = True
    thread.join(10)
    background.close()

  return url, background, stop


def openai_client(url):
  return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(client, url, background, target, tokenizer, template): the tiny engine behind
  the app (its chat template read from a checkpoint directory), on a free port."""
  checkpoint = tmp_path_factory.mktemp("checkpoint")
  (checkpoint / "tokenizer_config.json").write_text(
    json.dumps({"chat_template": TEMPLATE, "bos_token": "^"})
  )
  template = ChatTemplate.from_checkpoint(str(checkpoint))
  target, draft, tokenizer = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(policy="adaptive", **ENGINE))
  url, background, stop = serve(engine, tokenizer, template)
  yield openai_client(url), url, background, target, tokenizer, template
  stop()


@pytest.fixture
def client(served):
  return served[0]


def solo(target, prompt: list[int], n: int = 16) -> list[int]:
  """Greedy decoding alone (no engine): `n` tokens after `prompt`, padded to the
  engine's bucket (one compiled program)."""
  padded = np.zeros((1, 32), np.int32)
  padded[0, : len(prompt)] = prompt
  out = specjax.autoregressive_generate(
    target,
    jnp.asarray(padded),
    jnp.asarray([len(prompt)]),
    max_new_tokens=n,
    sampling=specjax.GREEDY,
  )
  return np.asarray(out.tokens)[0].tolist()


def target_logprobs(target, prompt, tokens, sampling=SamplingParams()):
  """`[n, V]`: the target's log-law of each of `tokens` after `prompt` (teacher-forced)."""
  logits = target(jnp.asarray([prompt + tokens[:-1]], jnp.int32))[0, len(prompt) - 1 :]
  with np.errstate(divide="ignore"):  # top-k: log 0 = -inf
    return np.log(np.asarray(warp_probs(logits, sampling)))


@pytest.fixture(scope="module")
def greedy(served):
  """(ids, text) of PROMPT decoded greedily alone."""
  *_, target, tokenizer, _ = served
  ids = solo(target, tokenizer.encode(PROMPT))
  return ids, tokenizer.decode(ids)


def test_models(client):
  (model,) = client.models.list()
  assert model.id == "tiny" and model.object == "model" and model.owned_by == "specjax"
  with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here; use 'tiny'"):
    client.completions.create(model="gpt-4", prompt=PROMPT)


def test_completions_equal_decoding_alone(client, greedy):
  ids, text = greedy
  out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
  (choice,) = out.choices
  assert choice.text == text and choice.finish_reason == "length" and choice.index == 0
  assert out.object == "text_completion" and out.model == "tiny"
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 16)
  stream = client.completions.create(
    model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True
  )
  chunks = list(stream)
  assert "".join(c.choices[0].text for c in chunks) == text
  assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_equals_decoding_alone(served):
  client, _, _, target, tokenizer, template = served
  prompt = tokenizer.encode(template.render(MESSAGES, add_generation_prompt=True))
  assert tokenizer.decode(prompt) == "^<s>Be terse.<u>hi<a>"  # bos_token from the config
  text = tokenizer.decode(solo(target, prompt, 10))
  out = client.chat.completions.create(
    model="tiny", messages=MESSAGES, max_tokens=10, temperature=0
  )
  (choice,) = out.choices
  assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
  assert choice.message.role == "assistant" and choice.message.content == text
  assert choice.finish_reason == "length" and out.usage.prompt_tokens == len(prompt)
  assert out.usage.completion_tokens == 10
  chunks = list(
    client.chat.completions.create(
      model="tiny",
      messages=MESSAGES,
      max_completion_tokens=10,
      temperature=0,
      stream=True,
      stream_options={"include_usage": True},
    )
  )
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
  assert chunks[-2].choices[0].finish_reason == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage == out.usage


def test_chat_refusals(served):
  client, _, background, _, tokenizer, _ = served
  bad = [{"role": "wizard", "content": "hi"}]
  with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role must be one of"):
    client.chat.completions.create(model="tiny", messages=bad)
  with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
    client.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)
  with pytest.raises(openai.BadRequestError, match=r"logprobs must be an integer in \[0, 3\]") as e:
    client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=4)
  assert e.value.param == "top_logprobs"
  tools = [{"type": "function", "function": {"name": "f"}}]
  with pytest.raises(openai.BadRequestError, match="shows no tool-call format") as e:
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools)
  assert e.value.param == "tools"
  shown = client.chat.completions.create(  # "none" only shows them: no format needed
    model="tiny", messages=MESSAGES, tools=tools, tool_choice="none", max_tokens=2
  )
  assert shown.choices[0].message.tool_calls is None
  # A checkpoint without a chat template: a clear 400.
  with TestClient(make_app(background, tokenizer, "tiny")) as plain:
    response = plain.post("/v1/chat/completions", json={"messages": MESSAGES})
  assert response.status_code == 400
  error = response.json()["error"]
  assert "has no chat template" in error["message"] and error["param"] == "messages"


def _stop_in(tokenizer, ids, stop) -> int:
  """How many tokens it takes for the text to contain `stop`."""
  return next(m for m in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:m]))


def test_stop_strings(served, greedy):
  client, url, *_, tokenizer, _ = served
  ids, text = greedy
  # Two printable characters in the middle of the text: a stop string spanning tokens.
  j = next(
    j
    for j in range(1, len(text) - 1)
    if text[j : j + 2].isprintable() and "\ufffd" not in text[j : j + 2]
  )
  stop = text[j : j + 2]
  expected, used = text[: text.find(stop)], _stop_in(tokenizer, ids, stop)
  before = httpx.get(url + "/metrics.json").json()["requests"]
  kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
  out = client.completions.create(**kwargs, stop=["never here", stop])
  assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
  assert out.usage.completion_tokens == used < 16
  chunks = list(
    client.completions.create(
      **kwargs, stop=stop, stream=True, stream_options={"include_usage": True}
    )
  )
  assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
  assert chunks[-2].choices[0].finish_reason == "stop"
  # The token counts agree; usage.speculation counts the steps each row ran, and a row
  # stopped by a stop string runs until the engine hears of it (timing decides).
  tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
  assert [getattr(chunks[-1].usage, k) for k in tokens] == [getattr(out.usage, k) for k in tokens]
  # A stop string whose beginning appears but never all of it: held back, then released.
  partial = text[j] + "\x00\x01"
  chunks = list(client.completions.create(**kwargs, stop=partial, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == text
  assert chunks[-1].choices[0].finish_reason == "length"
  # Rows stopped by a stop string were finished in the engine (not cancelled), and freed.
  after = httpx.get(url + "/metrics.json").json()["requests"]
  assert after["completed"] == before["completed"] + 3 and after["cancelled"] == before["cancelled"]
  assert after["live"] == 0
  with pytest.raises(openai.BadRequestError, match="stop must be up to 4 non-empty strings"):
    client.completions.create(model="tiny", prompt=PROMPT, stop=list("abcde"))


def test_seed_same_text_under_concurrent_load(client):
  seeded = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
  alone = client.completions.create(**seeded).choices[0].text

  def noise(i):  # unseeded sampled and greedy requests of other lengths
    prompt = "x" * (1 + 3 * i)
    return client.completions.create(
      model="tiny", prompt=prompt, max_tokens=5 + i, temperature=i % 2
    )

  def seeded_request(i):
    if i % 2:
      chunks = client.completions.create(**seeded, stream=True)
      return "".join(c.choices[0].text for c in chunks)
    return client.completions.create(**seeded).choices[0].text

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    loads = [pool.submit(noise, i) for i in range(6)]
    texts = list(pool.map(seeded_request, range(6)))
    assert all(f.result().choices for f in loads)
  assert texts == [alone] * 6
  two = client.completions.create(**seeded, n=2).choices
  assert two[0].text == alone and two[1].text != alone  # choice i: key (seed, i)
  assert client.completions.create(**{**seeded, "seed": 99}).choices[0].text != alone


@pytest.fixture(scope="module")
def served_off(served):
  """A second server on the same models with speculation off (policy "never")."""
  _, _, _, target, tokenizer, template = served
  _, draft, _ = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(policy="never", **ENGINE))
  url, _, stop = serve(engine, tokenizer, template)
  yield openai_client(url)
  stop()


def test_seeded_text_is_the_same_with_speculation_on_and_off(served, served_off):
  """Both servers: a seeded request gets one text from the server that never
  speculates and, under concurrent load, from the one that does (streamed or
  not, completions and chat), and with its own `speculation` settings; an
  unseeded sampled request gets other texts."""
  on = served[0]
  seeded = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, seed=4321)
  chat = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=8)
  off_text = served_off.completions.create(**seeded).choices[0].text
  off_chat = served_off.chat.completions.create(**chat).choices[0].message.content

  def noise(i):
    return on.completions.create(
      model="tiny", prompt="y" * (2 + i), max_tokens=4 + i, temperature=1
    )

  def request(i):
    if i % 3 == 0:
      return on.chat.completions.create(**chat).choices[0].message.content
    extra = [None, {"speculation": {"max_draft_tokens": 1}}, {"speculation": {"enabled": False}}]
    if i % 3 == 1:
      chunks = on.completions.create(**seeded, stream=True, extra_body=extra[i % 2])
      return "".join(c.choices[0].text for c in chunks)
    return on.completions.create(**seeded, extra_body=extra[2 * (i % 2)]).choices[0].text

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    loads = [pool.submit(noise, i) for i in range(5)]
    texts = list(pool.map(request, range(9)))
    assert all(f.result().choices for f in loads)
  assert texts == [off_chat if i % 3 == 0 else off_text for i in range(9)]
  assert len(set(texts)) == 2 and off_text
  unseeded = {k: v for k, v in seeded.items() if k != "seed"}
  assert {on.completions.create(**unseeded).choices[0].text for _ in range(3)} != {off_text}
  with pytest.raises(openai.BadRequestError, match="speculation.max_draft_tokens must be") as e:
    on.completions.create(**seeded, extra_body={"speculation": {"max_draft_tokens": -1}})
  assert e.value.body["param"] == "speculation.max_draft_tokens"
  with pytest.raises(openai.BadRequestError, match="speculation"):
    on.completions.create(**seeded, extra_body={"speculation": {"enable": False}})


def test_n_choices(client, greedy):
  ids, text = greedy
  out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, n=3)
  assert [c.index for c in out.choices] == [0, 1, 2]
  assert [c.text for c in out.choices] == [text] * 3 and out.usage.completion_tokens == 48
  chunks = list(
    client.chat.completions.create(
      model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, n=2, stream=True
    )
  )
  per_choice = ["", ""]
  for c in chunks:
    per_choice[c.choices[0].index] += c.choices[0].delta.content or ""
  assert per_choice[0] == per_choice[1] != ""
  with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
    client.completions.create(model="tiny", prompt=PROMPT, n=0)


def test_logprobs_over_http(served, greedy):
  client, _, _, target, tokenizer, _ = served
  ids, _ = greedy
  # Greedy: the law at temperature 1, whose argmax greedy decoding takes.
  law = target_logprobs(target, tokenizer.encode(PROMPT), ids)
  want = law[np.arange(16), ids]
  out = client.completions.create(
    model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2
  )
  lp = out.choices[0].logprobs
  assert lp.tokens == [tokenizer.decode([t]) for t in ids]
  np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
  # Keyed by text: two alternatives that decode alike (bytes >= 128: U+FFFD) are one key.
  assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
  for top, token, value in zip(lp.top_logprobs, lp.tokens, want):
    assert abs(max(top.values()) - value) < 1e-4 and token in top  # greedy: the top one
  assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens])[:-1].tolist()
  chat = client.chat.completions.create(
    model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
  )
  content = chat.choices[0].logprobs.content
  assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
  assert all(
    c.logprob == c.top_logprobs[0].logprob and c.bytes == list(c.token.encode()) for c in content
  )
  plain = client.chat.completions.create(
    model="tiny", messages=MESSAGES, max_tokens=4, temperature=0
  )
  assert plain.choices[0].logprobs is None
  with pytest.raises(openai.BadRequestError, match=r"logprobs must be an integer in \[0, 3\]"):
    client.completions.create(model="tiny", prompt=PROMPT, logprobs=4)


def test_logprobs_follow_the_requests_warp(served):
  """Sampled rows (speculative and plain steps): each token's log-probability
  and alternatives are the target's warped law at its position."""
  _, _, background, target, tokenizer, _ = served
  sampling = SamplingParams(temperature=0.8, top_k=40)
  prompt = tokenizer.encode(PROMPT)
  events = []
  done = threading.Event()

  def on_event(event):
    events.append(event)
    if event.finished:
      done.set()

  background.submit(Request(prompt, 16, sampling, logprobs=3), on_event)
  assert done.wait(60)
  tokens = [t for e in events for t in e.tokens]
  entries = [x for e in events for x in e.logprobs]
  assert len(entries) == len(tokens) == 16
  law = target_logprobs(target, prompt, tokens, sampling)
  for (value, top), token, row in zip(entries, tokens, law):
    assert abs(value - row[token]) < 1e-4
    ids, values = zip(*top)
    np.testing.assert_allclose(values, np.sort(row)[::-1][:3], atol=1e-4)
    assert np.all(row[list(ids)] > -np.inf)


def test_prometheus_metrics(client, served):
  url = served[1]
  client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
  response = httpx.get(url + "/metrics")
  assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
  families = {f.name: f for f in text_string_to_metric_families(response.text)}
  samples = {
    (s.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples
  }
  assert samples[("specjax_requests_total", (("outcome", "completed"),))] >= 1
  assert samples[("specjax_generated_tokens_total", ())] >= 4
  assert samples[("specjax_time_to_first_token_seconds_count", ())] >= 1
  assert samples[("specjax_time_per_output_token_seconds_count", ())] >= 1
  assert families["specjax_time_to_first_token_seconds"].type == "histogram"
  for gauge in ("requests_running", "queue_depth", "acceptance_rate", "draft_length"):
    assert families[f"specjax_{gauge}"].type == "gauge"
  assert samples[("specjax_queue_depth", ())] == 0
  assert 0 <= samples[("specjax_acceptance_rate", ())] <= 1
  assert {"0", "3"} <= {s.labels["draft_length"] for s in families["specjax_steps"].samples}
  as_json = httpx.get(url + "/metrics", params={"format": "json"}).json()
  assert as_json["requests"]["completed"] >= 1
  assert httpx.get(url + "/metrics.json").json().keys() == as_json.keys()


def test_engine_refusals_name_the_field(served):
  background = served[2]
  with pytest.raises(ValueError, match=r"seed must be an integer in \[-9223372036854775808"):
    background.engine.check(Request([1], 4, SamplingParams(1.0), seed=2**64))
  hot = Engine.__new__(Engine)  # the check alone, for an engine that never takes plain steps
  hot.config = EngineConfig(policy="always", **ENGINE)
  hot.vocab_size = 256
  hot.check(Request([1], 4, SamplingParams(1.0), seed=1))  # seeded rows speculate (coupled)
  with pytest.raises(ValueError, match=r"max_draft_tokens must be an integer in \[0, 2147483647\]"):
    hot.check(Request([1], 4, max_draft_tokens=-2))


def _speculation_counters(url) -> dict:
  """/metrics' drafted, accepted and forced token counters (by position: `(name, position)`)."""
  out = {}
  for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
    for s in family.samples:
      if s.name.endswith("_by_position_total"):
        out[s.name.removesuffix("_by_position_total"), int(s.labels["position"])] = s.value
      elif s.name in ("specjax_drafted_tokens_total", "specjax_accepted_tokens_total"):
        out[s.name.removesuffix("_total")] = s.value
      elif s.name == "specjax_forced_tokens_total":
        out["specjax_forced_tokens"] = s.value
  return out


def test_usage_speculation_adds_up_to_the_prometheus_counters(served, greedy):
  """Completions and chats, streamed (usage in the last chunk) and not, n = 1 and 2,
  greedy and sampled, one stopped by a stop string: each usage.speculation's
  figures (per choice with n > 1) sum to the change in /metrics' counters."""
  client, url, background, *_ = served
  _, text = greedy
  stop = next(text[j : j + 2] for j in range(1, len(text) - 1) if text[j : j + 2].isprintable())
  engine = background.engine
  adaptive = background.call(lambda e: e.policy)
  drafting = SpeculationPolicy("always", engine.config.draft_lengths)  # every step drafts
  background.call(lambda e: setattr(e, "policy", drafting))
  try:
    deadline = time.monotonic() + 30
    while background.call(lambda e: e.has_work()) and time.monotonic() < deadline:
      time.sleep(0.05)  # earlier tests' rows have all finished
    before = _speculation_counters(url)
    usages = []
    base = dict(model="tiny", max_tokens=12)
    chat = dict(base, messages=MESSAGES)
    usages.append(client.completions.create(**base, prompt=PROMPT, temperature=0).usage)
    usages.append(client.chat.completions.create(**chat, temperature=0.9, n=2).usage)
    usage = {"include_usage": True}
    for stream in (
      client.completions.create(**base, prompt=PROMPT, temperature=0, stop=stop, stream=True,
                                stream_options=usage),
      client.chat.completions.create(**chat, temperature=0.7, n=2, stream=True,
                                     stream_options=usage),
    ):  # fmt: skip
      chunks = list(stream)
      assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
      usages.append(chunks[-1].usage)
    after = _speculation_counters(url)
  finally:
    background.call(lambda e: setattr(e, "policy", adaptive))
  figures = [u.model_extra["speculation"] for u in usages]
  gamma = engine.config.gamma
  for f in figures:
    assert len(f["drafted_at_position"]) == len(f["accepted_at_position"]) == gamma
    assert sum(f["drafted_at_position"]) == f["drafted"] >= f["accepted"]
    assert sum(f["accepted_at_position"]) == f["accepted"] and f["forced"] == 0
    per_choice = f.get("choices")
    if per_choice is None:
      continue
    assert [c["index"] for c in per_choice] == [0, 1]
    for key in ("drafted", "accepted", "forced"):
      assert sum(c[key] for c in per_choice) == f[key]
    for key in ("drafted_at_position", "accepted_at_position"):
      assert np.sum([c[key] for c in per_choice], axis=0).tolist() == f[key]
  assert ["choices" in f for f in figures] == [False, True, False, True]
  total = lambda key: sum(f[key] for f in figures)
  assert total("drafted") == after["specjax_drafted_tokens"] - before["specjax_drafted_tokens"] > 0
  assert total("accepted") == after["specjax_accepted_tokens"] - before["specjax_accepted_tokens"]
  assert total("forced") == after["specjax_forced_tokens"] - before["specjax_forced_tokens"] == 0
  for i in range(gamma):
    for kind in ("drafted", "accepted"):
      name = f"specjax_{kind}_tokens"
      counted = after[name, i + 1] - before[name, i + 1]
      assert sum(f[f"{kind}_at_position"][i] for f in figures) == counted


def test_user_is_checked_and_otherwise_ignored(client, greedy):
  """OpenAI's end-user identifier: a string of at most 256 characters, else a 400
  naming `user`; it changes nothing in the answer."""
  _, text = greedy
  kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
  assert client.completions.create(**kwargs, user="alice-42").choices[0].text == text
  chat = client.chat.completions.create(
    model="tiny", messages=MESSAGES, max_tokens=2, temperature=0, user="u" * 256
  )
  assert chat.choices[0].finish_reason == "length"
  for user, message in (("u" * 257, "user has at most 256 characters, got 257"), (5, "user: ")):
    with pytest.raises(openai.BadRequestError, match=message) as error:
      client.completions.create(**kwargs, user=user)
    assert error.value.body["param"] == "user"

"""The serving engine: continuous batching changes nothing, slots come back clean,
nothing recompiles, one request's error is its own; the speculation policy."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import SERVING_ENGINE, Schedule, traces
from specjax.serving import (
  Engine,
  EngineConfig,
  Request,
  SpeculationPolicy,
  fit_config,
  request_key,
)
from specjax.serving import slots as programs
from specjax.serving.metrics import engine_metrics
from specjax.testing import tiny_setup
from specjax.theory import expected_tokens_per_iteration

V = 256
CONFIG = EngineConfig(**SERVING_ENGINE)  # gammas (0, 3): plain and drafting steps


@pytest.fixture(scope="module")
def pair():
  target, draft, _ = tiny_setup(0)  # the draft: a noisy copy, agreeing often, not always
  return target, draft


@pytest.fixture(scope="module")
def engine(pair):
  target, draft = pair
  engine = Engine(target, draft, CONFIG, eos_ids=7)
  engine.warmup(timed_runs=0)
  return engine


def requests(n, seed, sampled=False):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    sampling = specjax.GREEDY
    if sampled and i % 2:
      sampling = specjax.SamplingParams(temperature=0.8, top_k=int(rng.integers(0, 40)), top_p=0.9)
    out.append(
      Request(
        prompt=rng.integers(0, V, int(rng.integers(1, 17))).tolist(),
        max_new_tokens=int(rng.integers(1, CONFIG.max_new_tokens + 1)),
        sampling=sampling,
        stop_id=int(rng.integers(0, 200)) if i % 3 == 0 else None,
      )
    )
  return out


def solo(target, batch, eos=7):
  """Each request decoded greedily without the engine: one autoregressive_generate
  call (greedy rows are independent), each row cut at its EOS or stop id and budget."""
  prompts = np.zeros((len(batch), CONFIG.max_prompt_len), np.int32)
  for i, r in enumerate(batch):
    prompts[i, : len(r.prompt)] = r.prompt
  out = specjax.autoregressive_generate(
    target,
    jnp.asarray(prompts),
    jnp.asarray([len(r.prompt) for r in batch]),
    max_new_tokens=CONFIG.max_new_tokens,
    sampling=specjax.GREEDY,
  )
  expected = []
  for r, row in zip(batch, np.asarray(out.tokens).tolist()):
    row = row[: r.max_new_tokens]
    ends = [i for i, t in enumerate(row) if t in (eos, r.stop_id)]
    expected.append(row[: ends[0] + 1] if ends else row)
  return expected


@pytest.mark.parametrize(
  "gammas", [(3,), (0,), (3, 0, 0, 3, 3, 0)], ids=["always", "never", "mixed"]
)
def test_greedy_requests_equal_decoding_each_alone(pair, engine, gammas):
  target, _ = pair
  engine.policy = Schedule(gammas)
  admitted = engine.counters["admitted_target_only"]
  batch = requests(10, seed=len(gammas))
  completions = engine.run(batch)
  for request, completion, alone in zip(batch, completions, solo(target, batch)):
    assert completion.tokens == alone
    last = completion.tokens[-1]
    stopped = last in (7, request.stop_id)
    assert completion.finish_reason == ("stop" if stopped else "length")
    assert completion.ttft > 0 and completion.e2e >= completion.ttft
  if 0 in gammas and 3 in gammas:  # some came in while plain steps ran: no drafter prefill
    assert engine.counters["admitted_target_only"] > admitted
  if gammas == (3,):
    assert sum(c.evaluated for c in completions) > 0
    assert 0 < sum(c.accepted for c in completions) < sum(c.evaluated for c in completions)


def test_tokens_stream_as_they_are_committed(pair, engine):
  engine.policy = Schedule((3,))
  request = Request(prompt=[1, 2, 3], max_new_tokens=CONFIG.max_new_tokens)
  rid = engine.submit(request)
  streamed, finished = [], []
  while engine.has_work():
    for event in engine.step():
      assert event.request_id == rid
      streamed.append(event.tokens)
      finished.append(event.finished)
  assert finished[-1] and not any(finished[:-1])
  assert len(streamed) > 2 and all(len(t) <= CONFIG.gamma + 1 for t in streamed)
  assert [t for chunk in streamed for t in chunk] == engine.completion(rid).tokens


def test_reused_slots_hold_no_stale_state(pair, engine):
  """After completions and a mid-stream cancellation, requests in reused slots
  decode exactly as on a fresh engine (greedy: any stale cache entry would show)."""
  target, draft = pair
  engine.policy = Schedule((3, 0, 3))
  long = Request(prompt=[5] * 16, max_new_tokens=CONFIG.max_new_tokens)
  ids = [engine.submit(long) for _ in range(CONFIG.slots)]
  engine.step()
  engine.step()
  engine.cancel(ids[1])  # mid-stream
  events = engine.step()
  assert any(e.request_id == ids[1] and e.finish_reason == "cancelled" for e in events)
  assert engine.live_requests() == CONFIG.slots - 1
  while engine.has_work():
    engine.step()
  later = requests(6, seed=99)
  reused = engine.run(later)
  fresh = Engine(target, draft, CONFIG, eos_ids=7)
  fresh.policy = Schedule((3, 0, 3))
  for a, b, alone in zip(reused, fresh.run(later), solo(target, later)):
    assert a.tokens == b.tokens == alone


def test_no_recompilation_while_fifty_requests_come_and_go(engine):
  engine.policy = Schedule((3, 3, 0))
  batch = requests(50, seed=5, sampled=True)
  ids = []
  with traces() as traced:
    for i, request in enumerate(batch):  # arrivals spread over the steps
      ids.append(engine.submit(request))
      if i % 7 == 3:
        engine.cancel(ids[-2])
      if i % 2:
        engine.step()
    while engine.has_work():
      engine.step()
  assert not traced
  reasons = {engine.completion(i).finish_reason for i in ids}
  assert reasons <= {"stop", "length", "cancelled"} and "cancelled" in reasons
  assert engine.counters["moves"] > 0  # live rows moved to the front (width 2)


def test_sampled_requests_are_reproducible(pair):
  """Same seed, same submissions, same steps: same tokens (every random number
  comes from the engine's key)."""
  target, draft = pair
  batch = requests(6, seed=3, sampled=True)
  outs = []
  for _ in range(2):
    engine = Engine(target, draft, CONFIG, eos_ids=7)
    engine.policy = Schedule((3,))
    outs.append([c.tokens for c in engine.run(batch)])
  assert outs[0] == outs[1]


def test_a_bad_request_fails_alone(pair, engine, monkeypatch):
  target, _ = pair
  engine.policy = Schedule((3,))
  with pytest.raises(ValueError, match=r"prompt must hold token ids in \[0, vocab_size=256\)"):
    engine.submit(Request(prompt=[1, V + 5], max_new_tokens=4))
  # A failure inside the engine (here: the prefill of one request) fails that request only.
  good = requests(3, seed=11)
  admit = programs.admit

  def failing_admit(*args, **kwargs):
    if int(args[7][0]) == 250:  # the failing request's stop id
      raise RuntimeError("device error")
    return admit(*args, **kwargs)

  monkeypatch.setattr(programs, "admit", failing_admit)
  bad = engine.submit(Request(prompt=[1, 2, 3], max_new_tokens=5, stop_id=250))
  ids = [engine.submit(r) for r in good]
  while engine.has_work():
    engine.step()
  assert engine.completion(bad).finish_reason == "error"
  assert "device error" in engine.completion(bad).error
  for i, alone in zip(ids, solo(target, good)):
    assert engine.completion(i).tokens == alone


@pytest.mark.parametrize(
  "request_, message",
  [
    (Request(prompt=[], max_new_tokens=4), "prompt must be a non-empty list"),
    (Request(prompt=[1] * 33, max_new_tokens=4), "prompt has 33 tokens.*max_prompt_len=32"),
    (Request(prompt=[1], max_new_tokens=0), r"max_new_tokens must be an integer in \[1, 16\]"),
    (Request(prompt=[1], max_new_tokens=17), r"max_new_tokens must be an integer in \[1, 16\]"),
    (
      Request(prompt=[1], max_new_tokens=2, stop_id=V),
      r"stop_id must be None or an integer in \[0, vocab_size=256\)",
    ),
    (
      Request(prompt=[1], max_new_tokens=2, sampling=specjax.SamplingParams(top_k=V + 1)),
      r"sampling.top_k must be in \[0, vocab_size=256\]",
    ),
  ],
)
def test_requests_are_checked_before_queueing(engine, request_, message):
  with pytest.raises(ValueError, match=message):
    engine.submit(request_)
  assert not engine.has_work()


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(slots=0), "slots must be"),
    (dict(policy="sometimes"), "policy must be one of"),
    (dict(gammas=(0, 5)), r"gammas must be integers in \[0, gamma=3\]"),
    (dict(widths=(8,)), r"widths must be integers in \[1, slots=4\]"),
    (dict(gamma=0), "gamma must be"),
    (dict(prompt_buckets=()), "prompt_buckets must be non-empty"),
  ],
)
def test_engine_config_names_the_bad_field(fields, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, **fields)


def test_engine_refuses_what_it_cannot_serve(pair):
  target, draft = pair
  with pytest.raises(ValueError, match="draft is None: policy must be 'never'"):
    Engine(target, None, CONFIG)
  with pytest.raises(ValueError, match="exceeds max_seq_len=256"):
    Engine(target, draft, dataclasses.replace(CONFIG, max_new_tokens=230))


@pytest.mark.parametrize(
  "fields, buckets, budget",
  [
    (dict(prompt_buckets=None, max_new_tokens=None), (32, 64, 128), 124),  # 128 + 124 + 4 = 256
    (dict(prompt_buckets=None), (32, 64, 128), 16),  # given budget kept
    (dict(max_new_tokens=None), (32,), 220),  # given buckets kept: 32 + 220 + 4 = 256
    (dict(prompt_buckets=None, max_new_tokens=None, gamma=200, gammas=None), (8, 16, 32), 23),
    (dict(), (32,), 16),  # SERVING_ENGINE: as given
  ],
)
def test_engine_fits_unset_buckets_and_budget_to_the_context(pair, fields, buckets, budget):
  """Nothing compiles here: `fit_config` is what the Engine does first."""
  target, draft = pair  # both max_seq_len=256
  config = dataclasses.replace(CONFIG, **fields)
  fitted = fit_config(config, target, draft)
  assert (fitted.prompt_buckets, fitted.max_new_tokens) == (buckets, budget)
  assert fitted.max_prompt_len + fitted.max_new_tokens + fitted.gamma + 1 <= 256
  assert fitted.slots == config.slots and fitted.gamma == config.gamma
  assert fit_config(fitted, target, draft) == fitted  # complete configs pass unchanged
  # A long-context model: both capped at 256 (caches of 517 positions per slot).
  long = specjax.Transformer(target.cfg.replace(max_seq_len=4096), rngs=nnx.Rngs(0))
  wide = fit_config(dataclasses.replace(CONFIG, prompt_buckets=None, max_new_tokens=None), long)
  assert (wide.prompt_buckets, wide.max_new_tokens) == ((64, 128, 256), 256)
  # A draft model with the shorter context decides.
  short = specjax.Transformer(draft.cfg.replace(max_seq_len=64), rngs=nnx.Rngs(0))
  fitted = fit_config(
    dataclasses.replace(CONFIG, prompt_buckets=None, max_new_tokens=None), target, short
  )
  assert (fitted.prompt_buckets, fitted.max_new_tokens) == ((8, 16, 32), 28)


@pytest.mark.parametrize(
  "fields, message",
  [
    (
      dict(prompt_buckets=(128,), max_new_tokens=200),
      r"target: the largest of prompt_buckets \(128\) \+ max_new_tokens \(200\) \+ gamma \+ 1 "
      r"\(4\) = 332 exceeds max_seq_len=256; lower prompt_buckets, max_new_tokens or gamma "
      r"\(max_new_tokens=124 fits these buckets; a largest bucket <= 52 fits this "
      r"max_new_tokens\), or leave prompt_buckets and max_new_tokens unset",
    ),
    (
      dict(prompt_buckets=None, max_new_tokens=252),
      r"max_new_tokens \(252\) \+ gamma \+ 1 \(4\) leaves no room for a prompt in "
      r"max_seq_len=256; lower max_new_tokens \(at most 251\) or gamma",
    ),
    (
      dict(prompt_buckets=(256,), max_new_tokens=None),
      r"lower prompt_buckets \(at most 251\) or gamma",
    ),
    (dict(gamma=254, gammas=None), r"lower gamma \(at most 253\)"),
  ],
)
def test_engine_refuses_a_config_that_cannot_fit_before_compiling(
  pair, monkeypatch, fields, message
):
  target, draft = pair
  monkeypatch.setattr(programs, "blank", lambda *a, **k: pytest.fail("compiled"))
  with pytest.raises(ValueError, match=message):
    Engine(target, draft, dataclasses.replace(CONFIG, **fields))
  names = {"max_new_tokens": "--config.max_new_tokens", "gamma": "--config.gamma"}
  with pytest.raises(ValueError, match="--config.gamma"):  # a launcher's names for the fields
    fit_config(dataclasses.replace(CONFIG, **fields), target, draft, names=names)


def test_warmup_reports_progress_per_program_group(pair):
  """One line for the prefills, then one per batch width, with seconds."""
  target, draft = pair
  engine = Engine(target, draft, CONFIG, eos_ids=7)
  lines = []
  engine.warmup(timed_runs=1, progress=lines.append)
  assert len(lines) == 2 + len(CONFIG.step_widths)
  assert "prompt widths (32,)" in lines[0] and "batch widths (2, 4)" in lines[0]
  assert lines[1].startswith("warm-up: prefills compiled (") and lines[1].endswith(" s)")
  for line, width in zip(lines[2:], CONFIG.step_widths):
    assert line.startswith(f"warm-up: batch width {width} (") and "compiled in" in line
    assert "gamma=0" in line and "gamma=3" in line and line.endswith("s so far")


def test_warmup_times_runs_of_live_rows_and_leaves_no_trace(pair, monkeypatch):
  target, draft = pair
  engine = Engine(target, draft, CONFIG, eos_ids=7)
  step, calls = programs.step, []

  def recording(target, drafter, state, key, *args, gamma, width, config, verify):
    calls.append((gamma, width, bool(not np.asarray(state.spec.done).any())))
    return step(
      target, drafter, state, key, *args, gamma=gamma, width=width, config=config, verify=verify
    )

  monkeypatch.setattr(programs, "step", recording)
  engine.warmup(timed_runs=1)
  run = engine.policy.window
  # At each width: one compiling step per draft length, then runs of `window`
  # steps (plain, drafting, plain), each run from rows all live.
  per_width = [(0, True), (3, True)] + [(g, None) for g in (0, 3, 0) for _ in range(run)]
  assert len(calls) == len(per_width) * len(CONFIG.step_widths)
  for i, (gamma, width, live) in enumerate(calls):
    expected_gamma, _ = per_width[i % len(per_width)]
    assert gamma == expected_gamma and width == CONFIG.step_widths[i // len(per_width)]
    if i % len(per_width) < 2 or (i % len(per_width) - 2) % run == 0:
      assert live  # a run's first step: every row live, with its whole budget
  for width in CONFIG.step_widths:  # one cost ratio per pair of adjacent runs
    assert len(engine.policy._ratios[3, width]) == 2
  monkeypatch.undo()
  batch = requests(6, seed=11)  # the warm-up's rows are gone: requests decode as alone
  ids = [engine.submit(r) for r in batch]
  engine.step()
  engine.warmup(timed_runs=0)  # again, with requests live: their rows are kept
  while engine.has_work():
    engine.step()
  assert [engine.completion(i).tokens for i in ids] == solo(target, batch)


def test_policy_takes_cost_ratios_from_adjacent_runs():
  policy = SpeculationPolicy("adaptive", (0, 4), window=4)
  for gamma, seconds in [(0, 1.0), (4, 3.0), (0, 1.2), (4, 3.0)]:  # runs of 4 steps
    for _ in range(4):
      policy.observe(gamma, 16, seconds, 0, 0)
  assert policy.cost(4, 16) == pytest.approx(2.75)  # 3 / 1, then 3 / 1.2: the median
  policy.end_runs(16)  # the last run closes: a third ratio, 3 / 1.2
  assert policy.cost(4, 16) == pytest.approx(2.5)
  policy.observe(0, 16, 1.0, 0, 0)  # a new run, with no neighbour yet
  policy.observe(4, 16, 4.0, 0, 0)
  assert policy.cost(4, 16) == pytest.approx(2.5)
  policy.observe(0, 16, 1.0, 0, 0)  # ... now it has one: 4 / 1
  assert policy.cost(4, 16) == pytest.approx(2.75)


def test_policy_follows_measured_costs_and_acceptance():
  policy = SpeculationPolicy("adaptive", (0, 4), explore_steps=0)
  policy.step_time = {(0, 1): 1.0, (4, 1): 1.5, (0, 16): 1.0, (4, 16): 4.0}
  e = expected_tokens_per_iteration  # Leviathan's E(alpha, gamma): the policy's prior
  assert e(0.0, 4) == 1 and e(1.0, 4) == 5
  assert e(0.5, 0) == 1 and e(0.5, 2) == pytest.approx(1.75)
  policy.observe(4, 1, 1.5, accepted=11, evaluated=13)  # alpha (11 + 1) / (13 + 2) = 0.8
  assert policy.alpha == pytest.approx(0.8)
  assert policy.choose(1) == 4  # light load: E = 3.36 tokens for 1.5x the time
  assert policy.choose(16) == 0  # full batch: drafting costs 4x a plain step
  policy.observe(0, 16, 1.0, 0, 0)
  assert policy.choose(1) == 4  # back to drafting at a small width
  # Tokens per step follow the measured acceptance (decayed counts): 2.09
  # tokens for 1.5x the time pays at width 1; 1.39 does not.
  policy.observe(4, 1, 1.5, accepted=2, evaluated=10, rows=10)
  assert policy.alpha == pytest.approx(0.5443, abs=1e-4)
  assert (
    policy.tokens_per_step(4)
    == pytest.approx(e(policy.alpha, 4))
    == pytest.approx(2.0896, abs=1e-4)
  )
  assert policy.choose(1) == 4
  policy.observe(4, 1, 1.5, accepted=0, evaluated=20, rows=10)
  assert policy.tokens_per_step(4) == pytest.approx(1.3902, abs=1e-4) and policy.choose(1) == 0
  policy.observe(4, 1, 1.5, accepted=0, evaluated=10)
  assert policy.alpha < 0.7
  assert SpeculationPolicy("never", (0,)).choose(1) == 0
  assert SpeculationPolicy("always", (0, 2, 4)).choose(16) == 4


def test_policy_compares_step_times_taken_under_the_same_load():
  # Warm-up times say drafting pays 5.5% (alpha 0.55: 2.11 tokens for 2x a
  # plain step). Under load every step takes 20% longer: the drafting steps in
  # use and the plain steps it probes alike, so it keeps drafting.
  policy = SpeculationPolicy("adaptive", (0, 4), probe_every=8, probe_steps=4, explore_steps=0)
  policy.step_time = {(0, 16): 1.0, (4, 16): 2.0}
  policy.observe(4, 16, 2.4, accepted=10, evaluated=18, rows=10)  # alpha (10 + 1) / (18 + 2)
  assert policy.tokens_per_step(4) == pytest.approx(2.1104, abs=1e-4)

  def serve(steps, plain_s, draft_s):
    chosen = []
    for _ in range(steps):
      gamma = policy.choose(16)
      chosen.append(gamma)
      seconds = draft_s if gamma else plain_s
      policy.observe(gamma, 16, seconds, 0, 0, rows=10)
    return chosen

  chosen = serve(40, plain_s=1.2, draft_s=2.4)
  assert chosen == ([4] * 8 + [0] * 4) * 3 + [4] * 4  # plain probes every 8 steps
  assert policy.cost(4, 16) == 2.0  # from the runs next to each other
  # Plain steps now run at warm-up's speed and drafting steps do not: once the
  # ratios of three probes say so it switches, and drafts only to probe.
  chosen = serve(64, plain_s=1.0, draft_s=2.4)
  assert chosen[:28] == [4] * 4 + [0] * 4 + [4] * 8 + [0] * 4 + [4] * 8
  assert chosen[28:] == [0] * 12 + ([4] * 4 + [0] * 8) * 2
  assert policy.cost(4, 16) == 2.4


def test_policy_probes_acceptance_after_plain_runs():
  policy = SpeculationPolicy("adaptive", (0, 4), probe_every=5, probe_steps=2, explore_steps=2)
  policy.step_time = {(0, 4): 1.0, (4, 4): 2.0}
  for _ in range(2):  # it drafts until 2 steps are measured, whatever they show
    assert policy.choose(4) == 4
    policy.observe(4, 4, 2.0, accepted=0, evaluated=4, rows=4)  # alpha 0
  chosen = []
  for _ in range(45):
    gamma = policy.choose(4)
    chosen.append(gamma)
    policy.observe(gamma, 4, policy.step_time[gamma, 4], 0, 4 if gamma else 0)
  # Plain decoding, with a probe of drafting (2 steps) after every 5 plain steps.
  probe = [4, 4]
  assert chosen == ([0] * 5 + probe) * 6 + [0] * 3


def test_a_failing_step_fails_its_requests_and_serving_goes_on(pair, engine, monkeypatch):
  target, _ = pair
  engine.policy = Schedule((3,))
  step = programs.step
  calls = []

  def failing_once(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("lost device")
    return step(*args, **kwargs)

  monkeypatch.setattr(programs, "step", failing_once)
  first = [engine.submit(Request(prompt=[3, 4], max_new_tokens=CONFIG.max_new_tokens))]
  while engine.has_work():
    engine.step()
  assert engine.completion(first[0]).finish_reason == "error"
  assert "lost device" in engine.completion(first[0]).error
  later = requests(4, seed=21)
  for completion, alone in zip(engine.run(later), solo(target, later)):
    assert completion.tokens == alone


def seeded_requests(seed):
  """Four seeded sampled requests (two choices of one seed among them)."""
  rng = np.random.default_rng(seed)
  sampling = specjax.SamplingParams(temperature=0.9, top_p=0.95)
  prompts = [rng.integers(0, V, int(rng.integers(2, 12))).tolist() for _ in range(3)]
  return [
    Request(prompts[0], 16, sampling, seed=1234),
    Request(prompts[0], 16, sampling, seed=1234, choice=1),
    Request(prompts[1], 12, specjax.SamplingParams(temperature=0.7), seed=-5),
    Request(prompts[2], 16, sampling, seed=2**64 - 1, stop_id=3),
  ]


def coupled_solo(target, batch, eos=7):
  """Each seeded request decoded alone by `autoregressive_generate` with its
  request key (the coupled sampler), cut at its EOS or stop id."""
  expected = []
  for r in batch:
    out = specjax.autoregressive_generate(
      target,
      jnp.asarray([r.prompt + [0] * (CONFIG.max_prompt_len - len(r.prompt))]),
      jnp.asarray([len(r.prompt)]),
      max_new_tokens=CONFIG.max_new_tokens,
      sampling=specjax.RowSampling.of([r.sampling]),
      key=request_key(r.seed, r.choice)[None],
    )
    row = np.asarray(out.tokens)[0, : r.max_new_tokens].tolist()
    ends = [i for i, t in enumerate(row) if t in (eos, r.stop_id)]
    expected.append(row[: ends[0] + 1] if ends else row)
  return expected


@pytest.mark.parametrize(
  "gammas", [(0,), (3,), (3, 0, 0, 3, 3)], ids=["plain", "speculative", "mixed"]
)
def test_seeded_requests_have_one_text_whatever_the_steps_and_the_batch(pair, engine, gammas):
  """A seeded request's tokens are plain coupled decoding with its own key:
  with speculation off, on, or switching, beside other sampled and greedy
  requests that come and go (Gumbel-max coupling: the drafter and the draft
  length change how many tokens a step commits, never which)."""
  target, _ = pair
  engine.policy = Schedule(gammas)
  seeded = seeded_requests(1)
  others = requests(6, seed=len(gammas), sampled=True)
  ids = [engine.submit(r) for r in [others[0], seeded[0], others[1], *seeded[1:], *others[2:]]]
  while engine.has_work():
    engine.step()
  got = [engine.pop_completion(i).tokens for i in ids]
  expected = coupled_solo(target, seeded)
  assert [got[1], *got[3:6]] == expected
  assert expected[0] != expected[1]  # choice 1 has a key of its own
  if gammas != (0,):
    assert engine.counters["steps_gamma_3"] > 0


def test_per_request_draft_caps_are_honoured_row_by_row(pair, engine):
  """`max_draft_tokens`: 0 decodes a request without drafted tokens, 1 drafts at
  most one token a step for it, in the same batch as an uncapped request that
  drafts 3; texts are unchanged (greedy: the target's own). A batch whose every
  request says 0 runs plain steps."""
  target, _ = pair
  engine.policy = Schedule((3,))
  base = requests(3, seed=41)
  batch = [dataclasses.replace(r, max_draft_tokens=cap) for r, cap in zip(base, (None, 0, 1))]
  completions = engine.run(batch)
  assert [c.tokens for c in completions] == solo(target, batch)
  free, off, one = completions
  assert free.proposed > free.iterations  # 3 a step
  assert off.proposed == 0 and off.iterations > 0
  assert 0 < one.proposed <= one.iterations
  plain = engine.counters["steps_gamma_0"]
  engine.run([dataclasses.replace(r, max_draft_tokens=0) for r in base])
  assert engine.counters["steps_gamma_0"] > plain
  with pytest.raises(ValueError, match=r"max_draft_tokens must be an integer in \[0, 2147483647\]"):
    engine.submit(dataclasses.replace(base[0], max_draft_tokens=-1))


def test_per_request_speculation_counts_add_up_to_the_engines(pair, engine):
  """Each completion's drafted / accepted tokens by position (its row's counters,
  read when it finished, a cancelled one's too) sum to the engine's counters, and
  each request's positions to its own totals; a cap of 1 drafts at position 1 only."""
  engine.policy = Schedule((3, 3, 0, 3))
  keys = (
    "drafted",
    "accepted",
    *(f"{k}_at_{i}" for k in ("drafted", "accepted") for i in (1, 2, 3)),
  )
  before = {k: engine.counters[k] for k in keys}
  base = requests(8, seed=17, sampled=True)
  capped = dataclasses.replace(base[2], max_draft_tokens=1, max_new_tokens=CONFIG.max_new_tokens)
  batch = [capped if i == 2 else r for i, r in enumerate(base)]
  ids = [engine.submit(r) for r in batch]
  engine.step()
  engine.step()
  engine.cancel(ids[0])  # mid-stream (or finished already: a no-op)
  while engine.has_work():
    engine.step()
  counts = [engine.completion(i).speculation for i in ids]
  total = sum(counts[1:], counts[0])
  assert total.drafted == engine.counters["drafted"] - before["drafted"] > 0
  assert total.accepted == engine.counters["accepted"] - before["accepted"] > 0
  for i in (1, 2, 3):
    for kind in ("drafted", "accepted"):
      key = f"{kind}_at_{i}"
      assert getattr(total, f"{kind}_at_position")[i - 1] == engine.counters[key] - before[key]
  for c in counts:
    assert len(c.drafted_at_position) == len(c.accepted_at_position) == CONFIG.gamma
    assert sum(c.drafted_at_position) == c.drafted and sum(c.accepted_at_position) == c.accepted
    assert all(a <= d for a, d in zip(c.accepted_at_position, c.drafted_at_position))
    assert list(c.accepted_at_position) == sorted(c.accepted_at_position, reverse=True)
    assert c.forced == 0
  capped = counts[2]
  assert capped.drafted_at_position[0] > 0 and capped.drafted_at_position[1:] == (0, 0)
  policy = SpeculationPolicy("adaptive", CONFIG.draft_lengths)
  metrics = engine_metrics(
    engine.counters, [], live=0, queued=0, draft_lengths=(0, 3), policy=policy, positions=3
  )["speculation"]
  assert metrics["drafted"] == engine.counters["drafted"]
  assert metrics["accepted_at_position"] == [engine.counters[f"accepted_at_{i}"] for i in (1, 2, 3)]


def test_verify_lengths_keep_greedy_text_and_are_measured_at_warmup(pair):
  """An engine choosing its verify length in-graph (costs measured at warm-up, one
  width) decodes greedy requests as each alone."""
  target, draft = pair
  config = dataclasses.replace(CONFIG, gammas=(3,), widths=(4,), verify_lengths=(1, 3))
  engine = Engine(target, draft, config, eos_ids=7)
  lines = []
  engine.warmup(timed_runs=1, progress=lines.append)
  ((lengths, costs),) = engine.verify_costs.values()
  assert lengths == (1, 3) and max(costs) == 1.0 and min(costs) > 0
  assert any("verify costs k=1" in line for line in lines)
  batch = requests(6, seed=5)
  assert [c.tokens for c in engine.run(batch)] == solo(target, batch)
  with pytest.raises(ValueError, match="verify_lengths must be distinct ints in \\[1, gamma=3\\]"):
    dataclasses.replace(CONFIG, verify_lengths=(1, 2))
  with pytest.raises(ValueError, match="NGramDrafter"):
    Engine(target, specjax.drafting.NGramDrafter(vocab_size=V), config)


def test_mesh_settings_are_checked_before_anything_compiles(pair):
  """`EngineConfig.mesh`: a (data, model) pair; slots and widths split over data;
  a mesh the devices cannot hold is refused by the engine, naming it."""
  from specjax.serving.mesh import row_order

  for bad in ((8,), (0, 2), (-1, -1), "2x4", (2.5, 1)):
    with pytest.raises(ValueError, match=r"mesh must be None \(one device\) or \(data, model\)"):
      EngineConfig(mesh=bad)
  with pytest.raises(ValueError, match=r"slots \(6\) must be a multiple of the mesh's data axis"):
    EngineConfig(slots=6, mesh=(4, 1))
  with pytest.raises(ValueError, match=r"widths must be multiples of the mesh's data axis \(2\)"):
    EngineConfig(slots=8, widths=(3, 8), mesh=(2, 1))
  with pytest.raises(ValueError, match="draft_placement must be one of replicate, shard"):
    EngineConfig(mesh=(1, 1), draft_placement="copy")
  with pytest.raises(ValueError, match="vocab_placement must be one of replicate, shard"):
    EngineConfig(mesh=(1, 1), vocab_placement="split")
  assert EngineConfig(slots=8, mesh=[2, -1]).mesh == (2, -1)
  assert EngineConfig(slots=8, mesh=(2, 1)).step_widths == (2, 4, 8)
  with pytest.raises(ValueError, match=r"mesh \(2, 4\) does not fit this job's 1 cpu device"):
    Engine(*pair, dataclasses.replace(CONFIG, mesh=(2, 4)))
  # Slots fill block by block: a step at width W runs on each block's first W / D rows.
  assert row_order(8, 2) == (0, 4, 1, 5, 2, 6, 3, 7) and row_order(4, 1) == (0, 1, 2, 3)


def test_lockstep_leader_serves_what_the_engine_serves(pair, engine):
  """`Lockstep` as process 0 of a one-process job: submissions queue at once,
  cancellations and expiries (decided by the leader's clock) apply at the next
  step, which the followers would take too; the text is the engine's own."""
  from specjax.serving.lockstep import Lockstep, broadcast

  assert broadcast({"gamma": 3, "ids": [1, 2]}) == {"gamma": 3, "ids": [1, 2]}
  target, _ = pair
  engine.policy = Schedule((3, 0, 3))
  lockstep = Lockstep(engine)
  try:
    batch = requests(6, seed=21)
    ids = [lockstep.submit(r) for r in batch]
    victim = lockstep.submit(Request(prompt=[4] * 8, max_new_tokens=CONFIG.max_new_tokens))
    late = lockstep.submit(Request(prompt=[4] * 8, max_new_tokens=8, timeout_s=1e-9))
    lockstep.cancel(victim)
    assert engine.has_work() and lockstep.has_work()
    while lockstep.has_work():
      lockstep.step()
  finally:
    engine.agree = None
    lockstep.close()
  assert engine.completion(victim).finish_reason == "cancelled"
  assert engine.completion(late).finish_reason == "timeout"
  for i, alone in zip(ids, solo(target, batch)):
    assert engine.completion(i).tokens == alone
  with pytest.raises(RuntimeError, match="closed"):
    lockstep.submit(batch[0])


def test_serve_checks_the_mesh_before_any_model_loads():
  from configs import serve as serve_config
  from specjax.jobs import serve

  config = serve_config.get_config()
  config.update(model="tiny", mesh=(2, 4))
  with pytest.raises(ValueError, match=r"^config.mesh \(2, 4\) does not fit this job's 1 cpu"):
    serve.check_config(config)
  config.update(mesh=(2, 1), slots=3)
  with pytest.raises(
    ValueError, match=r"^config.slots \(3\) must be a multiple of the mesh's data"
  ):
    serve.check_config(config)
  config.update(mesh=(1, 1), slots=2, draft_placement="everywhere")
  with pytest.raises(ValueError, match="^config.draft_placement must be one of replicate, shard"):
    serve.check_config(config)

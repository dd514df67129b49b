"""Load generation: Poisson arrivals, held-out requests, the in-process driver,
and the load-test launcher end to end on random tiny models."""

import json
import os

import numpy as np
import pytest

from configs import load_test as load_test_config
from helpers import SERVING_ENGINE
from specjax.bench.serving.load import (
  held_out_requests,
  held_out_texts,
  poisson_arrivals,
  run_in_process,
)
from specjax.bench.serving.load_report import aggregate, compare_modes
from specjax.jobs import load_test
from specjax.serving import Engine, EngineConfig, summarize
from specjax.testing import ByteTokenizer, tiny_setup

# As tests/test_serving_http.py: the programs come from the compilation cache.
ENGINE = SERVING_ENGINE


@pytest.fixture(scope="module")
def engine():
  target, draft, _ = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(policy="adaptive", **ENGINE))
  engine.warmup(timed_runs=0)
  return engine


def test_poisson_arrivals():
  arrivals = poisson_arrivals(5.0, 20_000, seed=3)
  assert arrivals.shape == (20_000,) and arrivals[0] == 0
  gaps = np.diff(arrivals)
  assert np.all(gaps >= 0)
  # Exponential gaps: mean 1 / rate, standard deviation equal to the mean.
  assert abs(gaps.mean() - 0.2) < 0.2 * 0.03 and abs(gaps.std() - 0.2) < 0.2 * 0.05
  np.testing.assert_array_equal(arrivals, poisson_arrivals(5.0, 20_000, seed=3))
  assert not np.array_equal(arrivals, poisson_arrivals(5.0, 20_000, seed=4))
  for rate in (0, -1.0, float("inf"), float("nan"), "5"):
    with pytest.raises(ValueError, match="rate_per_s must be a finite number"):
      poisson_arrivals(rate, 10)
  with pytest.raises(ValueError, match="n must be an integer >= 1"):
    poisson_arrivals(1.0, 0)


def test_the_soaks_normal_arrivals_are_the_same_calm_or_hostile():
  from specjax.bench.serving.soak import _arrivals

  calm, rough = _arrivals(60.0, 2.0, 0.0, seed=3), _arrivals(60.0, 2.0, 3.0, seed=3)
  assert {stream for _, stream, _ in calm} == {0}
  assert [a for a in rough if a[1] == 0] == calm  # the hostile stream is on top
  assert sum(stream for _, stream, _ in rough) > 0.5 * 3.0 * 60.0
  assert [t for t, *_ in rough] == sorted(t for t, *_ in rough)
  assert all(0 < t < 60.0 for t, *_ in rough)
  assert [k for _, stream, k in rough if stream == 1] == list(range(len(rough) - len(calm)))


def test_held_out_requests_cycle_and_keep_the_prompt_end():
  texts = held_out_texts(1000)
  assert 1 < len(texts) < 1000 and texts == held_out_texts(len(texts))
  requests = held_out_requests(100, ByteTokenizer(), max_new_tokens=8, max_prompt_len=32)
  assert len(requests) == 100
  for i, r in enumerate(requests):  # reused in order past the split's prompts
    # A prompt cut to the limit keeps its end: a continuation starts there.
    assert r.prompt == list(texts[i % len(texts)].encode())[-32:]
    assert r.max_new_tokens == 8


def test_run_in_process_times_every_request(engine):
  requests = held_out_requests(6, ByteTokenizer(), max_new_tokens=12, max_prompt_len=32)
  arrivals = poisson_arrivals(50.0, 6, seed=0)
  completions = run_in_process(engine, requests, arrivals)
  assert [c.finish_reason for c in completions] == ["length"] * 6
  start = completions[0].arrival_time
  np.testing.assert_allclose([c.arrival_time - start for c in completions], arrivals)
  for c in completions:
    assert len(c.tokens) == 12 and c.prompt_length == 32
    assert 0 < c.ttft <= c.e2e and c.tpot > 0
  assert not engine.has_work() and engine.live_requests() == 0
  # Objectives the slowest request just meets: every request counts towards
  # goodput, on a machine of any speed.
  ttfts, tpots = [c.ttft for c in completions], [c.tpot for c in completions]
  summary = summarize(completions, slo_ttft_s=max(ttfts), slo_tpot_s=max(tpots))
  assert summary["completed"] == 6 and summary["output_tokens"] == 72
  assert summary["throughput_tok_s"] > 0 and summary["goodput_req_s"] == summary["request_rate"]
  for key in ("ttft_s", "tpot_s", "e2e_s"):
    assert summary[key]["p50"] <= summary[key]["p99"]
  # A TTFT objective at the median: goodput counts exactly the requests within it.
  slo = float(np.median(ttfts))
  within = sum(t <= slo for t in ttfts)
  strict = summarize(completions, slo_ttft_s=slo, slo_tpot_s=max(tpots))
  assert 3 <= within < 6
  assert strict["goodput_req_s"] == pytest.approx(within / strict["duration_s"])
  assert strict["goodput_tok_s"] == pytest.approx(12 * within / strict["duration_s"])
  with pytest.raises(ValueError, match=r"arrivals must hold one offset per request"):
    run_in_process(engine, requests, arrivals[:3])


def _config(**changes):
  config = load_test_config.get_config()
  config.update({**ENGINE, "model": "tiny", "num_requests": 6, "slo_ttft_s": 5.0, **changes})
  return config


def test_launcher_two_rates_two_modes(tmp_path):
  import matplotlib.image

  lines = []
  config = _config(rates=(20.0, 40.0), modes=("plain", "adaptive"))
  load_test.run(config, str(tmp_path), progress=lines.append)
  with open(tmp_path / load_test.JSON_FILE) as f:
    report = json.load(f, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
  runs = report["runs"]
  assert [(r["mode"], r["rate"], r["round"]) for r in runs] == [
    ("plain", 20.0, 0),
    ("adaptive", 20.0, 0),
    ("plain", 40.0, 0),
    ("adaptive", 40.0, 0),
  ]
  for r in runs:
    s = r["summary"]
    assert s["requests"] == s["completed"] == 6 and s["output_tokens"] == 96
    assert s["throughput_tok_s"] > 0 and 0 <= s["goodput_req_s"] <= s["request_rate"]
    assert set(s["ttft_s"]) == {"mean", "p50", "p90", "p99"} and s["ttft_s"]["p99"] > 0
    assert [q["index"] for q in r["requests"]] == list(range(6))
    for q in r["requests"]:
      assert q["ttft_s"] > 0 and q["tpot_s"] > 0 and q["e2e_s"] >= q["ttft_s"]
  # Plain decoding never drafts; the adaptive engine reports its acceptance
  # (None when the policy chose plain steps throughout).
  assert all(r["summary"]["acceptance_rate"] is None for r in runs if r["mode"] == "plain")
  assert report["adaptive_vs_best"] == []  # "always" did not run
  assert set(report["warmup_s"]) == {"plain", "adaptive"}
  assert report["config"]["rates"] == [20.0, 40.0]
  assert any("warmed up" in line for line in lines)
  assert any(line.startswith("adaptive: warm-up: batch width 4 (2/2)") for line in lines)
  assert any(line.startswith("adaptive at 40 req/s:") and "tok/s" in line for line in lines)
  image = matplotlib.image.imread(tmp_path / load_test.FIGURE_FILE)
  assert image.shape[0] > 100 and image.shape[1] > 100
  assert image[..., :3].std() > 0.05  # lines and labels, not a blank canvas
  table = (tmp_path / load_test.TABLE_FILE).read_text()
  assert table.count("\n| 20 | ") == 2 and "| 40 | adaptive |" in table
  # The table and figure again from the saved report, measuring nothing.
  again = tmp_path / "again"
  again.mkdir()
  load_test.render(report, str(again), progress=lines.append)
  assert (again / load_test.TABLE_FILE).read_text() == table
  assert (again / load_test.FIGURE_FILE).exists()


def test_rounds_rotate_the_modes_and_compare_them(tmp_path):
  config = _config(rates=(40.0,), modes=("plain", "always", "adaptive"), repeats=2)
  report = load_test.run(config, str(tmp_path), progress=print)
  runs = report["runs"]
  assert [(r["mode"], r["round"]) for r in runs] == [
    ("plain", 0),
    ("always", 0),
    ("adaptive", 0),
    ("always", 1),
    ("adaptive", 1),
    ("plain", 1),
  ]
  policy = runs[2]["policy"]  # the adaptive engine's, after its first run
  assert policy["kind"] == "adaptive" and policy["gamma"] in (0, 3)
  assert all(ms > 0 for ms in policy["step_ms"].values())
  assert any(key.startswith("gamma=3,") for key in policy["step_ms"])  # it explores first
  (comparison,) = report["adaptive_vs_best"]
  throughput = {(r["mode"], r["round"]): r["summary"]["throughput_tok_s"] for r in runs}
  best = comparison["best"]
  mean = {m: (throughput[m, 0] + throughput[m, 1]) / 2 for m in ("plain", "always")}
  assert mean[best] == max(mean.values())  # the better mode over both rounds
  for round_, ratio in enumerate(comparison["ratios"]):
    assert ratio == pytest.approx(throughput["adaptive", round_] / throughput[best, round_])
  table = (tmp_path / load_test.TABLE_FILE).read_text()
  assert "| 40 | adaptive | " in table and f"| 40 | {best} | " in table
  assert not os.path.exists(tmp_path / load_test.FIGURE_FILE)  # one rate: no figure


def _row(mode, rate, round_, throughput, ttfts, alpha=None):
  requests = [
    {"finish_reason": "stop", "ttft_s": t, "tpot_s": t / 10, "e2e_s": 2 * t} for t in ttfts
  ]
  summary = {"throughput_tok_s": throughput, "acceptance_rate": alpha}
  return {"mode": mode, "rate": rate, "round": round_, "summary": summary, "requests": requests}


def test_rounds_pool_and_pair():
  rows = [
    _row("plain", 8.0, 0, 100.0, [1.0, 2.0]),
    _row("always", 8.0, 0, 120.0, [3.0], alpha=0.6),
    _row("adaptive", 8.0, 0, 114.0, [1.0], alpha=0.8),
    _row("plain", 8.0, 1, 90.0, [4.0]),
    _row("always", 8.0, 1, 80.0, [1.0], alpha=0.8),
    _row("adaptive", 8.0, 1, 99.0, [2.0], alpha=0.6),
    _row("plain", 16.0, 0, None, []),  # nothing completed: no ratio for this round
    _row("always", 16.0, 0, 50.0, [1.0]),
    _row("adaptive", 16.0, 0, 50.0, [1.0]),
  ]
  (at_8,) = compare_modes(rows)  # at 16 req/s no round has all three
  # Always is the better mode (mean 100 to plain's 95), though plain won round 1.
  assert at_8["best"] == "always" and at_8["ratios"] == pytest.approx([0.95, 1.2375])
  assert at_8["min"] == pytest.approx(0.95) and at_8["median"] == pytest.approx(1.09375)
  assert at_8["mean"] == pytest.approx(1.09375) and at_8["stderr"] == pytest.approx(0.14375)
  assert at_8["low"] == pytest.approx(1.09375 - 2 * 0.14375)
  plain = next(g for g in aggregate(rows) if g["mode"] == "plain" and g["rate"] == 8.0)
  assert plain["rounds"] == 2 and plain["throughput_tok_s"] == [100.0, 90.0]
  assert plain["ttft_s"]["p50"] == 2.0 and plain["acceptance_rate"] is None  # pooled: 1, 2, 4
  assert next(g for g in aggregate(rows) if g["mode"] == "always")["acceptance_rate"] == 0.7
  assert compare_modes(rows, others=("plain", "never")) == []
  # A report saved before rounds existed (no "round") reads as one round.
  old = [{k: v for k, v in r.items() if k != "round"} for r in rows if r["round"] == 0]
  assert compare_modes(old)[0]["ratios"] == pytest.approx([0.95])


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(rates=()), "config.rates must hold at least one rate"),
    (dict(rates=(1.0, 0.0)), "config.rates must be a finite number"),
    (dict(modes=("plain", "fast")), "config.modes must be distinct names among"),
    (dict(modes=("plain", "plain")), "config.modes must be distinct"),
    (dict(num_requests=0), "config.num_requests must be an integer >= 1"),
    (dict(repeats=0), "config.repeats must be an integer >= 1"),
    (dict(max_new_tokens=0), "config.max_new_tokens must be an integer >= 1"),
    (dict(slo_ttft_s=-1.0), "config.slo_ttft_s must be a number >= 0"),
    (dict(target="localhost:8000"), "config.target must be 'inprocess' or a server URL"),
    (dict(temperature=-1.0), "config.temperature must be a number >= 0"),
    (dict(top_p=1.5), r"config.top_p must be in \(0, 1\]"),
    (dict(slots=0), "config.slots must be an integer >= 1"),
    (dict(prompt_buckets=()), "config.prompt_buckets must be non-empty"),
    (dict(model="huge"), "config.model must be one of bundled, hf, tiny"),
    (dict(model="hf"), "config.model='hf' needs config.hf_target"),
  ],
)
def test_bad_configs_name_the_field(tmp_path, change, message):
  with pytest.raises(ValueError, match=message):
    load_test.run(_config(**change), str(tmp_path), progress=print)

"""A block drafter's gamma measured at start-up (`specjax.bench.gamma_choice`): the
fastest candidate per token wins, plain decoding's loss is reported, and the launchers
measure it for a block drafter by default."""

from __future__ import annotations

import types

import numpy as np
import pytest

from specjax.bench import gamma_choice
from specjax.bench.timing import Timing


def fake_measure(seconds: dict, tokens: dict):
  """A `time_calls` stand-in: each call's median is `seconds[name]` and its output
  generated `tokens[name]` tokens (the calls themselves are never run)."""

  def measure(calls, runs):
    assert runs >= 1
    timings = {n: Timing(first_s=9.0, runs_s=(seconds[n],) * runs) for n in calls}
    outputs = {n: types.SimpleNamespace(num_generated=np.array([tokens[n], 1])) for n in calls}
    return timings, outputs

  return measure


def choose(seconds, tokens=None, candidates=(1, 2, 4, 7)):
  tokens = tokens or dict.fromkeys(seconds, 10)
  return gamma_choice.choose_gamma(
    lambda g: lambda: None, lambda: None, candidates, measure=fake_measure(seconds, tokens)
  )


def test_the_fastest_gamma_per_token_wins():
  choice = choose({0: 1.0, 1: 0.9, 2: 0.6, 4: 0.7, 7: 0.8})
  assert choice.gamma == 2
  assert choice.plain_ms == pytest.approx(100.0)  # 1 s over 10 tokens
  assert choice.speedup == pytest.approx(1.0 / 0.6)
  assert not choice.plain_wins
  report = choice.report()["gamma_probe"]
  assert report["chosen"] == 2 and set(report["ms_per_token"]) == {"1", "2", "4", "7"}
  # Per token of the longest row: 7 drafts in twice the time but four times the tokens.
  assert (
    choose({0: 1.0, 1: 0.9, 2: 0.6, 4: 0.7, 7: 1.2}, {0: 10, 1: 10, 2: 10, 4: 10, 7: 40}).gamma == 7
  )


def test_plain_decoding_faster_than_every_gamma_is_reported():
  choice = choose({0: 0.5, 1: 0.9, 2: 0.6, 4: 0.7, 7: 0.8})
  assert choice.gamma == 2 and choice.plain_wins and choice.speedup < 1


@pytest.mark.parametrize("candidates", [(), (0, 2), (1.5,)])
def test_candidates_must_be_ints_of_at_least_one(candidates):
  with pytest.raises(ValueError, match="candidates must be ints >= 1"):
    choose({0: 1.0}, candidates=candidates)


def test_candidates_span_the_block():
  assert gamma_choice.candidate_gammas(7) == (1, 2, 4, 7)
  assert gamma_choice.candidate_gammas(3) == (1, 2, 3)
  assert gamma_choice.candidate_gammas(1) == (1,)


def test_a_server_takes_the_gamma_whose_worse_temperature_is_best():
  greedy = choose({0: 1.0, 1: 0.9, 2: 0.5, 4: 0.4, 7: 0.6})  # T = 0: 4 is fastest
  sampled = choose({0: 1.0, 1: 0.8, 2: 0.7, 4: 1.1, 7: 1.5})  # T = 1: 4 loses to plain
  gamma, speedup = gamma_choice.worst_case([greedy, sampled])
  assert gamma == 2 and speedup == pytest.approx(1.0 / 0.7)
  slow = choose({0: 1.0, 1: 1.2, 2: 1.3, 4: 1.4, 7: 1.5})
  assert gamma_choice.worst_case([greedy, slow])[1] < 1  # plain wins: the server serves plainly


def test_compare_drafters_measures_only_block_drafters_and_reads_head_dirs(tmp_path):
  """`configs/compare_block.py`'s block drafters at gamma 0 are measured rows; another
  kind's 0, or a head directory that is not there, is refused naming the field."""
  from configs import compare_block
  from specjax.jobs import compare_drafters

  config = compare_block.get_config()
  assert 0 in config.head_gammas.dspark and 0 in config.head_gammas.dflash
  compare_drafters.check_config(config)
  config.head_gammas.eagle = (0,)
  with pytest.raises(ValueError, match=r"config.head_gammas.eagle may hold 0 \(measured"):
    compare_drafters.check_config(config)
  config = compare_block.get_config()
  config.head_dirs = (f"mine={tmp_path}",)
  assert compare_drafters.head_dirs(config) == [("mine", str(tmp_path))]
  config.head_dirs = (f"mine={tmp_path / 'absent'}",)
  with pytest.raises(ValueError, match="config.head_dirs must be 'label=DIR' strings"):
    compare_drafters.check_config(config)

"""Leviathan et al. formulas against the paper's published values."""

import pytest

from specjax import theory


def test_table_1_values():
  assert theory.expected_tokens_per_iteration(0.8, 5) == pytest.approx(3.69, abs=5e-3)
  assert theory.arithmetic_ops_factor(0.8, 5, c_hat=0.0) == pytest.approx(1.63, abs=5e-3)


def test_optimal_gamma_and_speedup():
  assert theory.optimal_gamma(0.8, 0.04) == 9
  assert theory.predicted_speedup(0.8, 9, 0.04) == pytest.approx(3.28, abs=5e-3)


def test_limits():
  assert theory.expected_tokens_per_iteration(1.0, 4) == 5
  assert theory.expected_tokens_per_iteration(0.0, 4) == 1
  # A verify that costs twice a single step halves the prediction.
  assert theory.predicted_speedup(0.5, 3, 0.1, verify_cost=2.0) == pytest.approx(
    theory.predicted_speedup(0.5, 3, 0.1) * 1.3 / 2.3
  )


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_range(alpha):
  with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
    theory.expected_tokens_per_iteration(alpha, 3)


def test_speedup_from_tokens_is_the_formula_with_a_measured_length():
  e = theory.expected_tokens_per_iteration(0.6, 4)
  assert theory.speedup_from_tokens(e, 4, 0.2, 1.5) == theory.predicted_speedup(0.6, 4, 0.2, 1.5)
  with pytest.raises(ValueError, match="c must be >= 0 and verify_cost > 0"):
    theory.speedup_from_tokens(3.0, 4, -0.1)


def test_predict_speedup_turns_measured_times_into_c_and_the_prediction():
  """`bench.predict_speedup`: the one place every launcher and the reproduction
  turn seconds into c, the verify cost and Leviathan's prediction."""
  from specjax import bench

  times = dict(gamma=4, target_step_s=0.010, verify_s=0.015, drafting_s=0.008)
  out = bench.predict_speedup(**times, alpha=0.7)
  assert out["c"] == pytest.approx(0.2) and out["verify_cost"] == pytest.approx(1.5)
  assert out["predicted_speedup"] == pytest.approx(theory.predicted_speedup(0.7, 4, 0.2, 1.5))
  assert bench.predict_speedup(**times, alpha=1.2)["predicted_speedup"] == pytest.approx(
    5 / (4 * 0.2 + 1.5)  # alpha clipped to 1: all gamma + 1 tokens
  )
  # A measured length (a tree), and c per draft call of a host loop (2 calls).
  tree = bench.predict_speedup(**times, tokens_per_iteration=2.5)
  assert tree["predicted_speedup"] == pytest.approx(2.5 / (0.8 + 1.5))
  loop = bench.predict_speedup(**times, tokens_per_iteration=2.5, draft_steps=2)
  assert loop["c"] == pytest.approx(0.4) and loop["predicted_speedup"] == tree["predicted_speedup"]
  # A perfect draft (drafting gamma target steps) costs exactly 1.
  perfect = dict(times, target_step_s=0.03, drafting_s=0.03 * 4)
  assert bench.predict_speedup(**perfect, alpha=1.0)["c"] == 1.0
  with pytest.raises(ValueError, match="exactly one of alpha and tokens_per_iteration"):
    bench.predict_speedup(**times)

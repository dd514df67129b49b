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

"""Closed-form predictions of Leviathan et al. 2023, section 3.

alpha is the expected acceptance rate E[beta], beta = sum_x min(p(x), q(x));
gamma the number of drafted tokens; c the cost of one draft call relative to
one target call.
"""

from __future__ import annotations


def _check_alpha(alpha: float) -> None:
  if not 0 <= alpha <= 1:
    raise ValueError(f"alpha must be in [0, 1], got {alpha!r}.")


def expected_tokens_per_iteration(alpha: float, gamma: int) -> float:
  """E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 at alpha = 1."""
  _check_alpha(alpha)
  if alpha == 1:
    return float(gamma + 1)
  return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
  """Walltime improvement over autoregressive decoding.

  Leviathan's S = E(alpha, gamma) / (gamma c + 1) assumes scoring gamma + 1
  positions costs one target step; `verify_cost` (measured time of the target
  over gamma + 1 tokens / over 1 token) replaces that 1 on compute-bound
  hardware: S = E / (gamma c + verify_cost).
  """
  _check_costs(c, verify_cost)
  return speedup_from_tokens(expected_tokens_per_iteration(alpha, gamma), gamma, c, verify_cost)


def speedup_from_tokens(
  tokens_per_iteration: float, draft_steps: float, c: float, verify_cost: float = 1.0
) -> float:
  """S = tokens_per_iteration / (draft_steps c + verify_cost): `predicted_speedup`
  with measured tokens per iteration instead of E(alpha, gamma) (token trees:
  `draft_steps` their nodes; host loops: the draft's calls per iteration).
  """

  _check_costs(c, verify_cost)
  return tokens_per_iteration / (draft_steps * c + verify_cost)


def _check_costs(c: float, verify_cost: float) -> None:
  if c < 0 or verify_cost <= 0:
    raise ValueError(f"c must be >= 0 and verify_cost > 0, got {c!r}, {verify_cost!r}.")


def arithmetic_ops_factor(alpha: float, gamma: int, c_hat: float) -> float:
  """Increase in arithmetic operations: (1 - a)(gamma c_hat + gamma + 1) / (1 - a^(gamma+1))."""
  return (gamma * c_hat + gamma + 1) / expected_tokens_per_iteration(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
  """The gamma in [1, max_gamma] that maximises `predicted_speedup`."""
  return max(range(1, max_gamma + 1), key=lambda g: predicted_speedup(alpha, g, c))

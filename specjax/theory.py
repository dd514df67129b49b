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


def gumbel_coupling_acceptance(p, q):
  """The coupled verifier's acceptance of a token drafted with the same noise:
  P(argmax(log p + G) = argmax(log q + G)) for one Gumbel noise G shared by both
  laws (Daliri et al. 2024, arXiv 2408.07978; P-MinHash's collision probability),

      sum_i p_i q_i / sum_j max(p_j q_i, q_j p_i),

  computed exactly in O(V log V) per law by sorting the ratios r = p / q.

  Args:
    p, q: `[..., V]` laws (numpy; float64 recommended).

  Returns:
    `[...]` float64 in [0, 1 - TV(p, q)] (and >= (1 - TV) / (1 + TV),
    `coupled_acceptance_bound`).
  """
  import numpy as np

  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  if p.shape != q.shape or p.ndim < 1:
    raise ValueError(f"p and q must be laws of one shape [..., V], got {p.shape} and {q.shape}.")
  flat_p, flat_q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
  out = np.empty(flat_p.shape[0])
  for row, (pr, qr) in enumerate(zip(flat_p, flat_q)):
    with np.errstate(divide="ignore", invalid="ignore"):
      ratio = np.where(qr > 0, pr / np.where(qr > 0, qr, 1.0), np.inf)
    ratio = np.where((pr == 0) & (qr == 0), 0.0, ratio)
    order = np.argsort(ratio, kind="stable")
    r, ps, qs = ratio[order], pr[order], qr[order]
    p_from = np.concatenate([np.cumsum(ps[::-1])[::-1], [0.0]])  # sum of p over ranks >= k
    q_before = np.concatenate([[0.0], np.cumsum(qs)])  # sum of q over ranks < k
    first = np.searchsorted(r, r, side="left")  # ties count as ratio >= r_i
    # sum_j max(p_j q_i, q_j p_i): p_j q_i where r_j >= r_i, q_j p_i where r_j < r_i.
    denominator = qs * p_from[first] + ps * q_before[first]
    both = (ps > 0) & (qs > 0)
    out[row] = np.sum(np.where(both, ps * qs / np.where(both, denominator, 1.0), 0.0))
  return out.reshape(p.shape[:-1])


def coupled_acceptance_bound(tv):
  """Daliri et al.'s lower bound on `gumbel_coupling_acceptance`: (1 - TV) / (1 + TV)
  for total variation distance TV in [0, 1] (the token rule accepts 1 - TV)."""
  return (1 - tv) / (1 + tv)

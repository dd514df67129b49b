"""Confidence-driven verification length: how many drafted tokens an iteration scores.

Scoring g + 1 target rows costs more than scoring k + 1 < g + 1 (how much more is
measured: docs/performance.md); when the drafts are unlikely to survive, verifying
a shorter prefix buys nearly the same tokens for less. A drafter with
`gives_confidence` sets `Proposal.confidence c [B, g]`, its estimate that draft i
is accepted given that drafts < i were; S[b, i] = c[b, 0] ... c[b, i] is the
chance that draft i survives. With a few compiled lengths l_1 < ... < l_m = g
(`SpecConfig.verify_lengths`, static shapes) and the measured relative cost of an
iteration at each (`verify_costs`, `measure_verify_costs`), the iteration
verifies every row's proposal cut to one batch-wide k (rows with likely drafts
get up to k): `choose_verify_length`.

The rule and exactness. The expected tokens an iteration commits at length k is
E(k) = sum_b active_b (1 + sum_{i < min(k, lengths_b)} S[b, i]). Taking
argmax_k E(k) / cost(k) over the whole chain would read S beyond a position to
decide whether to verify it, and S[b, i] depends on the drafted x_i itself (and
on everything drafted before): a token verified only when it or its successors
look good is no longer a draw from q, and the token and block rules would be
biased at temperature > 0. So the choice walks up the lengths and decides
whether to go from l_j to l_{j + 1} from the first l_j drafts' confidences only: it compares
E(l_j) / cost(l_j) with the same sum at l_{j + 1}, whose unknown terms are
extrapolated from the last known conditional c[b, l_j - 1]. Whether position i
is verified is then a function of the drafts before i (and of the other rows'
drafts, independent of this row's draws): a stopping time, the case every
verifier already serves (a proposal of lengths k is verified as a block of k,
q = 0 past it; the adaptive draft lengths rely on the same argument). Greedy and
coupled verification emit the target's own argmax / Gumbel-max draws at every
position whatever is verified, so their text does not change at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specjax.drafting import Drafter, Proposal
from specjax.validation import is_int, is_real


def check_verify_lengths(
  verify_lengths, verify_costs, gamma: int, drafter: Drafter | None = None
) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
  """`(verify_lengths, verify_costs)` as `SpecConfig` holds them, checked before
  compiling: None and None (off), or the lengths (distinct ints, sorted, in [1,
  gamma], gamma among them) and as many positive finite costs. With `drafter`,
  it must give confidence (`Drafter.gives_confidence`) and draft chains.

  Raises:
    ValueError naming the argument and its allowed range.
  """
  if verify_lengths is None:
    if verify_costs is not None:
      raise ValueError("verify_costs needs verify_lengths (the lengths they cost).")
    return None, None
  lengths = check_lengths(verify_lengths, gamma)
  costs = tuple(verify_costs) if isinstance(verify_costs, (tuple, list)) else None
  if (
    costs is None
    or len(costs) != len(lengths)
    or not all(is_real(c) and math.isfinite(c) and c > 0 for c in costs)
  ):
    raise ValueError(
      f"verify_costs must be {len(lengths)} positive finite numbers, one per verify length "
      f"{lengths} (measure them with specjax.bench.verify_costs.measure_verify_costs), "
      f"got {verify_costs!r}."
    )
  if drafter is not None and (not drafter.gives_confidence or drafter.tree is not None):
    raise ValueError(
      f"verify_lengths needs a chain drafter that gives confidence (Proposal.confidence); "
      f"{type(drafter).__name__} does not (gives_confidence={drafter.gives_confidence}, "
      f"tree={drafter.tree is not None})."
    )
  return lengths, tuple(float(c) for c in costs)


def check_lengths(verify_lengths, gamma: int) -> tuple[int, ...]:
  """`verify_lengths` as a tuple, checked: distinct ints in [1, gamma], sorted,
  gamma last. Raises a ValueError naming it otherwise."""
  lengths = tuple(verify_lengths) if isinstance(verify_lengths, (tuple, list)) else None
  if (
    not lengths
    or not all(is_int(k) and 1 <= k <= gamma for k in lengths)
    or list(lengths) != sorted(set(lengths))
    or lengths[-1] != gamma
  ):
    raise ValueError(
      f"verify_lengths must be distinct ints in [1, gamma={gamma}], sorted, with gamma "
      f"last (e.g. (1, {max(gamma // 2, 1)}, {gamma})), got {verify_lengths!r}."
    )
  return tuple(int(k) for k in lengths)


def lengths_up_to(verify_lengths: Sequence[int], gamma: int) -> tuple[int, ...]:
  """The verify lengths of an iteration drafting `gamma` tokens (a server's steps
  draft fewer than the largest): those below gamma, then gamma."""
  return (*(k for k in verify_lengths if k < gamma), gamma)


def choose_verify_length(
  confidence: jax.Array,
  lengths: jax.Array,
  active: jax.Array,
  verify_lengths: Sequence[int],
  verify_costs: Sequence[float],
) -> jax.Array:
  """The batch's verify length, in-graph (the module's docstring has the rule).

  Args:
    confidence: `[B, g]` float32 in [0, 1], `Proposal.confidence` (conditional
      acceptance of each draft).
    lengths: `[B]` int32, the tokens each row proposed.
    active: `[B]` bool, the rows still generating (only they count).
    verify_lengths: the static lengths l_1 < ... < l_m, l_m <= g.
    verify_costs: the static relative cost of an iteration at each.

  Returns:
    scalar int32, the index j of the chosen length l_j in `verify_lengths`.
  """
  survival = jnp.cumprod(confidence.astype(jnp.float32), axis=1)  # [B, g]
  weight = active.astype(jnp.float32)
  positions = jnp.arange(confidence.shape[1])[None, :]

  def expected(known: int, k: int) -> jax.Array:
    """Expected tokens at length k > known, from S at positions < `known` only."""
    sure = jnp.sum(jnp.where(positions < jnp.minimum(known, lengths)[:, None], survival, 0), 1)
    if k == known:
      return jnp.sum(weight * (1 + sure))
    last_s, last_c = survival[:, known - 1], confidence[:, known - 1].astype(jnp.float32)
    # Positions known .. k - 1, each survival the last known times the last conditional.
    steps = jnp.arange(1, k - known + 1, dtype=jnp.float32)[None, :]
    beyond = jnp.sum(last_s[:, None] * last_c[:, None] ** steps, axis=1)
    return jnp.sum(weight * (1 + sure + jnp.where(lengths > known, beyond, 0)))

  index = jnp.int32(0)
  going = jnp.bool_(True)
  for j in range(len(verify_lengths) - 1):
    short, long = verify_lengths[j], verify_lengths[j + 1]
    # Tokens per cost at l_{j+1} at least those at l_j (cross-multiplied: no 0 / 0).
    wider = expected(short, long) * verify_costs[j] >= expected(short, short) * verify_costs[j + 1]
    going = going & wider
    index = index + going.astype(jnp.int32)
  return index


def cut_proposal(proposal: Proposal, k: int) -> Proposal:
  """A chain `proposal` verified as its first `k` (static) tokens: tokens, probs and
  confidence `[B, k, ...]`, lengths min(lengths, k)."""
  cut = lambda x: None if x is None else x[:, :k]
  return proposal._replace(
    tokens=proposal.tokens[:, :k],
    probs=cut(proposal.probs),
    lengths=jnp.minimum(proposal.lengths, k),
    confidence=cut(proposal.confidence),
  )


def relative_costs(seconds: Sequence[float]) -> tuple[float, ...]:
  """Measured seconds per verify length (ascending lengths) as `verify_costs`: a
  running maximum (scoring more rows is never cheaper; a shorter length's slower
  reading is noise), divided by the largest."""
  running = [max(seconds[: i + 1]) for i in range(len(seconds))]
  return tuple(s / running[-1] for s in running)

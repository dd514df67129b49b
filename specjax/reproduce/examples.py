"""Small laws worked by hand, then sampled through specjax's own verifiers.

- The explainers' one-token examples: a draft q and a target p over {A, B};
  acceptance of A is min(1, p(A)/q(A)), a rejection resamples from
  normalize(max(0, p - q)), and the output law is p.
- Sun et al.'s binary toy (block verification, arXiv 2403.10444): p = (1/3,
  2/3), q = (2/3, 1/3) at every position, gamma = 2: 10/9 expected accepted
  tokens with token verification, 11/9 with block verification.
- The "keep the draft token only if it is the target's top-1" shortcut: not
  speculative sampling at all at T > 0; its output law is measured against p.

Each function returns a JSON-ready dict: the closed form and what `n` sampled
draws through `specjax.verify` gave.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import sample
from specjax.verify import block_verify, token_verify
from specjax.verify.expected import expected_accepted


def _sampled_one_token(q: np.ndarray, p: np.ndarray, n: int, seed: int) -> dict:
  """n independent one-token iterations: x ~ q, then `token_verify` (gamma = 1)."""
  k_draft, k_verify = jax.random.split(jax.random.key(seed))
  q32 = jnp.tile(jnp.asarray(q, jnp.float32), (n, 1))
  drafted = sample(k_draft, q32)[:, None]  # [n, 1]
  target = jnp.tile(jnp.asarray(p, jnp.float32), (n, 2, 1))  # the bonus position too
  result = jax.jit(token_verify)(k_verify, drafted, q32[:, None], target)
  accepted = np.asarray(result.num_accepted) == 1
  output = np.where(accepted, np.asarray(drafted[:, 0]), np.asarray(result.next_token))
  law = np.bincount(output, minlength=len(p)) / n
  a_drafted = np.asarray(drafted[:, 0]) == 0
  return {
    "sampled_acceptance": float(accepted.mean()),
    "sampled_acceptance_of_A": float(accepted[a_drafted].mean()) if a_drafted.any() else None,
    "sampled_output_law": law.tolist(),
    "samples": n,
  }


def one_token_example(q, p, n: int = 200_000, seed: int = 0) -> dict:
  """The explainer's example for draft law `q` and target law `p` over {A, B}."""
  q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
  accept = np.minimum(1.0, p / q)
  residual = np.maximum(0.0, p - q)
  residual = residual / residual.sum() if residual.sum() > 0 else p
  return {
    "q": q.tolist(),
    "p": p.tolist(),
    "acceptance_of_A": float(accept[0]),
    "acceptance": float(np.sum(np.minimum(p, q))),  # beta = 1 - TV(p, q)
    "residual": residual.tolist(),
    "output_law": p.tolist(),
    **_sampled_one_token(q, p, n, seed),
  }


def block_toy(n: int = 200_000, seed: int = 1) -> dict:
  """Sun et al.'s binary example: expected accepted tokens, token vs block rule,
  exactly (averaged over the 4 drafted blocks) and sampled."""
  p, q, g = np.array([1 / 3, 2 / 3]), np.array([2 / 3, 1 / 3]), 2
  drafts = np.array(list(itertools.product(range(2), repeat=g)), np.int32)
  weight = np.prod(q[drafts], axis=1)
  target = jnp.asarray(np.tile(p, (len(drafts), g + 1, 1)), jnp.float32)
  draft = jnp.asarray(np.tile(q, (len(drafts), g, 1)), jnp.float32)
  out = {"p": p.tolist(), "q": q.tolist(), "gamma": g, "paper": {"token": 10 / 9, "block": 11 / 9}}
  k_draft, k_verify = jax.random.split(jax.random.key(seed))
  blocks = sample(k_draft, jnp.tile(jnp.asarray(q, jnp.float32), (n, g, 1)))  # [n, g]
  for rule, verify in (("token", token_verify), ("block", block_verify)):
    exact = expected_accepted(rule, jnp.asarray(drafts), draft, target)
    out[f"{rule}_exact"] = float(np.sum(weight * np.asarray(exact)))
    result = jax.jit(verify)(
      k_verify,
      blocks,
      jnp.tile(jnp.asarray(q, jnp.float32), (n, g, 1)),
      jnp.tile(jnp.asarray(p, jnp.float32), (n, g + 1, 1)),
    )
    out[f"{rule}_sampled"] = float(np.mean(np.asarray(result.num_accepted)))
  out["samples"] = n
  return out


def top1_shortcut(q, p, n: int = 200_000, seed: int = 2) -> dict:
  """The shortcut "accept x ~ q iff x is p's argmax, else emit p's argmax",
  sampled, against speculative sampling's law (which is p): total variation
  distance of each from p. The shortcut's law is one-hot at argmax p."""
  q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
  top = int(np.argmax(p))
  drafted = np.asarray(sample(jax.random.key(seed), jnp.tile(jnp.asarray(q, jnp.float32), (n, 1))))
  output = np.where(drafted == top, drafted, top)  # every path emits the top-1
  law = np.bincount(output, minlength=len(p)) / n
  exact = _sampled_one_token(q, p, n, seed + 1)["sampled_output_law"]
  return {
    "q": q.tolist(),
    "p": p.tolist(),
    "shortcut_law": law.tolist(),
    "shortcut_tv_to_p": float(0.5 * np.abs(law - p).sum()),
    "speculative_law": exact,
    "speculative_tv_to_p": float(0.5 * np.abs(np.asarray(exact) - p).sum()),
    "samples": n,
  }

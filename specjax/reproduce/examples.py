"""Small laws worked by hand, then sampled through specjax's own verifiers.

- The explainers' one-token examples: q and p over {A, B}; the output law is p.

- Sun et al.'s binary toy (block verification, arXiv 2403.10444): p = (1/3,
  2/3), q = (2/3, 1/3) at every position, gamma = 2: 10/9 expected accepted
  tokens with token verification, 11/9 with block verification.
- The "keep the draft token only if it is the target's top-1" shortcut: not
  speculative sampling at all at T > 0; its output law is measured against p.

Each function returns a JSON-ready dict: the closed form and what `n` draws
through `specjax.verify` gave (each example's draws: one compiled program).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import sample
from specjax.verify import block_verify, token_verify
from specjax.verify.expected import expected_accepted


@functools.partial(jax.jit, static_argnames="n")
def _draws(key: jax.Array, q: jax.Array, *, n: int) -> jax.Array:
  """`[n]` independent draws from the law `q` `[V]`."""
  return sample(key, jnp.tile(q, (n, 1)))


@functools.partial(jax.jit, static_argnames="n")
def _one_token_draws(key: jax.Array, q: jax.Array, p: jax.Array, *, n: int):
  """n one-token iterations: x ~ q, then `token_verify` (gamma = 1).
  Returns (drafted `[n]`, accepted `[n]` in {0, 1}, the emitted token `[n]`)."""
  k_draft, k_verify = jax.random.split(key)
  drafted = _draws(k_draft, q, n=n)[:, None]  # [n, 1]
  target = jnp.tile(p, (n, 2, 1))  # the bonus position too
  result = token_verify(k_verify, drafted, jnp.tile(q, (n, 1, 1)), target)
  return drafted[:, 0], result.num_accepted, result.next_token


def _sampled_one_token(q: np.ndarray, p: np.ndarray, n: int, seed: int) -> dict:
  """n independent one-token iterations: x ~ q, then `token_verify` (gamma = 1)."""
  drafted, num_accepted, next_token = map(
    np.asarray,
    _one_token_draws(
      jax.random.key(seed), jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32), n=n
    ),
  )
  accepted = num_accepted == 1
  output = np.where(accepted, drafted, next_token)
  law = np.bincount(output, minlength=len(p)) / n
  a_drafted = drafted == 0
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


_expected_accepted = jax.jit(expected_accepted, static_argnums=0)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _block_draws(key, q, p, n: int, g: int) -> dict[str, jax.Array]:
  """n blocks of g draws from q, verified against p by each rule: {"token",
  "block"} -> `[n]` accepted lengths (the same blocks for both rules)."""
  k_draft, k_verify = jax.random.split(key)
  draft_probs = jnp.tile(q, (n, g, 1))
  blocks = sample(k_draft, draft_probs)  # [n, g]
  target_probs = jnp.tile(p, (n, g + 1, 1))
  return {
    rule: verify(k_verify, blocks, draft_probs, target_probs).num_accepted
    for rule, verify in (("token", token_verify), ("block", block_verify))
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
  accepted = _block_draws(
    jax.random.key(seed), jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32), n, g
  )
  for rule in ("token", "block"):
    exact = _expected_accepted(rule, jnp.asarray(drafts), draft, target)
    out[f"{rule}_exact"] = float(np.sum(weight * np.asarray(exact)))
    out[f"{rule}_sampled"] = float(np.mean(np.asarray(accepted[rule])))
  out["samples"] = n
  return out


def top1_shortcut(q, p, n: int = 200_000, seed: int = 2) -> dict:
  """The shortcut "accept x ~ q iff x is p's argmax, else emit p's argmax",
  sampled, against speculative sampling's law (which is p): total variation
  distance of each from p. The shortcut's law is one-hot at argmax p."""
  q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
  top = int(np.argmax(p))
  drafted = np.asarray(_draws(jax.random.key(seed), jnp.asarray(q, jnp.float32), n=n))
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

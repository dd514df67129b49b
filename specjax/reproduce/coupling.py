"""Daliri et al.'s claims on the bundled pair: the coupled verifier's text is fixed
by the seed whatever the drafter, and its acceptance against the token rule's,
checked on the laws the pair meets along real text (`specjax.coupling`).

`coupling_study` decodes each prompt alone (batch 1), plainly and with every
drafter, all with one key per row; then reads the target's and the draft's
warped laws along the plain text and computes, per position, the token rule's
acceptance 1 - TV, the coupled rule's exact acceptance
(`theory.gumbel_coupling_acceptance`) and the paper's lower bound
(1 - TV) / (1 + TV).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import bench, theory


@jax.jit
def _laws(model, tokens):
  return model(tokens)


def coupling_study(
  target,
  drafters: dict[str, Any],
  law_draft,
  prompts,
  lengths,
  *,
  temperature: float,
  gamma: int,
  max_new_tokens: int,
  seed: int = 0,
  progress: Callable[[str], None] = print,
) -> dict[str, Any]:
  """The invariance and the acceptance bound at one temperature.

  Args:
    drafters: name -> drafter; each decodes every prompt with verifier "coupled".
    law_draft: the draft `Transformer` whose laws are compared with the target's.
    prompts, lengths: `[N, P]` and `[N]`, each prompt decoded alone.

  Returns:
    `{"temperature", "invariance": [{drafter, tokens, identical, alpha}],
    "positions", "one_minus_tv", "coupled", "bound", "bound_holds"}`: means over
    the positions of the plain text, and how many positions satisfy
    bound <= coupled <= 1 - TV.
  """
  sampling = specjax.SamplingParams(temperature=float(temperature))
  keys = jax.random.split(jax.random.key(seed), len(lengths))
  one = [(prompts[i : i + 1], lengths[i : i + 1], keys[i : i + 1]) for i in range(len(lengths))]
  run = dict(max_new_tokens=max_new_tokens, sampling=sampling)
  plain = [
    np.asarray(specjax.autoregressive_generate(target, p, n, key=k, **run).tokens)
    for p, n, k in one
  ]
  invariance = []
  for name, drafter in drafters.items():
    outs = [
      specjax.speculative_generate(target, drafter, p, n, key=k, gamma=gamma, **run)
      for p, n, k in one
    ]
    identical = all(np.array_equal(np.asarray(o.tokens), t) for o, t in zip(outs, plain))
    accepted = sum(float(np.sum(o.stats.accepted)) for o in outs)
    evaluated = sum(float(np.sum(o.stats.evaluated)) for o in outs)
    invariance.append(
      dict(
        drafter=name,
        tokens=int(sum(t.size for t in plain)),
        identical=bool(identical),
        alpha=accepted / max(evaluated, 1.0),
      )
    )
    progress(f"  coupled, {name}: identical to plain decoding: {identical}")
    bench.free_compiled_programs()
  p_all, q_all = [], []
  for (p, n, _), tokens in zip(one, plain):
    length = int(n[0])
    sequence = jnp.concatenate([p[:, :length], jnp.asarray(tokens)], axis=1)
    # Position t's logits predict token t + 1: the laws of the generated tokens.
    at = slice(length - 1, length - 1 + tokens.shape[1])
    for model, out in ((target, p_all), (law_draft, q_all)):
      warped = specjax.warp_probs(_laws(model, sequence)[0, at], sampling)
      out.append(np.asarray(warped, np.float64))
  p_laws = np.concatenate(p_all)
  q_laws = np.concatenate(q_all)[:, : p_laws.shape[-1]]
  q_laws = q_laws / q_laws.sum(axis=-1, keepdims=True)
  tv = 0.5 * np.abs(p_laws - q_laws).sum(axis=-1)
  coupled = theory.gumbel_coupling_acceptance(p_laws, q_laws)
  bound = theory.coupled_acceptance_bound(tv)
  holds = (bound <= coupled + 1e-9) & (coupled <= 1 - tv + 1e-9)
  return {
    "temperature": float(temperature),
    "invariance": invariance,
    "positions": int(len(tv)),
    "one_minus_tv": float(np.mean(1 - tv)),
    "coupled": float(np.mean(coupled)),
    "bound": float(np.mean(bound)),
    "bound_holds": int(np.sum(holds)),
  }

"""Where one speculative iteration's time goes, on the bundled pair (JSON).

  python -m experiments.profile_iteration [--gamma=4] [--output_json=PATH]

Each part runs `repeats` times inside one jitted `fori_loop` (no dispatch
overhead), median of 5 after a warm-up, batch 1, float32, temperature 0:
the target's forward over 1 and over gamma + 1 positions, the draft's
proposal (gamma calls with sampling), verification (the target forward plus
the greedy rule), and the whole generation loops (AR ms/token, speculative ms
per iteration) on the first held-out prompt.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import app, flags, logging

import specjax
from experiments import common
from specjax import benchmarking, pretrained
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.drafting import ModelDrafter
from specjax.generation.common import cache_capacity
from specjax.generation.state import SpecConfig
from specjax.validation import check_output_path, check_positive_int

NUM_RUNS = 5  # timed runs per part; each figure is their median


def profile(gamma: int = 4, repeats: int = 100, max_new_tokens: int = 64) -> dict:
  """Milliseconds of each part of a speculative iteration (see the module doc)."""
  check_positive_int("gamma", gamma)
  check_positive_int("repeats", repeats)
  check_positive_int("max_new_tokens", max_new_tokens)
  target, draft, tokenizer = pretrained.load_pair()
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(1))
  config = SpecConfig(
    gamma=gamma, max_new_tokens=max_new_tokens, sampling=specjax.GREEDY, verifier="greedy"
  )
  drafter = ModelDrafter(draft)
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)
  width = int(lengths[0])

  def target_cache():
    cache = target.init_cache(1, capacity)
    return target.forward_cached(prompts, cache)[1].with_lengths(lengths)

  def forward_ms(t):
    return 1e3 * benchmarking.call_seconds(
      target,
      prompts,
      lengths,
      tokens_per_call=t,
      capacity=capacity,
      num_steps=repeats,
      num_runs=NUM_RUNS,
    )

  @jax.jit
  def propose(drafter, state):
    def body(i, acc):
      recent = jnp.stack([prompts[:, width - 2], jnp.full((1,), i % 97)], axis=1)
      proposal, _ = drafter.propose(
        state,
        recent.astype(jnp.int32),
        jax.random.key(0),
        jnp.full((1,), gamma, jnp.int32),
        gamma=gamma,
        sampling=config.sampling,
      )
      return acc + proposal.tokens[0, 0]

    return jax.lax.fori_loop(0, repeats, body, 0)

  @jax.jit
  def verify(model, cache):
    def body(i, acc):
      block = jnp.full((1, gamma + 1), i % 97, jnp.int32)
      logits, _ = model.forward_cached(block, cache)
      probs = specjax.warp_probs(logits, config.sampling)
      n, y = specjax.verify.greedy_verify(None, block[:, 1:], None, probs)
      return acc + n[0] + y[0]

    return jax.lax.fori_loop(0, repeats, body, 0)

  draft_state = drafter.init(prompts, lengths, jnp.zeros((1,), jnp.int32), capacity)
  result = {
    "gamma": gamma,
    "target_params": target.num_params,
    "draft_params": draft.num_params,
    "target_forward_1_ms": forward_ms(1),
    "target_forward_gamma_plus_1_ms": forward_ms(gamma + 1),
  }

  def ar():
    return specjax.autoregressive_generate(
      target, prompts, lengths, max_new_tokens=max_new_tokens, sampling=specjax.GREEDY
    )

  def spec():
    return specjax.speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      gamma=gamma,
      max_new_tokens=max_new_tokens,
      sampling=specjax.GREEDY,
    )

  iterations = int(spec().stats.iterations)
  verify_cache = target_cache()
  # name -> (call, units of work per call): a call's time / units is the figure.
  parts = {
    "draft_propose_ms": (lambda: propose(drafter, draft_state), repeats),
    "verify_ms": (lambda: verify(target, verify_cache), repeats),
    "ar_ms_per_token": (lambda: ar().tokens, max_new_tokens),
    "spec_ms_per_iteration": (lambda: spec().tokens, iterations),
  }
  timings, _ = benchmarking.time_calls({name: fn for name, (fn, _) in parts.items()}, NUM_RUNS)
  for name, (_, units) in parts.items():
    result[name] = timings[name].median_s * 1e3 / units
  result["rest_of_iteration_ms"] = (
    result["spec_ms_per_iteration"] - result["draft_propose_ms"] - result["verify_ms"]
  )
  result["iterations"] = iterations
  return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the output
  result = profile(check_positive_int("--gamma", flags.FLAGS.gamma))
  print(json.dumps(result, indent=2))
  common.write_json(output_json, result)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  app.run(main)

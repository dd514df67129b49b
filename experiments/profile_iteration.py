"""Where one speculative iteration's time goes, on the bundled pair (JSON).

  python -m experiments.profile_iteration [--gamma=4] [--output_json=PATH]

Each part runs `--repeats` times inside one jitted `fori_loop` (no dispatch
overhead), median of 5 after a warm-up, batch 1, float32, temperature 0:
the target's forward over 1 and over gamma + 1 positions, the draft's
proposal (gamma calls with sampling), verification (the target forward plus
the greedy rule), and the whole generation loops (AR ms/token, speculative ms
per iteration) on the first held-out prompt.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

import specjax
from specjax import pretrained
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.drafting import ModelDrafter
from specjax.generation.state import SpecConfig


def _median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[2] / repeats * 1e3


def profile(gamma: int = 4, repeats: int = 100, max_new_tokens: int = 64) -> dict:
  target, draft, tokenizer = pretrained.load_pair()
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(1))
  config = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, sampling=specjax.GREEDY,
                      verifier="greedy")
  drafter = ModelDrafter(draft)
  capacity = prompts.shape[1] + max_new_tokens + gamma + 1
  width = int(lengths[0])

  def target_cache():
    cache = target.init_cache(1, capacity)
    return target.forward_cached(prompts, cache)[1].with_lengths(lengths)

  def forward(t):
    @jax.jit
    def run(model, cache):
      def body(i, acc):
        logits, _ = model.forward_cached(jnp.full((1, t), i % 97, jnp.int32), cache)
        return acc + logits[0, 0, 0]
      return jax.lax.fori_loop(0, repeats, body, 0.0)
    return _median_ms(run, target, target_cache(), repeats=repeats)

  @jax.jit
  def propose(drafter, state):
    def body(i, acc):
      recent = jnp.stack([prompts[:, width - 2], jnp.full((1,), i % 97)], axis=1)
      proposal, _ = drafter.propose(state, recent.astype(jnp.int32), jax.random.key(0),
                                    jnp.full((1,), gamma, jnp.int32), config)
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
      "gamma": gamma, "target_params": target.num_params, "draft_params": draft.num_params,
      "target_forward_1_ms": forward(1),
      "target_forward_gamma_plus_1_ms": forward(gamma + 1),
      "draft_propose_ms": _median_ms(propose, drafter, draft_state, repeats=repeats),
      "verify_ms": _median_ms(verify, target, target_cache(), repeats=repeats),
  }
  ar = lambda: specjax.autoregressive_generate(target, prompts, lengths,
                                               max_new_tokens=max_new_tokens,
                                               sampling=specjax.GREEDY)
  spec = lambda: specjax.speculative_generate(target, draft, prompts, lengths, gamma=gamma,
                                              max_new_tokens=max_new_tokens,
                                              sampling=specjax.GREEDY)
  iterations = int(spec().stats.iterations)
  result["ar_ms_per_token"] = _median_ms(lambda: ar().tokens, repeats=max_new_tokens)
  result["spec_ms_per_iteration"] = _median_ms(lambda: spec().tokens, repeats=iterations)
  result["rest_of_iteration_ms"] = (result["spec_ms_per_iteration"] - result["draft_propose_ms"]
                                    - result["verify_ms"])
  result["iterations"] = iterations
  return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  result = profile(flags.FLAGS.gamma)
  text = json.dumps(result, indent=2)
  print(text)
  if flags.FLAGS.output_json:
    with open(flags.FLAGS.output_json, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  flags.DEFINE_string("output_json", None, "Also write the JSON here.")
  app.run(main)

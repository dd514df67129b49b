"""Where one speculative iteration's time goes, on the bundled pair (JSON).

  python -m experiments.profile_iteration [--gamma=4] [--temperature=0]
      [--repeats=100] [--max_new_tokens=64] [--trace_dir=DIR] [--output_json=PATH]

Each part runs `repeats` times inside one jitted `fori_loop` (no dispatch
overhead), median of 5 after a warm-up, batch 1, float32, on the first
held-out prompt:
  target_forward_{1,gamma_plus_1}_ms   the target's forward over 1 and gamma + 1 tokens
  draft_forward_1_ms                   one draft call
  draft_propose_ms                     a whole proposal (gamma calls, warp and sampling)
  verify_ms                      target forward over gamma + 1, warp, verification
  ar_ms_per_token, spec_ms_per_iteration   the whole generation loops
  rest_of_iteration_ms                 spec - propose - score_verify: the commit
  overhead_fraction                    share of an iteration that is neither model's forward

and from the compiled programs, the kernels (`specjax.bench.hlo`) each loop body
launches: an autoregressive step, a speculative iteration (around its draft
loop) and one draft call of the proposal loop. `--trace_dir` also writes a
`jax.profiler` trace of one speculative generate call (TensorBoard / Perfetto).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import flags, logging

import specjax
from experiments import common
from specjax import bench, pretrained
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.drafting import ModelDrafter, Proposal
from specjax.generation.autoregressive import _autoregressive_program
from specjax.generation.speculative import _speculative_program, verifier_inputs
from specjax.generation.state import SpecConfig
from specjax.models.kv_cache import cache_capacity
from specjax.validation import check_output_path, check_positive_int

NUM_RUNS = 5  # timed runs per part; each figure is their median


def _kernels(ar_text: str, spec_text: str) -> dict:
  """Kernels per loop body: the AR step, the speculative iteration, one draft call."""
  ar = max(bench.loop_kernels(ar_text), key=lambda loop: loop["kernels"])
  counts = bench.kernel_counts(spec_text)
  bodies = bench.while_bodies(spec_text)
  outer = [b for b in bodies if counts[b]["while"]]
  spec = max(outer, key=lambda b: sum(counts[b].values()))
  # The draft loop: the largest other body (random-bit loops are small).
  draft = max((b for b in bodies if b != spec), key=lambda b: sum(counts[b].values()))
  return {
    "ar_step_kernels": ar["kernels"],
    "spec_iteration_kernels": sum(counts[spec].values()),
    "draft_call_kernels": sum(counts[draft].values()),
    "spec_iteration_calls": counts[spec]["call"],  # random-bit loops called per iteration
  }


def profile(
  gamma: int = 4,
  repeats: int = 100,
  max_new_tokens: int = 64,
  temperature: float = 0.0,
  trace_dir: str | None = None,
) -> dict:
  """Milliseconds of each part of a speculative iteration (see the module doc)."""
  check_positive_int("gamma", gamma)
  check_positive_int("repeats", repeats)
  check_positive_int("max_new_tokens", max_new_tokens)
  sampling = specjax.SamplingParams(temperature=temperature)
  target, draft, tokenizer = pretrained.load_pair()
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(1))
  verifier = "greedy" if sampling.greedy else "token"
  config = SpecConfig(
    gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling, verifier=verifier
  )
  drafter = ModelDrafter(draft)
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)
  width = int(lengths[0])
  key = jax.random.key(0)
  vocab = target.cfg.vocab_size

  def forward_ms(model, t):
    seconds = bench.call_seconds(
      model,
      prompts,
      lengths,
      tokens_per_call=t,
      capacity=capacity,
      num_steps=repeats,
      num_runs=NUM_RUNS,
    )
    return 1e3 * seconds

  @jax.jit
  def propose(drafter, state):
    def body(i, acc):
      recent = jnp.stack([prompts[:, width - 2], jnp.full((1,), i % 97)], axis=1)
      proposal, _ = drafter.propose(
        state,
        recent.astype(jnp.int32),
        jax.random.fold_in(key, i),
        jnp.full((1,), gamma, jnp.int32),
        gamma=gamma,
        sampling=sampling,
      )
      return acc + proposal.tokens[0, 0]

    return jax.lax.fori_loop(0, repeats, body, 0)

  @jax.jit
  def score_verify(model, cache):
    # As the step does it: the target over gamma + 1 tokens, then the verifier's
    # inputs (warp, q) and the rule itself.
    q = jax.nn.softmax(jnp.zeros((1, gamma, vocab)))

    def body(i, acc):
      block = jnp.full((1, gamma + 1), i % 97, jnp.int32)
      logits, _ = model.forward_cached(block, cache)
      proposal = Proposal(
        block[:, 1:], None if sampling.greedy else q, jnp.full((1,), gamma), jnp.int32(gamma)
      )
      inputs = verifier_inputs(proposal, logits, sampling, vocab, sampling.greedy)
      n, y = specjax.verify.get_verifier(verifier)(jax.random.fold_in(key, i), *inputs)
      return acc + n[0] + y[0]

    return jax.lax.fori_loop(0, repeats, body, 0)

  def ar():
    return specjax.autoregressive_generate(
      target, prompts, lengths, max_new_tokens=max_new_tokens, sampling=sampling, key=key
    )

  def spec():
    return specjax.speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      gamma=gamma,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=key,
    )

  cache = target.init_cache(1, capacity)
  cache = target.forward_cached(prompts, cache)[1].with_lengths(lengths)
  draft_state = drafter.init(prompts, lengths, jnp.zeros((1,), jnp.int32), capacity)
  out = spec()
  iterations = int(out.stats.iterations)
  draft_calls = (int(out.stats.draft_calls) - 1) / max(iterations, 1)
  result = {
    "gamma": gamma,
    "temperature": float(temperature),
    "target_params": target.num_params,
    "draft_params": draft.num_params,
    "target_forward_1_ms": forward_ms(target, 1),
    "target_forward_gamma_plus_1_ms": forward_ms(target, gamma + 1),
    "draft_forward_1_ms": forward_ms(draft, 1),
  }
  # name -> (call, units of work per call): a call's time / units is the figure.
  parts = {
    "draft_propose_ms": (lambda: propose(drafter, draft_state), repeats),
    "verify_ms": (lambda: score_verify(target, cache), repeats),
    "ar_ms_per_token": (lambda: ar().tokens, max_new_tokens),
    "spec_ms_per_iteration": (lambda: spec().tokens, iterations),
  }
  timings, _ = bench.time_calls({name: fn for name, (fn, _) in parts.items()}, NUM_RUNS)
  for name, (_, units) in parts.items():
    result[name] = timings[name].median_s * 1e3 / units
  spec_ms = result["spec_ms_per_iteration"]
  result["rest_of_iteration_ms"] = spec_ms - result["draft_propose_ms"] - result["verify_ms"]
  models_ms = result["target_forward_gamma_plus_1_ms"] + draft_calls * result["draft_forward_1_ms"]
  result["overhead_fraction"] = 1 - models_ms / spec_ms
  result["iterations"] = iterations
  result["draft_calls_per_iteration"] = draft_calls
  ar_text = (
    _autoregressive_program.lower(
      target,
      prompts,
      lengths,
      key,
      None,
      sampling=sampling,
      max_new_tokens=max_new_tokens,
      eos_id=None,
      pad_id=0,
      capacity=cache_capacity(prompts.shape[1], max_new_tokens),
    )
    .compile()
    .as_text()
  )
  spec_text = (
    _speculative_program.lower(target, drafter, prompts, lengths, key, config=config)
    .compile()
    .as_text()
  )
  result.update(_kernels(ar_text, spec_text))
  if trace_dir:
    with jax.profiler.trace(trace_dir):
      jax.block_until_ready(spec().tokens)
  return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the output
  result = profile(
    check_positive_int("--gamma", flags.FLAGS.gamma),
    repeats=check_positive_int("--repeats", flags.FLAGS.repeats),
    max_new_tokens=check_positive_int("--max_new_tokens", flags.FLAGS.max_new_tokens),
    temperature=flags.FLAGS.temperature,
    trace_dir=flags.FLAGS.trace_dir,
  )
  print(json.dumps(result, indent=2))
  common.write_json(output_json, result)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  flags.DEFINE_integer(
    "repeats", 100, "Iterations of each part's jitted loop (one timed call; median of 5)."
  )
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated by the timed decoding calls.")
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
  flags.DEFINE_string("trace_dir", None, "Also write a jax.profiler trace here.")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)

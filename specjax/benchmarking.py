"""Wall-clock measurement of generation: the library side of `experiments/benchmark.py`.

Rules shared by every helper here:
  * every timed call ends in `jax.block_until_ready`, so a time covers the device
    work and not just the asynchronous dispatch;
  * one warm-up call (trace + compile + run) precedes the timed runs, and the
    median of the timed runs is reported: robust to a noisy neighbour on a
    shared machine, where the mean is not;
  * the cost of one model call is measured as N calls inside one jitted
    `lax.fori_loop`, divided by N, so the per-call dispatch overhead is
    amortised the way it is inside the real `lax.while_loop`;
  * jitted helpers take the models as pytrees, as the generate functions do.

Axis letters as in `specjax.models.config`: B batch, T tokens per call, P prompt
width, S cache capacity, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from specjax import theory
from specjax.generation import autoregressive_generate, speculative_generate
from specjax.generation.common import prefill
from specjax.models.kv_cache import KVCache, cache_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams
from specjax.validation import check_positive_int


def free_compiled_programs() -> None:
  """Drops every compiled program in JAX's caches and collects the garbage.

  Each XLA:CPU executable keeps memory mappings of its code (300 to 700 for a
  speculative program on the bundled pair), and they go only with the program.
  A process that compiles variant after variant passes the kernel's limit
  (`vm.max_map_count`, 65,530 by default) and dies inside a later compile
  ("Cannot allocate memory", then a segmentation fault). Sweeps call this after
  each variant, once they hold no reference to its programs.

  Only the executables go: traced jaxprs and lowered modules stay cached, so a
  freed program that is called again skips tracing and lowering (about 40% of
  its cost on a CPU; the tests share programs across modules this way) and is
  compiled again, or read back from the persistent compilation cache where one
  is configured. Programs compiled ahead of time that the caller still holds
  (`compile_ahead`) survive. On a JAX whose private caches differ from the
  ones named here, every cache is cleared (`jax.clear_caches`) instead.
  """
  for clear in _executable_cache_clears():
    clear()
  gc.collect()


def _executable_cache_clears() -> list[Callable[[], None]]:
  """The clear functions of JAX's caches that hold compiled executables (jit's
  C++ dispatch caches, `_pjit_lower`'s lowerings, which keep theirs, and
  `_cached_compilation`), or `[jax.clear_caches]`."""
  try:
    from jax._src import pjit
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax

    return [
      pjit._cpp_pjit_cache_fun_only.clear,
      pjit._cpp_pjit_cache_explicit_attributes.clear,
      _jax.PjitFunctionCache.clear_all,
      pjit._pjit_lower.cache_clear,
      pxla._cached_compilation.cache_clear,
    ]
  except (ImportError, AttributeError):
    return [jax.clear_caches]


def compile_ahead(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
  """`fn` compiled now for arguments like `args` and `kwargs`, held outside JAX's caches.

  The executable lives as long as the returned function, through
  `free_compiled_programs`: a sweep's baseline (autoregressive decoding, timed
  next to each variant in turn) compiles once. Every argument, positional or
  keyword, is traced (arrays and pytrees, models included); bind static
  options with `functools.partial` or a closure. Call it with arguments of the
  same shapes, dtypes and pytree structure, passed the same way.
  """
  return jax.jit(fn).lower(*args, **kwargs).compile()


def memory_map_count() -> int | None:
  """Lines of /proc/self/maps: the process's memory mappings (None off Linux)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall times of one function: the warm-up call and the timed runs.

  Attributes:
    first_s: seconds of the first call (trace + compile + one run).
    runs_s: seconds of each timed run after it.
  """

  first_s: float
  runs_s: tuple[float, ...]

  @property
  def median_s(self) -> float:
    return statistics.median(self.runs_s)

  @property
  def compile_s(self) -> float:
    """First call minus a steady call: an estimate of trace + compile time.

    Clamped at 0: with a persistent compilation cache hit the difference is
    noise around zero.
    """
    return max(0.0, self.first_s - self.median_s)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def time_calls(
  fns: Mapping[str, Callable[[], Any]], num_runs: int
) -> tuple[dict[str, Timing], dict[str, Any]]:
  """Times several zero-argument functions, one warm-up call each, then `num_runs` rounds.

  The rounds interleave the functions (a, b, a, b, ...) rather than running
  each back to back, so a slow phase of a shared machine hits all of them
  alike and their ratio stays fair.

  Args:
    fns: name -> function returning a pytree of arrays (blocked on).
    num_runs: timed runs per function, >= 1.

  Returns:
    `(timings, outputs)`: name -> `Timing`, name -> output of the last run.
  """
  check_positive_int("num_runs", num_runs)
  first, outputs = {}, {}
  for name, fn in fns.items():
    first[name], outputs[name] = _timed(fn)
  runs = {name: [] for name in fns}
  for _ in range(num_runs):
    for name, fn in fns.items():
      seconds, outputs[name] = _timed(fn)
      runs[name].append(seconds)
  timings = {name: Timing(first_s=first[name], runs_s=tuple(runs[name])) for name in fns}
  return timings, outputs


@functools.partial(jax.jit, static_argnames=("capacity", "sampling"))
def _prefill_program(model, prompts, prompt_lengths, key, *, capacity, sampling):
  return prefill(model, prompts, prompt_lengths, capacity, key, sampling)


@functools.partial(jax.jit, static_argnames=("num_steps", "tree"))
def _decode_loop(model, tokens, cache: KVCache, *, num_steps: int, tree=None):
  """`num_steps` cached calls on `tokens [B, T]`, each at the same cache length
  (with `tree`, the T tokens are a token tree's block, tree attention)."""
  start = cache.lengths
  layout = None if tree is None else (tree, 0)

  def body(_, carry):
    tokens, cache = carry
    logits, cache = model.forward_cached(tokens, cache, tree=layout)
    # The next tokens depend on the logits, so XLA cannot drop the output head
    # as dead code; rolling the lengths back (as a rejected block is rolled
    # back) keeps every call at the same position and inside the capacity.
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, cache.with_lengths(start)

  return jax.lax.fori_loop(0, num_steps, body, (tokens, cache))


def prefill_timing(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  capacity: int,
  sampling: SamplingParams,
  key: jax.Array,
  num_runs: int,
) -> Timing:
  """Times one jitted `prefill` (time to first token, without the Python wrapper).

  Args:
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    capacity: cache slots S to allocate, as the generate call would.
  """
  run = functools.partial(
    _prefill_program, model, prompts, prompt_lengths, key, capacity=capacity, sampling=sampling
  )
  timings, _ = time_calls({"prefill": run}, num_runs)
  return timings["prefill"]


def call_seconds(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  tokens_per_call: int,
  capacity: int,
  num_steps: int = 16,
  num_runs: int = 3,
  tree: tuple[int, ...] | None = None,
) -> float:
  """Median seconds of one `model.forward_cached` call over `tokens_per_call` tokens.

  The cache is first prefilled with the prompts (so attention reads a realistic
  prefix, and spans the same S slots as in generation); then `num_steps` calls
  run in one jitted `fori_loop`, and the loop's median time is divided by
  `num_steps`. Only the model call is timed: no warp or sampling.

  Args:
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    tokens_per_call: T, 1 for a decode step, gamma + 1 for a verification.
    capacity: cache slots S; needs max(prompt_lengths) + T <= S.
    num_steps: N calls per timed loop.
    tree: None (a chain), or the static parents of a `tokens_per_call`-token
      block scored with tree attention (-1 for the block's root).
  """
  check_positive_int("tokens_per_call", tokens_per_call)
  if tree is not None and len(tree) != tokens_per_call:
    raise ValueError(f"tree must have tokens_per_call={tokens_per_call} entries, got {len(tree)}.")
  check_positive_int("num_steps", num_steps)
  first, cache = jax.block_until_ready(
    _prefill_program(
      model,
      prompts,
      prompt_lengths,
      jax.random.key(0),
      capacity=capacity,
      sampling=SamplingParams(temperature=0.0),
    )
  )
  tokens = jnp.tile(first[:, None], (1, tokens_per_call))
  run = functools.partial(_decode_loop, model, tokens, cache, num_steps=num_steps, tree=tree)
  timings, _ = time_calls({"loop": run}, num_runs)
  return timings["loop"].median_s / num_steps


@functools.partial(jax.jit, static_argnames=("config", "num_steps"))
def _drafting_loop(target, drafter, state, *, config, num_steps: int):
  """`num_steps` x (propose gamma tokens, commit them) from one prefilled state.

  The commit marks every row as stopped, so the drafter's lengths stay where
  they were (constant work per step, never past the capacity), but its state
  is still carried from step to step: otherwise a greedy proposal, which reads
  no key, would be loop-invariant and XLA would hoist it out of the loop.
  """
  from specjax.drafting import Commit

  b, g = state.recent.shape[0], config.gamma
  features = drafter.target_features
  width = (
    0 if features is False else target.cfg.d_model * (1 if features is True else len(features))
  )
  old = state.target_cache.lengths + 1
  stopped = old < 0  # False, but not a constant the compiler could fold away

  def body(i, carry):
    total, drafter_state = carry
    proposal, drafted = drafter.propose(
      drafter_state,
      state.recent,
      jax.random.fold_in(jax.random.key(1), i),
      jnp.full((b,), g, jnp.int32),
      gamma=g,
      sampling=config.sampling,
    )
    # A chain commits g + 1 tokens; a tree its deepest path and one token.
    kept = g if proposal.tree is None else proposal.tree.depth
    emitted = jnp.pad(proposal.tokens[:, :kept], ((0, 0), (0, 1)))
    hidden = None if features is False else jnp.zeros((b, kept + 1, width), jnp.float32)
    path = None if proposal.tree is None else jnp.zeros((b, kept), jnp.int32)
    committed = drafter.commit(drafted, Commit(emitted, old, old + kept + 1, stopped, hidden, path))
    return total + jnp.sum(proposal.tokens), committed

  return jax.lax.fori_loop(0, num_steps, body, (jnp.int32(0), state.drafter_state))[0]


def drafting_seconds(
  target: Transformer,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  num_steps: int = 16,
  num_runs: int = 3,
) -> float:
  """Median seconds a drafter spends per speculative iteration: proposing
  `gamma` tokens for every row and committing a fully accepted block.

  Divided by gamma and by one target decode step (`call_seconds(target, 1)`)
  it is Leviathan's cost ratio c of that drafter. Prompt lookup's is the cost
  of its host-free lookup; a feature drafter's commit includes its head call.
  """
  from specjax.drafting import as_drafter
  from specjax.generation.speculative import init_state
  from specjax.generation.state import SpecConfig

  check_positive_int("gamma", gamma)
  check_positive_int("num_steps", num_steps)
  config = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling)
  drafter = as_drafter(drafter)
  state = jax.jit(init_state, static_argnames="config")(
    target, drafter, prompts, prompt_lengths, jax.random.key(0), config=config
  )
  run = functools.partial(
    _drafting_loop, target, drafter, state, config=config, num_steps=num_steps
  )
  timings, _ = time_calls({"drafting": run}, num_runs)
  return timings["drafting"].median_s / num_steps


def draft_cost(
  target: Transformer,
  draft,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  stats: dict[str, Any],
  num_steps: int = 16,
  num_runs: int = 3,
) -> dict[str, float]:
  """Leviathan's cost ratio c of `draft`, and the verification's cost, in target steps.

  `draft` is a `Transformer` (its one-token step is timed, times the draft
  calls per iteration in `stats`, a speculative run's `stats.summary()`) or any
  other drafter (its whole proposal + commit is timed by `drafting_seconds`:
  prompt lookup's lookup, a head's forward calls). The target's one-token
  step and its `gamma + 1`-token verification are timed by `call_seconds`.

  Returns:
    `target_step_s`, `verify_s`, `draft_call_s` (one draft call, or a
    drafter's proposal + commit per drafted token), `draft_calls_per_iteration`,
    `c` (drafting one token / one target step) and `verify_cost` (verify_s /
    target_step_s).
  """
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)  # as speculative_generate
  step = functools.partial(
    call_seconds,
    prompts=prompts,
    prompt_lengths=prompt_lengths,
    capacity=capacity,
    num_steps=num_steps,
    num_runs=num_runs,
  )
  target_s = step(target, tokens_per_call=1)
  if draft is target:  # a perfect draft: c is 1 by definition
    draft_s, draft_calls = target_s, float(gamma)
  elif isinstance(draft, Transformer):
    draft_s = step(draft, tokens_per_call=1)
    # Less the prefill's draft call, which is not part of an iteration.
    draft_calls = (stats["draft_calls"] - 1) / max(stats["iterations"], 1)
  else:
    draft_s = (
      drafting_seconds(
        target,
        draft,
        prompts,
        prompt_lengths,
        gamma=gamma,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        num_steps=num_steps,
        num_runs=num_runs,
      )
      / gamma
    )
    draft_calls = float(gamma)
  verify_s = step(target, tokens_per_call=gamma + 1)
  return {
    "target_step_s": target_s,
    "verify_s": verify_s,
    "draft_call_s": draft_s,
    "draft_calls_per_iteration": draft_calls,
    "c": 1.0 if draft is target else draft_s * draft_calls / gamma / target_s,
    "verify_cost": verify_s / target_s,
  }


def floor_fields(
  target: Transformer,
  *,
  batch: int,
  ar_step_s: float,
  spec_iteration_s: float,
  verify_call_s: float,
  draft_call_s: float | None,
  draft_calls_per_iteration: float,
  num_runs: int,
) -> dict[str, Any]:
  """How far decoding is from the machine's floor (`specjax.roofline`).

  Args:
    target: the target model (its weights set the floor).
    batch: rows decoded together.
    ar_step_s: seconds of one autoregressive step (all rows, one token each).
    spec_iteration_s: seconds of one speculative iteration.
    verify_call_s: seconds of one target call over gamma + 1 tokens.
    draft_call_s: seconds of one draft model call over 1 token; None when the
      drafter's cost is not a model call of its own (layer skip).
    draft_calls_per_iteration: draft model calls per iteration (0 for prompt lookup).

  Returns:
    `memory_bandwidth_gbs`, `matmul_gflops` (the machine), the target's
    `target_weight_bytes`, `target_bandwidth_floor_ms` (weight bytes at that
    bandwidth), `target_matmul_floor_ms` (its products alone at this batch),
    `ar_over_floor` (an autoregressive step over the matmul floor), and
    `spec_overhead_fraction`: the share of a speculative iteration that is
    neither the drafter's forward calls nor the target's verification call
    (None when the drafter's calls are not measured).
  """
  from specjax import roofline

  machine = roofline.machine_floor(num_runs)
  floor_s = roofline.matmul_floor_seconds(target, batch, num_runs=num_runs)
  weights = roofline.weight_bytes(target)
  out = {
    **machine,
    "target_weight_bytes": weights,
    "target_bandwidth_floor_ms": weights / (machine["memory_bandwidth_gbs"] * 1e9) * 1e3,
    "target_matmul_floor_ms": floor_s * 1e3,
    "ar_step_ms": ar_step_s * 1e3,
    "ar_over_floor": ar_step_s / floor_s,
    "spec_ms_per_iteration": spec_iteration_s * 1e3,
    "target_verify_ms": verify_call_s * 1e3,
    "draft_call_ms": None if draft_call_s is None else draft_call_s * 1e3,
    "draft_calls_per_iteration": draft_calls_per_iteration,
    "spec_overhead_fraction": None,
  }
  if draft_call_s is not None:
    models_s = verify_call_s + draft_calls_per_iteration * draft_call_s
    out["spec_overhead_fraction"] = 1.0 - models_s / spec_iteration_s
  return out


def long_prompt_prefill(
  target: Transformer, draft: Transformer | None, batch: int, width: int = 512, num_runs: int = 3
) -> dict[str, Any]:
  """Time to first token for a long prompt: each model's jitted prefill of `width` tokens.

  Random ids, every row full width; the cache holds exactly the prompt, so the
  models' `max_seq_len` must be >= width (smaller models report None). The
  speculative loop's first token needs the target's prefill; its first
  iteration also needs the draft's.
  """
  out: dict[str, Any] = {"long_prompt_tokens": width}
  for name, model in (("target", target), ("draft", draft)):
    if model is None or model.cfg.max_seq_len < width:
      out[f"{name}_long_prefill_ms"] = None
      continue
    prompts, lengths = random_prompts(jax.random.key(1), batch, width, model.cfg.vocab_size)
    timing = prefill_timing(
      model,
      prompts,
      lengths,
      capacity=width,
      sampling=SamplingParams(temperature=0.0),
      key=jax.random.key(0),
      num_runs=num_runs,
    )
    out[f"{name}_long_prefill_ms"] = timing.median_s * 1e3
  return out


def random_prompts(
  key: jax.Array, batch_size: int, width: int, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
  """Uniform random token ids `[batch_size, width]` int32 and lengths `[batch_size]`.

  Every row is full width, so timings do not depend on padding. For synthetic
  (random-weight) models, where real text would mean nothing.
  """
  check_positive_int("batch_size", batch_size)
  check_positive_int("width", width)
  check_positive_int("vocab_size", vocab_size)
  prompts = jax.random.randint(key, (batch_size, width), 0, vocab_size, dtype=jnp.int32)
  return prompts, jnp.full((batch_size,), width, jnp.int32)


def environment_info() -> dict[str, Any]:
  """Backend, device and library versions, and the UTC date, for a result file."""
  device = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "jax_version": jax.__version__,
    "flax_version": flax.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def benchmark_generation(
  target: Transformer,
  draft: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  key: jax.Array,
  num_runs: int,
  step_timing_steps: int = 16,
  progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Measures autoregressive vs speculative decoding and the costs that predict it.

  Runs without an EOS, so every row generates exactly `max_new_tokens` tokens
  and ms per token is a whole call's time / max_new_tokens.

  Args:
    target, draft: the models; the same object twice benchmarks a perfect draft
      (then c is 1 by definition and is not measured separately).
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    gamma: drafted tokens per iteration.
    max_new_tokens: budget per row.
    sampling: warp shared by both decoders.
    key: PRNG key, the same for every run (runs are then identical).
    num_runs: timed runs of each measurement (after one warm-up call).
    step_timing_steps: N model calls per loop in the per-call cost timings.
    progress: called with a line as each measurement starts (with the seconds
      since the call began); None: quiet.

  Returns:
    A JSON-ready dict; see the keys below. `*_ms` are milliseconds.
  """
  check_positive_int("gamma", gamma)
  check_positive_int("max_new_tokens", max_new_tokens)
  check_positive_int("num_runs", num_runs)
  check_positive_int("step_timing_steps", step_timing_steps)
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)  # as speculative_generate
  generate = {
    "ar": lambda: autoregressive_generate(
      target, prompts, prompt_lengths, max_new_tokens=max_new_tokens, sampling=sampling, key=key
    ),
    "spec": lambda: speculative_generate(
      target,
      draft,
      prompts,
      prompt_lengths,
      gamma=gamma,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=key,
    ),
  }
  start = time.perf_counter()

  def step(text: str) -> None:
    if progress is not None:
      progress(f"{text} ({time.perf_counter() - start:.0f} s)")

  step(f"autoregressive and speculative decoding: compile, then {num_runs} timed runs each")
  timings, outputs = time_calls(generate, num_runs)
  for name, out in outputs.items():
    if not np.all(np.asarray(out.num_generated) == max_new_tokens):
      raise RuntimeError(
        f"{name} generated {np.asarray(out.num_generated).tolist()} "
        f"tokens per row, expected {max_new_tokens} (no EOS is set)."
      )
  ar_ms = timings["ar"].median_s * 1e3 / max_new_tokens
  spec_ms = timings["spec"].median_s * 1e3 / max_new_tokens
  stats = outputs["spec"].stats.summary()
  alpha = stats["acceptance_rate"]

  step("draft and verification costs (c, verify cost ratio)")
  cost = draft_cost(
    target,
    draft,
    prompts,
    prompt_lengths,
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stats=stats,
    num_steps=step_timing_steps,
    num_runs=num_runs,
  )
  target_s, verify_s, draft_s = cost["target_step_s"], cost["verify_s"], cost["draft_call_s"]
  c, verify_cost = cost["c"], cost["verify_cost"]
  predicted = theory.predicted_speedup(alpha, gamma, c, verify_cost=verify_cost)
  speedup = ar_ms / spec_ms

  step("time to first token, the machine's floor, a long prompt's prefill")
  ttft = prefill_timing(
    target,
    prompts,
    prompt_lengths,
    capacity=capacity,
    sampling=sampling,
    key=key,
    num_runs=num_runs,
  )
  prefill_s = ttft.median_s
  floor = floor_fields(
    target,
    batch=prompts.shape[0],
    ar_step_s=(timings["ar"].median_s - prefill_s) / max(max_new_tokens - 1, 1),
    spec_iteration_s=(timings["spec"].median_s - prefill_s) / max(stats["iterations"], 1),
    verify_call_s=verify_s,
    draft_call_s=draft_s,
    draft_calls_per_iteration=cost["draft_calls_per_iteration"],
    num_runs=num_runs,
  )
  long_prefill = long_prompt_prefill(
    target,
    draft if isinstance(draft, Transformer) and draft is not target else None,
    prompts.shape[0],
    num_runs=num_runs,
  )
  greedy_match = None
  if sampling.greedy:  # exactness check for free: both must be the target's greedy output
    greedy_match = bool(
      np.array_equal(np.asarray(outputs["ar"].tokens), np.asarray(outputs["spec"].tokens))
    )
  return {
    "ar_ms_per_token": ar_ms,
    "spec_ms_per_token": spec_ms,
    "speedup": speedup,
    "acceptance_rate": alpha,
    "tokens_per_iteration": stats["tokens_per_iteration"],
    "expected_tokens_per_iteration": theory.expected_tokens_per_iteration(alpha, gamma),
    "target_step_ms": target_s * 1e3,
    "draft_step_ms": draft_s * 1e3,
    "target_verify_ms": verify_s * 1e3,
    "c": c,
    "verify_cost_ratio": verify_cost,
    "predicted_speedup": predicted,
    "measured_over_predicted": speedup / predicted,
    # First generate call (trace + compile + run) minus the median steady call.
    "ar_compile_seconds": timings["ar"].compile_s,
    "spec_compile_seconds": timings["spec"].compile_s,
    "prefill_ms": ttft.median_s * 1e3,
    "greedy_outputs_match": greedy_match,
    **floor,
    **long_prefill,
    "spec_stats": stats,
    "ar_runs_ms": [s * 1e3 for s in timings["ar"].runs_s],
    "spec_runs_ms": [s * 1e3 for s in timings["spec"].runs_s],
  }

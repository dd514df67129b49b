"""Compiling a decode program: how long it takes and how many kernels a step launches.

Both from abstract models (`nnx.eval_shape`), so a 7B-shaped program compiles on
a laptop: `decode_kernels(cfg)` (kernels per layer: unrolled, a 2-layer decode
body minus a 1-layer one; scanned, the layer loop's body) and
`compile_seconds(...)` (JAX's caches bypassed).
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import compiler_options
from specjax.bench import hlo, thunks
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, SamplingParams


def abstract_model(cfg: ModelConfig) -> Transformer:
  """A `Transformer(cfg)` whose parameters are shapes only (nothing allocated)."""
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _shapes(batch: int, prompt_len: int):
  return (
    jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
    jax.ShapeDtypeStruct((batch,), jnp.int32),
  )


def lower_autoregressive(
  model,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  loop: str = "while",
  loop_chunk: int = 8,
  sampling: SamplingParams = GREEDY,
):
  """The jitted program of `autoregressive_generate` for `model` (abstract or
  real), lowered for `[batch, prompt_len]` prompts under `sampling`."""
  from specjax.generation.autoregressive import _autoregressive_program
  from specjax.models.kv_cache import cache_capacity

  prompts, lengths = _shapes(batch, prompt_len)
  return _autoregressive_program.lower(
    model,
    prompts,
    lengths,
    jax.random.key(0),
    None,
    sampling=sampling,
    max_new_tokens=max_new_tokens,
    eos_id=None,
    pad_id=0,
    capacity=cache_capacity(prompt_len, max_new_tokens),
    loop=loop,
    loop_chunk=loop_chunk,
  )


def speculative_config(
  target,
  draft,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  gamma: int,
  loop: str = "while",
  loop_chunk: int = 8,
  sampling: SamplingParams = GREEDY,
):
  """`(drafter, config)`: `speculative_generate`'s checks for `[batch, prompt_len]`
  prompts, as its program takes them. The checks read shapes only, so they run
  on host arrays of that shape (NumPy: nothing is placed on a device, which a
  program lowered for another target's mesh needs)."""
  from specjax.generation.speculative import _checked_run

  return _checked_run(
    target,
    draft,
    np.zeros((batch, prompt_len), np.int32),
    np.full((batch,), prompt_len, np.int32),
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    eos_id=None,
    verifier="auto",
    pad_id=0,
    adaptive=None,
    confidence_threshold=0.5,
    loop=loop,
    loop_chunk=loop_chunk,
  )


def speculative_program(
  target,
  draft,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  gamma: int,
  loop: str = "while",
  loop_chunk: int = 8,
  sampling: SamplingParams = GREEDY,
):
  """`(program, args, kwargs)`: the jitted program of `speculative_generate` (a
  draft model or any drafter) and its arguments for `[batch, prompt_len]`
  prompts, to lower (`lower_speculative`) or export."""
  from specjax.generation.speculative import _speculative_program

  prompts, lengths = _shapes(batch, prompt_len)
  drafter, config = speculative_config(
    target, draft, batch, prompt_len, max_new_tokens, gamma, loop, loop_chunk, sampling
  )
  args = (target, drafter, prompts, lengths, jax.random.key(0))
  # The jax.jit function itself (what jax.export takes), with this backend's options.
  return _speculative_program.jitted(), args, {"config": config}


def lower_speculative(
  target,
  draft,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  gamma: int,
  loop: str = "while",
  loop_chunk: int = 8,
  sampling: SamplingParams = GREEDY,
):
  """The jitted program of `speculative_generate` (a draft model or any
  drafter), lowered like `lower_autoregressive`."""
  program, args, kwargs = speculative_program(
    target, draft, batch, prompt_len, max_new_tokens, gamma, loop, loop_chunk, sampling
  )
  return program.lower(*args, **kwargs)


@contextlib.contextmanager
def no_persistent_cache():
  """Compiles inside really compile: JAX's persistent compilation cache is off."""
  previous = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)


def timed_compile(lower) -> tuple[float, float, object]:
  """`(trace_and_lower_s, compile_s, compiled)` of `lower()` (a function returning
  a `jax.stages.Lowered`), with the persistent cache bypassed."""
  with no_persistent_cache():
    start = time.perf_counter()
    lowered = lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
  return lowered_at - start, done - lowered_at, compiled


def _decode_body(compiled_text: str, nested: bool = False) -> str:
  """The decode loop's body: the while body (holding a loop of its own when
  `nested`: scanned layers) with the most kernels (prefill runs outside it)."""

  counts = hlo.kernel_counts(compiled_text)
  bodies = hlo.while_bodies(compiled_text)
  if nested:
    bodies = [b for b in bodies if _nested_loops(compiled_text, b)]
  return max(bodies, key=lambda b: sum(counts.get(b, {}).values()))


def _nested_loops(text: str, body: str) -> list[str]:
  """The bodies of the while loops inside computation `body`."""
  return [
    name
    for line in hlo.computations(text)[body]
    if (op := hlo._OPCODE.search(line)) and op.group(1) == "while"
    for name in hlo._BODY.findall(line)
  ]


def decode_kernels(
  cfg: ModelConfig, batch: int = 1, prompt_len: int = 16, max_new_tokens: int = 16
) -> dict:
  """Kernels a decode step of autoregressive decoding launches, from compiled HLO.

  Returns:
    `{"kernels_per_layer", "kernels_per_step", "scanned", "top_layer_ops"}`:
    per layer (exact), the whole step of a

    `cfg.n_layers`-deep model (the decode loop body, the layer loop's body
    counted once per layer when scanned), and the layer's five most frequent
    opcodes.
  """
  scanned = cfg.scanned
  if scanned:
    text = (
      lower_autoregressive(abstract_model(cfg), batch, prompt_len, max_new_tokens)
      .compile()
      .as_text()
    )
    counts = hlo.kernel_counts(text)
    outer = _decode_body(text, nested=True)
    inner = _inner_layer_loop(text, outer)
    per_layer = sum(counts[inner].values())
    per_step = sum(counts[outer].values()) - 1 + per_layer * cfg.n_layers
    top = counts[inner]
  else:
    totals, tops = {}, {}
    for depth in (1, 2):
      text = (
        lower_autoregressive(
          abstract_model(cfg.replace(n_layers=depth, local_layers=None)),
          batch,
          prompt_len,
          max_new_tokens,
        )
        .compile()
        .as_text()
      )
      counts = hlo.kernel_counts(text)
      body = _decode_body(text)
      totals[depth], tops[depth] = sum(counts[body].values()), counts[body]
    per_layer = totals[2] - totals[1]
    per_step = totals[1] + per_layer * (cfg.n_layers - 1)
    top = tops[2] - tops[1]
  return dict(
    kernels_per_layer=per_layer,
    kernels_per_step=per_step,
    scanned=scanned,
    top_layer_ops=dict(top.most_common(5)),
  )


def _inner_layer_loop(text: str, outer: str) -> str:
  """The layer loop's body inside the decode loop body `outer`."""
  counts = hlo.kernel_counts(text)
  return max(_nested_loops(text, outer), key=lambda b: sum(counts.get(b, {}).values()))


def compile_seconds(
  target_cfg: ModelConfig,
  draft_cfg: ModelConfig | None = None,
  *,
  batch: int = 1,
  prompt_len: int = 64,
  max_new_tokens: int = 64,
  gamma: int = 4,
) -> dict:
  """Seconds to trace + lower and to compile the AR program of `target_cfg` and
  (with `draft_cfg`) the pair's speculative one: `ar_lower_s`, `ar_compile_s`,
  `spec_lower_s`, `spec_compile_s`."""

  target = abstract_model(target_cfg)
  out = {}
  lower_s, compile_s, _ = timed_compile(
    lambda: lower_autoregressive(target, batch, prompt_len, max_new_tokens)
  )
  out.update(ar_lower_s=lower_s, ar_compile_s=compile_s)
  if draft_cfg is not None:
    draft = abstract_model(draft_cfg)
    lower_s, compile_s, _ = timed_compile(
      lambda: lower_speculative(target, draft, batch, prompt_len, max_new_tokens, gamma)
    )
    out.update(spec_lower_s=lower_s, spec_compile_s=compile_s)
  return out


def _outer_loop(text: str) -> str:
  """The decode loop's body: the while body whose one trip launches the most
  kernels, nested loops included (the generation loop holds the others)."""
  return max(hlo.while_bodies(text), key=lambda b: hlo.launches(text, b)["kernels"])


def _compile_with_thunks(lowered) -> tuple[str, str | None]:
  """`(compiled HLO text, thunk sequence or None)`: on XLA:GPU the program is
  compiled with its dump on, and its thunk sequence read (`bench.thunks`)."""
  with tempfile.TemporaryDirectory() as directory:
    gpu = compiler_options.current_platform() == "gpu"
    compiled = lowered.compile(thunks.dump_options(directory)) if gpu else lowered.compile()
    return compiled.as_text(), thunks.read_dump(directory) if gpu else None


def _loop_launches(lowered) -> tuple[dict, dict]:
  """`(hlo.launches of the generation loop's body, its command buffers)` of a
  lowered program; on XLA:GPU the command buffers as its thunk sequence records
  them (`bench.thunks`), since XLA forms them after the HLO."""
  text, sequence = _compile_with_thunks(lowered)
  body = _outer_loop(text)
  buffers = hlo.command_buffers(text, body)
  if sequence is not None:
    loop = thunks.summary(sequence)
    buffers = dict(buffers, thunks=loop)
    if loop["generation_loop"] is not None:
      buffers["loop_in_command_buffer"] = loop["generation_loop"]["on_device"]
      buffers["body_launches"] = loop["generation_loop"]["host_launches_per_trip"]
  return hlo.launches(text, body), buffers


def step_launches(
  target_cfg: ModelConfig,
  draft_cfg: ModelConfig | None = None,
  *,
  batch: int = 1,
  prompt_len: int = 16,
  max_new_tokens: int = 16,
  gamma: int = 4,
) -> dict:
  """What a plain decode step and (with `draft_cfg`) a speculative iteration
  launch, from the default backend's compiled HLO (after fusion, with
  specjax's compiler options: `specjax.compiler_options`), abstract models.

  Per program, from the target at 1 and 2 layers (the draft as given): one trip
  of the generation loop, nested loops (scanned layers, the draft's calls)
  counted per trip (`hlo.launches`), so `per_layer` is the difference and
  `per_step` the 1-layer count plus `per_layer` for each further layer.

  Returns:
    `{"ar": {...}, "spec": {...}}`, each with `kernels_per_layer`,
    `kernels_per_step` (kernels, wherever they run), `launches_per_layer`,
    `launches_per_step` (what the host launches: a command buffer counts once,
    and a loop recorded in one counts 0 per trip), `unknown_trips` (nested
    loops counted once, their trip count unknown to XLA), and the 2-layer
    program's `command_buffers` (`hlo.command_buffers`: how many, how many
    kernels they hold, whether the loop is one; on GPU read from the thunk
    sequence, `bench.thunks`, since XLA records them after the HLO: then
    `loop_in_command_buffer` and `body_launches` are the thunks' and `thunks`
    holds their summary).
  """
  n = target_cfg.n_layers
  out = {}
  for name in ("ar", "spec") if draft_cfg is not None else ("ar",):
    counts = {}
    for depth in (1, 2):
      target = abstract_model(target_cfg.replace(n_layers=depth, local_layers=None))
      if name == "ar":
        lowered = lower_autoregressive(target, batch, prompt_len, max_new_tokens)
      else:
        draft = abstract_model(draft_cfg)
        lowered = lower_speculative(target, draft, batch, prompt_len, max_new_tokens, gamma)
      counts[depth] = _loop_launches(lowered)
    (one, _), (two, buffers) = counts[1], counts[2]
    per_layer = two["kernels"] - one["kernels"]
    launches_one = counts[1][1]["body_launches"]
    launches_per_layer = buffers["body_launches"] - launches_one
    out[name] = dict(
      kernels_per_layer=per_layer,
      kernels_per_step=one["kernels"] + per_layer * (n - 1),
      launches_per_layer=launches_per_layer,
      launches_per_step=launches_one + launches_per_layer * (n - 1),
      unknown_trips=two["unknown_trips"],
      command_buffers=buffers,
    )
  return out

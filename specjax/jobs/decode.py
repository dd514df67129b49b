"""The main job: decode prompts with speculative and autoregressive decoding,
side by side (`experiments/decode.py`, configured by `configs/decode.py`).

`run(config)` loads the pair, decodes both ways and returns the JSON-ready
result: both continuations and, for the same key, ms/token, speedup, acceptance
rate and tokens per iteration (medians of `config.num_runs` runs after a
warm-up). `decode_and_report` also prints it and writes it to a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

import specjax
import specjax.hf
from specjax import bench, constraints, dtypes, heads, pretrained
from specjax.bench import gamma_choice, masking, verify_costs, warps
from specjax.data.prompts import by_category, encode_prompts, held_out_prompts, read_prompt_file
from specjax.data.tokenizer import Tokenizer
from specjax.distributed import make_mesh, shard_batch, shard_model
from specjax.drafting import CrossTokenizerDrafter, as_drafter
from specjax.generation import verify_length
from specjax.hf.optional import import_torch_transformers
from specjax.jobs import drafters, structured
from specjax.models.kv_cache import cache_capacity
from specjax.results import write_json
from specjax.training import heads as head_training
from specjax.training.checkpoint import check_run
from specjax.validation import check_int, check_loop, check_output_path, check_positive_int
from specjax.vocab_map import build_vocab_map

# float16 is not offered: the transformers comparison
# (`specjax.hf.transformers_baseline`) loads float32 and bfloat16 only.
DECODE_DTYPES = ("float32", "bfloat16")


# A draft with a tokenizer of its own: token-level intersection inside the jitted
# loop, or string-level exact match around it (`specjax.vocab_map`).
CROSS_DRAFTERS = ("cross_tokenizer", "string_level")


def drafter_names() -> tuple[str, ...]:
  """What `config.drafter` may name: `specjax.jobs.drafters`' drafters (the draft
  model, prompt lookup, layer skip, every head kind's) and the cross-tokenizer ones."""
  return (*drafters.OTHER_DRAFTERS, *drafters.head_drafters(), *CROSS_DRAFTERS)


def _load(config: ml_collections.ConfigDict, dtype) -> pretrained.Checkpoints:
  """The models (`pretrained.load_checkpoints`): the bundled pair (with the bundled
  cross draft for the cross-tokenizer drafters) or two HF dirs."""
  need_draft = config.drafter in ("model", *CROSS_DRAFTERS)  # the others draft without one
  if bool(config.draft or (not need_draft and config.target)) != bool(config.target):
    raise ValueError(
      "config.target and config.draft must both name local Hugging Face "
      "checkpoint directories (config.json, *.safetensors, tokenizer.json), "
      "or both be empty for the bundled pair (a head, ngram or layer_skip "
      "drafter needs only config.target)."
    )
  return pretrained.load_checkpoints(
    config.target,
    config.draft,
    dtype=dtype,
    need_draft=need_draft or not config.target,
    own_tokenizer=config.drafter in CROSS_DRAFTERS,
    scale=config.scale or None,
    draft_dtype=(
      dtypes.to_dtype(config.draft_dtype, "config.draft_dtype") if config.draft_dtype else None
    ),
  )


class _FileBatch(NamedTuple):
  """`config.batch_size` rows of one category of `config.prompt_file`: `prompts
  [B, P]` (P the file's widest prompt, so every batch runs the same programs),
  `lengths [B]`; the first `rows` are the category's prompts, the rest repeat
  the last of them."""

  category: str
  prompts: jax.Array
  lengths: jax.Array
  rows: int


def _file_batches(config: ml_collections.ConfigDict, tokenizer: Tokenizer):
  """(texts of the first batch, `_FileBatch`es of `config.prompt_file`, each category's
  prompts in file order, categories in order of first appearance)."""
  prompts = read_prompt_file(config.prompt_file, "config.prompt_file")
  tokens, lengths = map(
    np.asarray, encode_prompts(tokenizer, [p.text for p in prompts], name="config.prompt_file")
  )
  batches, b, groups = [], config.batch_size, by_category(prompts)
  for category, indices in groups.items():
    for start in range(0, len(indices), b):
      rows = indices[start : start + b]
      rows_filled = rows + [rows[-1]] * (b - len(rows))  # the loop's shape; not counted
      batch = (jnp.asarray(tokens[rows_filled]), jnp.asarray(lengths[rows_filled]))
      batches.append(_FileBatch(category, *batch, len(rows)))
  first = [prompts[i].text for i in groups[prompts[0].category][:b]]
  return first + [first[-1]] * (b - len(first)), batches


def _prompt_batch(config: ml_collections.ConfigDict, tokenizer: Tokenizer):
  """(texts, tokens [B, P], lengths [B], file batches): `config.prompt` on every
  row, or when it is empty, `config.prompt_set`'s (`structured.prompts`; by
  default row i holds the i-th held-out test-split prompt), file batches None;
  with `config.prompt_file`, its first batch and every `_FileBatch`."""
  if config.prompt_file:
    texts, batches = _file_batches(config, tokenizer)
    return texts, batches[0].prompts, batches[0].lengths, batches
  texts = (
    [config.prompt] * config.batch_size
    if config.prompt
    else structured.prompts(config.prompt_set, config.constraint, config.batch_size)
    or held_out_prompts(config.batch_size)
  )
  return (texts, *encode_prompts(tokenizer, texts, name="config.prompt"), None)


def _drafter(
  config: ml_collections.ConfigDict, target, draft, draft_tokenizer, tokenizer, draft_path: str
) -> tuple[Any, dict[str, Any]]:
  """The drafter named by `config.drafter` (None for string_level, a host loop), and
  the result's `draft` and `draft_params` for it (`drafter_fields`)."""
  if config.drafter == "cross_tokenizer":
    drafter = CrossTokenizerDrafter(draft, draft_tokenizer, tokenizer)
    return drafter, drafter_fields(config.drafter, draft_path, draft)
  if config.drafter == "string_level":
    return None, drafter_fields(config.drafter, draft_path, draft)
  drafter = drafters.build_drafter(
    config.drafter,
    target,
    draft=draft,
    head=config.head,
    own_target="your own config.target" if config.target else "",
    dtype=dtypes.to_dtype(config.draft_dtype or config.dtype, "config.dtype"),
    vocab_subset=config.vocab_subset,
    ngram=config.ngram,
    layer_skip=config.layer_skip,
  )
  if config.drafter == "ngram":
    what, module = f"prompt lookup of n-grams up to n = {config.ngram}", None
  elif config.drafter == "layer_skip":
    what = f"the target's first {config.layer_skip} of {target.cfg.n_layers} layers"
    module = None
  elif config.drafter == "model":
    what, module = draft_path, draft
  else:
    what, module = drafters.head_dir(config.drafter, config.head), heads.module_of(drafter)
  return drafter, drafter_fields(config.drafter, what, module)


def drafter_fields(kind: str, what: str, module=None) -> dict[str, Any]:
  """The result's `draft` and `draft_params`: the drafter that decoded, not the
  draft model when another drafter (`kind`) was used.

  Args:
    kind: `config.drafter`.
    what: the draft model's checkpoint directory; a head's (the bundled head's
      directory, or its training run); for n-gram lookup and layer skipping,
      what they draft from.
    module: the draft model or head, whose parameters `draft_params` counts;
      None for drafters with no parameters of their own (n-gram lookup, layer
      skipping, which reuse the target's), `draft_params` 0.
  """
  params = 0 if module is None else head_training.num_params(module)
  return {
    "draft": what if kind in ("model", *CROSS_DRAFTERS) else f"{kind}: {what}",
    "draft_params": params,
  }


def _to_host(x) -> np.ndarray:
  """A (possibly multi-host) array as one numpy array on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _floor(config, inputs, drafter, timings, stats, ar_tokens: int) -> dict[str, Any]:
  """The machine's floor, the target's distance from it, the speculative overhead,
  the drafter's cost ratio c with the speedup Leviathan's formula predicts from
  it (`bench.draft_cost`), and compile / long-prompt times (see
  `specjax.bench.floor_fields`)."""
  target, draft, prompts, lengths = inputs.target, inputs.draft, inputs.prompts, inputs.lengths
  capacity = cache_capacity(prompts.shape[1], config.max_new_tokens, config.gamma)
  ttft = bench.prefill_timing(
    target,
    prompts,
    lengths,
    capacity=capacity,
    sampling=specjax.GREEDY,
    key=jax.random.key(0),
    num_runs=config.num_runs,
  ).median_s
  iterations = max(int(stats.iterations), 1)
  steps = max(ar_tokens - 1, 1)  # decode steps after the prefill's token
  cost = bench.draft_cost(
    target,
    draft if config.drafter == "model" else drafter,
    prompts,
    lengths,
    gamma=config.gamma,
    max_new_tokens=config.max_new_tokens,
    sampling=inputs.sampling,
    stats=stats.summary(),
    num_runs=config.num_runs,
  )
  return {
    **bench.floor_fields(
      target,
      batch=config.batch_size,
      ar_step_s=(timings["ar"].median_s - ttft) / steps,
      spec_iteration_s=(timings["spec"].median_s - ttft) / iterations,
      verify_call_s=cost["verify_s"],
      draft_call_s=cost["draft_call_s"],
      draft_calls_per_iteration=cost["draft_calls_per_iteration"],
      num_runs=config.num_runs,
    ),
    # The speedup once the prompt is in: the time to first token (a prefill,
    # the same both ways) left out, as Leviathan's prediction leaves it out.
    "decode_speedup": (timings["ar"].median_s - ttft) / (timings["spec"].median_s - ttft),
    "draft_cost_ratio_c": cost["c"],
    "verify_cost": cost["verify_cost"],
    "predicted_speedup": cost["predicted_speedup"],
    "spec_iterations": iterations,
    "prefill_ms": ttft * 1e3,
    "ar_compile_seconds": timings["ar"].compile_s,
    "spec_compile_seconds": timings["spec"].compile_s,
    **bench.long_prompt_prefill(
      target, draft if config.drafter == "model" else None, 1, num_runs=config.num_runs
    ),
  }


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the first invalid field of `config`."""
  check_positive_int("config.batch_size", config.batch_size)
  check_positive_int("config.num_runs", config.num_runs, 3)
  if config.gamma != 0:
    check_positive_int("config.gamma (0: by batch size)", config.gamma)
  check_int("config.vocab_subset (0: all ids)", config.vocab_subset, minimum=0)
  if config.vocab_subset and config.drafter not in drafters.head_drafters():
    raise ValueError(
      f"config.vocab_subset applies to a draft head's drafter (FR-Spec), not to "
      f"config.drafter={config.drafter!r}; leave it 0."
    )
  drafters.check_drafter_name(config.drafter, allowed=drafter_names())
  if config.head and config.drafter not in drafters.head_drafters():
    raise ValueError(
      f"config.head drafts as its kind's drafter: set config.drafter to one of "
      f"{', '.join(drafters.head_drafters())} (got {config.drafter!r})."
    )
  if config.drafter == "string_level" and config.adaptive:
    raise ValueError("config.adaptive must be '' with config.drafter='string_level'.")
  if config.drafter == "string_level" and config.verify_lengths:
    raise ValueError("config.verify_lengths must be () with config.drafter='string_level'.")
  check_loop(config.loop, config.loop_chunk, "config.")
  if config.drafter == "string_level" and config.loop != "while":
    raise ValueError(
      "config.loop must be 'while' with config.drafter='string_level' (its loop runs on the host)."
    )
  if config.compare_transformers and config.drafter != "model":
    raise ValueError(
      "config.compare_transformers needs config.drafter='model' "
      "(transformers' assisted generation drafts with a model)."
    )
  if config.compare_transformers and config.batch_size != 1:
    raise ValueError(
      "config.batch_size must be 1 with compare_transformers "
      "(transformers' assisted generation supports batch 1 only)."
    )
  if config.dtype not in DECODE_DTYPES:
    raise ValueError(f"config.dtype must be float32 or bfloat16, got {config.dtype!r}.")
  if config.draft_dtype and config.draft_dtype not in DECODE_DTYPES:
    raise ValueError(
      f"config.draft_dtype must be '' (config.dtype) or float32 or bfloat16, "
      f"got {config.draft_dtype!r}."
    )
  if config.scale and config.scale not in pretrained.SCALES:
    raise ValueError(
      f"config.scale must be '' (the bundled pair as trained) or one of "
      f"{', '.join(pretrained.SCALES)}; got {config.scale!r}."
    )
  if config.scale and (config.target or config.draft or config.drafter in CROSS_DRAFTERS):
    raise ValueError(
      "config.scale grows the bundled pair: it takes no config.target / config.draft "
      "and no cross-tokenizer drafter."
    )
  _check_constraint(config)
  _check_prompt_file(config)


def _check_prompt_file(config: ml_collections.ConfigDict) -> None:
  """`config.prompt_file` (read here, so a bad file fails before any model loads)
  and the settings it cannot go with."""
  if not config.prompt_file:
    return
  for field, why in (
    ("prompt", "the prompts are the file's"),
    ("prompt_set", "the prompts are the file's"),
    ("constraint", "its outputs are checked on one batch"),
    ("compare_transformers", "transformers is timed on one prompt"),
  ):
    if config[field]:
      raise ValueError(
        f"config.prompt_file takes no config.{field} ({why}); got {config[field]!r}."
      )
  read_prompt_file(config.prompt_file, "config.prompt_file")


def _check_constraint(config: ml_collections.ConfigDict) -> None:
  """`config.constraint` and `config.prompt_set` (`structured.parse`), and the
  settings a constrained run cannot take."""
  if config.prompt_set not in ("", *structured.PROMPT_SETS):
    raise ValueError(
      f"config.prompt_set must be '' (the constraint's task) or one of "
      f"{', '.join(structured.PROMPT_SETS)}; got {config.prompt_set!r}."
    )
  if structured.parse(config.constraint) is None:
    return
  if config.drafter == "string_level":
    raise ValueError(
      "config.constraint needs a jitted loop: config.drafter='string_level' runs on the host."
    )
  if config.compare_transformers:
    raise ValueError("config.constraint: transformers' generate is not constrained here.")
  if not config.stop_at_eos:
    raise ValueError("config.constraint needs config.stop_at_eos=True (a constrained text ends).")


class _Inputs(NamedTuple):
  """What `run` decodes: the models (sharded on `mesh`), their checkpoint paths,
  the sampling settings, the prompts (`prompts [B, P]`, `lengths [B]`,
  sharded; `prompt` and `ids` are the first row's text and token ids) and the
  rows' constraint (`config.constraint`: its `RowConstraints` and number of
  states; None, 0 without one)."""

  target: Any
  draft: Any
  tokenizer: Tokenizer
  draft_tokenizer: Tokenizer | None
  target_path: str
  draft_path: str
  mesh: jax.sharding.Mesh
  sampling: specjax.SamplingParams
  eos: list[int] | None
  prompt: str
  ids: list[int]
  prompts: jax.Array
  lengths: jax.Array
  rules: constraints.RowConstraints | None
  constraint_states: int
  batches: list[_FileBatch] | None = None  # config.prompt_file's; `prompts` is the first


# The config's warps over the rows' text (`SamplingParams` fields of the same names).
WARPS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def _inputs(config: ml_collections.ConfigDict) -> _Inputs:
  """Loads and shards the models, reads the sampling settings, encodes the prompts."""
  models = _load(config, dtypes.to_dtype(config.dtype, "config.dtype"))
  mesh = make_mesh(tuple(config.mesh_shape))
  if config.batch_size % mesh.shape["data"]:
    raise ValueError(
      f"config.batch_size ({config.batch_size}) must be divisible by the "
      f"mesh's data axis ({mesh.shape['data']})."
    )
  target = shard_model(models.target, mesh)
  draft = models.draft and shard_model(models.draft, mesh, replicate=config.replicate_draft)
  # The target's generation_config.json (else config.json): EOS ids, default sampling.
  settings = specjax.hf.generation_settings(models.target_path)
  if config.checkpoint_sampling:
    sampling = settings.sampling
  else:
    sampling = specjax.SamplingParams(
      temperature=float(config.temperature),
      top_k=config.top_k,
      top_p=float(config.top_p),
      **{name: float(config[name]) for name in WARPS},
    )
  texts, prompts, lengths, batches = _prompt_batch(config, models.tokenizer)
  ids = np.asarray(prompts[0, : lengths[0]]).tolist()
  eos = (list(settings.eos_ids) or None) if config.stop_at_eos else None
  rules, states = None, 0
  constraint = structured.parse(config.constraint)
  if constraint is not None:  # compiled on the host, before any program compiles
    # A constrained text ends with an id the automaton cannot spell: the specials too.
    rules, states, eos = structured.compile_rows(
      constraint, models.tokenizer, eos, models.target.cfg.vocab_size, config.batch_size
    )
    rules = rules.replace(start=shard_batch(rules.start, mesh))
  return _Inputs(
    target,
    draft,
    models.tokenizer,
    models.draft_tokenizer,
    models.target_path,
    models.draft_path,
    mesh,
    sampling,
    eos,
    texts[0],
    ids,
    shard_batch(prompts, mesh),
    shard_batch(lengths, mesh),
    rules,
    states,
    batches,
  )


def _verify_settings(config: ml_collections.ConfigDict, inputs: _Inputs, drafter) -> dict:
  """`speculative_generate`'s verify_lengths and verify_costs: none (off), or the
  config's lengths with its costs, or with none given the costs measured here on
  the batch (`specjax.bench.verify_costs.measure_verify_costs`)."""
  if not config.verify_lengths:
    return {}
  lengths, costs = tuple(config.verify_lengths), tuple(config.verify_costs)
  drafter = as_drafter(drafter or inputs.draft)
  verify_length.check_verify_lengths(lengths, costs or (1.0,) * len(lengths), config.gamma, drafter)
  if not costs:
    costs = verify_costs.measure_verify_costs(
      inputs.target,
      drafter,
      inputs.prompts,
      inputs.lengths,
      gamma=config.gamma,
      lengths=lengths,
      sampling=inputs.sampling,
      key=jax.random.key(config.seed),
    )
  return dict(verify_lengths=lengths, verify_costs=tuple(costs))


def _measures_gamma(config: ml_collections.ConfigDict, drafter) -> bool:
  """Whether a `gamma` of 0 is measured at start-up (`_choose_gamma`): a block drafter's
  chain at batch 1, whose best length depends on the machine."""
  return (
    drafter is not None
    and config.drafter != "string_level"
    and drafters.is_block(drafter)
    and config.batch_size == 1
    and not config.adaptive
  )


def _choose_gamma(config: ml_collections.ConfigDict, inputs: _Inputs, drafter):
  """The block drafter's gamma, measured on this machine with the run's own calls
  (`specjax.bench.gamma_choice`); the chosen program is the one the run then times."""

  def spec(gamma: int):
    at = config.copy_and_resolve_references()
    at.gamma = gamma
    return _calls(at, inputs, drafter, {})["spec"]

  most = as_drafter(drafter).block_size - 1
  with jax.set_mesh(inputs.mesh):
    choice = gamma_choice.choose_gamma(
      spec, _calls(config, inputs, drafter, {})["ar"], gamma_choice.candidate_gammas(most)
    )
  speeds = ", ".join(f"{g}: {choice.plain_ms / ms:.2f}x" for g, ms in choice.ms_per_token.items())
  logging.info("gamma measured at start-up: %d (speedup by gamma %s)", choice.gamma, speeds)
  if choice.plain_wins:
    logging.warning(
      "no gamma beat plain decoding on this machine (best %.2fx at gamma %d)",
      choice.speedup,
      choice.gamma,
    )
  return choice


def _calls(
  config: ml_collections.ConfigDict, inputs: _Inputs, drafter, verify: dict
) -> dict[str, Any]:
  """The timed calls: autoregressive ("ar") and speculative ("spec") decoding
  (`verify`: `_verify_settings`)."""
  i, key = inputs, jax.random.key(config.seed)
  plain = dict(max_new_tokens=config.max_new_tokens, sampling=i.sampling, key=key, eos_id=i.eos)
  # Both loops under the same constraint: the speedup is constrained against constrained.
  loop = dict(loop=config.loop, loop_chunk=config.loop_chunk, constraints=i.rules)
  calls = {
    "ar": lambda: specjax.autoregressive_generate(i.target, i.prompts, i.lengths, **plain, **loop)
  }
  shared = dict(plain, gamma=config.gamma, verifier=config.verifier)
  if config.drafter == "string_level":
    calls["spec"] = lambda: specjax.string_level_generate(
      i.target, i.draft, i.draft_tokenizer, i.tokenizer, i.prompts, i.lengths, **shared
    )
  else:
    calls["spec"] = lambda: specjax.speculative_generate(
      i.target,
      drafter,
      i.prompts,
      i.lengths,
      adaptive=config.adaptive or None,
      confidence_threshold=config.confidence_threshold,
      forced_drafts=config.get("forced_drafts", True),
      **verify,
      **shared,
      **loop,
    )
  return calls


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Loads the pair, decodes the prompt(s) both ways, returns the JSON-ready result."""
  check_config(config)
  if config.compare_transformers:  # before any model loads: one line on how to install them
    import_torch_transformers("--config.compare_transformers")
  if config.head and config.drafter in drafters.head_drafters():  # before any model loads
    head_dir = specjax.hf.resolve_checkpoint(config.head, flag="--config.head")
    if not {"config.json", "model.safetensors"} & set(os.listdir(head_dir)):  # a training run
      check_run(head_dir, "--config.head", kind="head")
  inputs = _inputs(config)
  drafter, draft_fields = _drafter(
    config, inputs.target, inputs.draft, inputs.draft_tokenizer, inputs.tokenizer, inputs.draft_path
  )
  auto_gamma = config.gamma == 0
  probe = None
  if auto_gamma:
    config = config.copy_and_resolve_references()
    config.gamma = (
      max(config.verify_lengths)
      if config.verify_lengths
      else drafters.default_gamma(drafter or inputs.draft, config.batch_size)
    )
    if _measures_gamma(config, drafter):
      probe = _choose_gamma(config, inputs, drafter)
      config.gamma = probe.gamma
  with jax.set_mesh(inputs.mesh):
    verify = _verify_settings(config, inputs, drafter)
    timings, outputs = bench.time_calls(_calls(config, inputs, drafter, verify), config.num_runs)
  host = {
    name: (_to_host(out.tokens), _to_host(out.num_generated)) for name, out in outputs.items()
  }
  texts = {name: inputs.tokenizer.decode(t[0, : n[0]].tolist()) for name, (t, n) in host.items()}
  # The loop runs until its longest row is done.
  ms = {name: timings[name].median_s * 1e3 / int(n.max()) for name, (_, n) in host.items()}
  stats = outputs["spec"].stats
  result = {
    "target": inputs.target_path,
    "scale": config.scale or None,  # the bundled pair grown to this preset's shapes
    "target_params": inputs.target.num_params,
    **draft_fields,  # "draft", "draft_params": the drafter that decoded
    "prompt": inputs.prompt,
    "prompt_tokens": len(inputs.ids),
    "constraint": config.constraint or None,
    "ar_text": texts["ar"],
    "spec_text": texts["spec"],
    "gamma": config.gamma,
    "gamma_policy": (
      "measured at start-up" if probe else "by batch size" if auto_gamma else "fixed"
    ),
    **(probe.report() if probe else {}),
    **_settings_fields(config, inputs),
    "ar_ms_per_token": ms["ar"],
    "spec_ms_per_token": ms["spec"],
    "speedup": ms["ar"] / ms["spec"],
    "acceptance_rate": float(stats.acceptance_rate),
    "tokens_per_iteration": float(stats.tokens_per_iteration),
    # Drafted tokens verified per (row, iteration): gamma unless the verify length is on.
    "verified_per_iteration": float(
      np.sum(_to_host(stats.proposed)) / max(np.sum(_to_host(stats.row_iterations)), 1)
    ),
    # Model calls per iteration, as counted (a block drafter's one call: 1; prompt lookup: 0).
    "draft_calls_per_iteration": (
      float(stats.draft_calls) - as_drafter(drafter or inputs.draft).prefill_calls
    )
    / max(int(stats.iterations), 1),
    **{k: list(v) for k, v in verify.items()},  # verify_lengths, verify_costs (when on)
    **bench.environment_info(),
  }
  if config.drafter in CROSS_DRAFTERS:
    result["vocab_map"] = build_vocab_map(
      inputs.draft_tokenizer,
      inputs.tokenizer,
      inputs.draft.cfg.vocab_size,
      inputs.target.cfg.vocab_size,
    ).report()
  if config.drafter == "string_level":  # where a host loop's time goes
    result["string_level_timings"] = outputs["spec"].timings
  elif config.report_floor:
    result.update(_floor(config, inputs, drafter, timings, stats, int(host["ar"][1].max())))
  if inputs.rules is not None:
    result.update(_constraint_fields(config, inputs, drafter, host, ms["ar"]))
  if inputs.sampling.has_warps:  # one iteration: static, per-row, and with the warps
    result.update(
      warps.warp_cost(
        inputs.target,
        drafter,
        inputs.prompts,
        inputs.lengths,
        inputs.sampling,
        gamma=config.gamma,
        max_new_tokens=config.max_new_tokens,
        eos_id=None if inputs.eos is None else tuple(inputs.eos),
        num_runs=max(config.num_runs, 5),
      )
    )
  if inputs.sampling.greedy:
    result["texts_identical"] = bool(np.array_equal(host["ar"][0], host["spec"][0]))
  if config.compare_transformers:
    result.update(_transformers_fields(config, inputs, ms, host["spec"][0]))
  if inputs.batches:  # every prompt of the file; the floor report is the first batch's
    result.update(_file_fields(config, inputs, drafter, verify, timings, outputs))
  return result


def _file_fields(config, inputs: _Inputs, drafter, verify, timings, outputs) -> dict[str, Any]:
  """`config.prompt_file`'s figures: each batch decoded and timed as `run` times
  one (the first is `timings` and `outputs`), summed per category and overall.

  A category's ms/token is its batches' median times over their decode lengths
  (a batch runs until its longest row is done, as `run` counts); acceptance and
  tokens per iteration sum the counts of its real rows only.
  """
  sums: dict[str, dict[str, float]] = {}
  identical = True
  for i, batch in enumerate(inputs.batches):
    if i:
      rows = inputs._replace(
        prompts=shard_batch(batch.prompts, inputs.mesh),
        lengths=shard_batch(batch.lengths, inputs.mesh),
      )
      with jax.set_mesh(inputs.mesh):
        calls = _calls(config, rows, drafter, verify)
        timings, outputs = bench.time_calls(calls, config.num_runs)
    (ar, ar_n), (spec, spec_n) = (
      (_to_host(outputs[k].tokens), _to_host(outputs[k].num_generated)) for k in ("ar", "spec")
    )
    identical &= bool(np.array_equal(ar[: batch.rows], spec[: batch.rows]))
    stats = outputs["spec"].stats
    counts = {
      field: float(_to_host(getattr(stats, field))[: batch.rows].sum())
      for field in ("accepted", "evaluated", "generated", "row_iterations")
    }
    total = sums.setdefault(batch.category, dict.fromkeys(_FILE_SUMS, 0.0))
    for key, value in (
      ("prompts", batch.rows),
      ("ar_s", timings["ar"].median_s),
      ("spec_s", timings["spec"].median_s),
      ("ar_tokens", int(ar_n.max())),
      ("spec_tokens", int(spec_n.max())),
      *counts.items(),
    ):
      total[key] += value
  overall = {key: sum(total[key] for total in sums.values()) for key in _FILE_SUMS}
  out = {
    **_file_figures(overall),
    "prompt_file": config.prompt_file,
    "num_prompts": int(overall["prompts"]),
    "per_category": {category: _file_figures(total) for category, total in sums.items()},
  }
  out.pop("prompts")
  if inputs.sampling.greedy:
    out["texts_identical"] = identical
  return out


_FILE_SUMS = (
  "prompts",
  "ar_s",
  "spec_s",
  "ar_tokens",
  "spec_tokens",
  "accepted",
  "evaluated",
  "generated",
  "row_iterations",
)


def _file_figures(total: dict[str, float]) -> dict[str, Any]:
  """The result's figures from `_file_fields`' sums over some batches."""
  ar_ms = total["ar_s"] * 1e3 / max(total["ar_tokens"], 1)
  spec_ms = total["spec_s"] * 1e3 / max(total["spec_tokens"], 1)
  return {
    "prompts": int(total["prompts"]),
    "ar_ms_per_token": ar_ms,
    "spec_ms_per_token": spec_ms,
    "speedup": ar_ms / spec_ms,
    "acceptance_rate": total["accepted"] / max(total["evaluated"], 1),
    "tokens_per_iteration": total["generated"] / max(total["row_iterations"], 1),
  }


def _constraint_fields(config, inputs: _Inputs, drafter, host, ar_ms: float) -> dict[str, Any]:
  """What the constraint did: every row's text in both loops, the fraction that
  satisfies the constraint (`structured.satisfies`: a checker other than the
  automaton; a text cut off by the budget fails), and the mask's cost per step
  against the step (`bench.masking.mask_cost`)."""
  constraint = structured.parse(config.constraint)
  texts, valid = {}, []
  for name, (tokens, n) in host.items():
    rows = [structured.text_ids(tokens[b, : n[b]], inputs.eos) for b in range(len(n))]
    texts[name] = [inputs.tokenizer.decode(ids) for ids, _ in rows]
    valid += [
      ended and structured.satisfies(constraint, t) for (_, ended), t in zip(rows, texts[name])
    ]
  with jax.set_mesh(inputs.mesh):
    cost = masking.mask_cost(
      inputs.target,
      drafter,
      inputs.prompts,
      inputs.lengths,
      inputs.rules,
      gamma=config.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=inputs.sampling,
      verifier=config.verifier,
      eos_id=tuple(inputs.eos),
      ar_step_ms=ar_ms,
      num_runs=max(config.num_runs, 5),
    )
  return {
    "constraint": config.constraint,
    "constraint_states": inputs.constraint_states,
    "constraint_checker": structured.checker(constraint),
    "ar_texts": texts["ar"],
    "spec_texts": texts["spec"],
    # Both loops' rows together.
    "valid_fraction": sum(valid) / len(valid),
    **cost,
  }


def _settings_fields(config, inputs: _Inputs) -> dict[str, Any]:
  """The result's decoding settings: temperature, EOS ids, drafter, verifier, ..."""
  return {
    "temperature": float(inputs.sampling.temperature),
    **{name: getattr(inputs.sampling, name) for name in WARPS},
    "eos_ids": inputs.eos,
    "drafter": config.drafter,
    # FR-Spec: the head drafts among this many frequent ids (None: all)
    "vocab_subset": config.vocab_subset or None,
    "verifier": config.verifier,
    "adaptive": config.adaptive or "fixed",
    "loop": config.loop,
    "loop_chunk": config.loop_chunk if config.loop == "chunked" else None,
    "batch_size": config.batch_size,
    "dtype": config.dtype,
    "draft_dtype": config.draft_dtype or config.dtype,
  }


def _transformers_fields(config, inputs: _Inputs, ms, spec_tokens) -> dict[str, Any]:
  """transformers' plain and assisted generation on the same checkpoints and
  prompt (`specjax.hf.transformers_baseline`), against ours (`ms` per token)."""
  from specjax.hf.transformers_baseline import time_transformers

  with tempfile.TemporaryDirectory(prefix="specjax_scaled_") as tmp:
    paths = (inputs.target_path, inputs.draft_path)
    if config.scale:  # the grown models exist only in memory: export the same weights
      paths = _export_pair(inputs, config.dtype, tmp)
    hf = time_transformers(
      *paths,
      inputs.ids,
      gamma=config.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=inputs.sampling,
      dtype=config.dtype,
      num_runs=config.num_runs,
      seed=config.seed,
    )
  out = dict(
    hf_ms_per_token=hf["hf_ms_per_token"],
    hf_assisted_ms_per_token=hf["hf_assisted_ms_per_token"],
    spec_over_hf_assisted=ms["spec"] / hf["hf_assisted_ms_per_token"],
    ar_over_hf=ms["ar"] / hf["hf_ms_per_token"],
  )
  if inputs.sampling.greedy and inputs.eos is None:
    out["hf_assisted_matches_spec"] = hf["hf_assisted_tokens"] == spec_tokens[0].tolist()
  return out


def _export_pair(inputs: _Inputs, dtype: str, directory: str) -> tuple[str, str]:
  """Writes the (grown) target and draft as Llama checkpoints under `directory`
  in `dtype` (`specjax.hf.save_model`): the same weights for transformers."""
  from specjax.hf.export import save_model

  paths = tuple(os.path.join(directory, name) for name in ("target", "draft"))
  for model, path in zip((inputs.target, inputs.draft), paths):
    save_model(model, path, dtype)
  return paths


def decode_and_report(
  config: ml_collections.ConfigDict, output_json: str | None = None
) -> dict[str, Any]:
  """What the decode launcher does once flags are read: decodes, prints, writes
  `output_json`.

  The output path is checked first: the JSON is written only after the whole
  run, too late to learn that the path is unusable.
  """
  output_json = check_output_path("--output_json", output_json)
  result = run(config)
  if jax.process_index() != 0:
    return result  # every process decodes; only the first reports
  print(f"--- prompt ({result['prompt_tokens']} tokens) ---\n{result['prompt']}")
  print(f"--- continuation, autoregressive ---\n{result['ar_text']}")
  print(f"--- continuation, speculative ---\n{result['spec_text']}")
  print(
    f"ms/token ar {result['ar_ms_per_token']:.3f}  spec {result['spec_ms_per_token']:.3f}"
    f"  speedup {result['speedup']:.2f}  acceptance {result['acceptance_rate']:.3f}"
    f"  tokens/iter {result['tokens_per_iteration']:.2f}  gamma {result['gamma']}"
    f"  temperature {result['temperature']}"
  )
  if "verify_lengths" in result:
    costs = ", ".join(f"{c:.2f}" for c in result["verify_costs"])
    print(
      f"verify lengths {tuple(result['verify_lengths'])}  costs ({costs})"
      f"  verified/iter {result['verified_per_iteration']:.2f}"
    )
  for category, f in result.get("per_category", {}).items():  # config.prompt_file
    print(
      f"  {category}: {f['prompts']} prompts  ms/token ar {f['ar_ms_per_token']:.3f}"
      f"  spec {f['spec_ms_per_token']:.3f}  speedup {f['speedup']:.2f}"
      f"  acceptance {f['acceptance_rate']:.3f}  tokens/iter {f['tokens_per_iteration']:.2f}"
    )
  print(json.dumps(result, indent=2))
  write_json(output_json, result)
  return result

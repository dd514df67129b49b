"""Decode text with speculative and autoregressive decoding, side by side.

  python -m experiments.decode                      # the bundled pair, a test-split prompt
  python -m experiments.decode --config.target=/path/to/hf_dir \
      --config.draft=/path/to/hf_dir2 --config.prompt="..." [--output_json=PATH]

Prints the prompt, both continuations and, for the same key: ms/token, speedup,
acceptance rate, tokens per iteration. Times are medians of `num_runs` runs
after a warm-up.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import flags, logging

import specjax
import specjax.hf
from experiments import common
from specjax import bench, dtypes, pretrained, theory
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.data.tokenizer import Tokenizer
from specjax.distributed import launch, make_mesh, shard_batch, shard_model
from specjax.drafting import (
  CrossTokenizerDrafter,
  EagleDrafter,
  EarlyExitDrafter,
  MedusaDrafter,
  NGramDrafter,
  layer_skip,
)
from specjax.hf.optional import import_torch_transformers
from specjax.models.kv_cache import cache_capacity
from specjax.training import heads as head_training
from specjax.training.checkpoint import check_run
from specjax.validation import check_int, check_output_path, check_positive_int
from specjax.vocab_map import build_vocab_map

# float16 is not offered: the transformers comparison
# (`specjax.hf.transformers_baseline`) loads float32 and bfloat16 only.
DECODE_DTYPES = ("float32", "bfloat16")


HEAD_DRAFTERS = {"eagle": EagleDrafter, "medusa": MedusaDrafter, "early_exit": EarlyExitDrafter}
HEAD_KINDS = tuple(HEAD_DRAFTERS)
# A draft with a tokenizer of its own: token-level intersection inside the jitted
# loop, or string-level exact match around it (`specjax.vocab_map`).
CROSS_DRAFTERS = ("cross_tokenizer", "string_level")
DRAFTERS = ("model", "ngram", "layer_skip", *HEAD_KINDS, *CROSS_DRAFTERS)

# Default draft length by batch size (the largest key <= the batch). Scoring
# gamma + 1 tokens per row costs about one step while the target is memory-bound
# (batch 1), but nearly gamma + 1 steps once the batch makes it compute-bound:
# on the 2-core CPU of docs/performance.md the bundled pair at batch 8 gave speedups
# 1.13 / 1.05 / 0.84 at gamma 1 / 2 / 4; at batch 1 the best gamma is 4. Batches
# in between were not measured and keep 4.
DEFAULT_GAMMA = {1: 4, 8: 1}
# Drafters whose draft step costs a large share of a target step draft fewer
# tokens: early exit (2 of 6 target layers + the adapter + the head, c about
# 0.5) gave 1.06x at gamma 1 against 0.72x at gamma 4 (T = 0, batch 1, the
# comparison run in docs/heads.md).
DRAFTER_GAMMA = {"early_exit": 1}


def default_gamma(batch_size: int, drafter: str = "model") -> int:
  """The draft length `config.gamma = 0` means for `batch_size` rows and `drafter`."""
  by_batch = DEFAULT_GAMMA[max(b for b in DEFAULT_GAMMA if b <= batch_size)]
  return min(by_batch, DRAFTER_GAMMA.get(drafter, by_batch))


def _load(config: ml_collections.ConfigDict, dtype):
  """(target, draft, tokenizer, draft_tokenizer, target_path, draft_path): the
  bundled pair (with the bundled cross draft for the cross-tokenizer drafters)
  or two HF dirs."""
  if bool(config.target) != bool(config.draft):
    raise ValueError(
      "config.target and config.draft must both name local Hugging Face "
      "checkpoint directories (config.json, *.safetensors, tokenizer.json), "
      "or both be empty for the bundled pair."
    )
  cross = config.drafter in CROSS_DRAFTERS
  if not config.target:
    target, draft, tokenizer = pretrained.load_pair(dtype)
    if cross:
      draft, draft_tokenizer = pretrained.load_cross_draft(dtype)
      return (
        target,
        draft,
        tokenizer,
        draft_tokenizer,
        pretrained.TARGET_DIR,
        pretrained.CROSS_DRAFT_DIR,
      )
    return target, draft, tokenizer, tokenizer, pretrained.TARGET_DIR, pretrained.DRAFT_DIR
  # Directories or hub repo ids, resolved offline in the local Hugging Face cache.
  target_path = specjax.hf.resolve_checkpoint(config.target, flag="--config.target")
  draft_path = specjax.hf.resolve_checkpoint(config.draft, flag="--config.draft")
  logging.info("pair check:\n%s", specjax.hf.check_pair(target_path, draft_path))
  target, tokenizer = specjax.hf.load_model(target_path, dtype=dtype)
  draft, draft_tokenizer = specjax.hf.load_model(draft_path, dtype=dtype)
  if tokenizer is None:
    raise ValueError(f"{config.target} has no tokenizer.json; text prompts need one.")
  if not cross:
    specjax.hf.check_same_tokenizer(tokenizer, draft_tokenizer, target_path, draft_path)
  elif draft_tokenizer is None:
    raise ValueError(
      f"config.drafter={config.drafter!r} reads the draft's own tokenizer: "
      f"{config.draft} has no tokenizer.json."
    )
  return target, draft, tokenizer, draft_tokenizer, target_path, draft_path


def _prompt_batch(config: ml_collections.ConfigDict, tokenizer: Tokenizer):
  """(texts, tokens [B, P], lengths [B]): `config.prompt` on every row, or when it
  is empty, row i holds the i-th held-out test-split prompt."""
  texts = (
    [config.prompt] * config.batch_size if config.prompt else held_out_prompts(config.batch_size)
  )
  return (texts, *encode_prompts(tokenizer, texts, name="config.prompt"))


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
  if config.drafter in HEAD_KINDS:
    if config.head:
      from specjax.training import load_trained_head

      head, _ = load_trained_head(config.head)
    elif config.target:
      raise ValueError(
        f"config.drafter={config.drafter!r} with your own config.target needs "
        "config.head, the run directory of a head trained for it (the bundled "
        "heads read the bundled target)."
      )
    else:
      head = pretrained.load_head(config.drafter, target)
    drafter = HEAD_DRAFTERS[config.drafter](target, head)
    if config.vocab_subset:
      if config.target:
        raise ValueError(
          "config.vocab_subset ranks the bundled tokenizer's ids; it needs the bundled target."
        )
      drafter = drafter.with_vocab_subset(pretrained.frequent_token_ids(config.vocab_subset))
    where = config.head or os.path.join(pretrained.HEADS_DIR, config.drafter)
    return drafter, drafter_fields(config.drafter, where, head)
  if config.drafter == "ngram":
    drafter = NGramDrafter(target.cfg.vocab_size, max_ngram=config.ngram)
    return drafter, drafter_fields(
      config.drafter, f"prompt lookup of n-grams up to n = {config.ngram}"
    )
  if config.drafter == "layer_skip":
    return layer_skip(target, config.layer_skip), drafter_fields(
      config.drafter, f"the target's first {config.layer_skip} of {target.cfg.n_layers} layers"
    )
  return draft, drafter_fields(config.drafter, draft_path, draft)


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


def _floor(
  config, target, draft, drafter, sampling, prompts, lengths, timings, stats, ar_tokens
) -> dict[str, Any]:
  """The machine's floor, the target's distance from it, the speculative overhead,
  the drafter's cost ratio c with the speedup Leviathan's formula predicts from
  it, and compile / long-prompt times (see `specjax.bench.floor_fields`)."""
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
    sampling=sampling,
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
    "draft_cost_ratio_c": cost["c"],
    "verify_cost": cost["verify_cost"],
    "predicted_speedup": theory.predicted_speedup(
      min(float(stats.acceptance_rate), 1.0), config.gamma, cost["c"], cost["verify_cost"]
    ),
    "spec_iterations": iterations,
    "prefill_ms": ttft * 1e3,
    "ar_compile_seconds": timings["ar"].compile_s,
    "spec_compile_seconds": timings["spec"].compile_s,
    **bench.long_prompt_prefill(
      target, draft if config.drafter == "model" else None, 1, num_runs=config.num_runs
    ),
  }


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Loads the pair, decodes the prompt(s) both ways, returns the JSON-ready result."""
  check_positive_int("config.batch_size", config.batch_size)
  check_positive_int("config.num_runs", config.num_runs, 3)
  if config.gamma != 0:
    check_positive_int("config.gamma (0: by batch size)", config.gamma)
  check_int("config.vocab_subset (0: all ids)", config.vocab_subset, minimum=0)
  if config.drafter not in DRAFTERS:
    raise ValueError(
      f"config.drafter must be one of {', '.join(DRAFTERS)}; got {config.drafter!r}."
    )
  if config.drafter == "string_level" and config.adaptive:
    raise ValueError("config.adaptive must be '' with config.drafter='string_level'.")
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
  if config.compare_transformers:  # before any model loads: one line on how to install them
    import_torch_transformers("--config.compare_transformers")
  dtype = dtypes.to_dtype(config.dtype, "config.dtype")
  if config.head and config.drafter in HEAD_KINDS:
    check_run(config.head, "--config.head", kind="head")
  target, draft, tokenizer, draft_tokenizer, target_path, draft_path = _load(config, dtype)
  mesh = make_mesh(tuple(config.mesh_shape))
  if config.batch_size % mesh.shape["data"]:
    raise ValueError(
      f"config.batch_size ({config.batch_size}) must be divisible by the "
      f"mesh's data axis ({mesh.shape['data']})."
    )
  target = shard_model(target, mesh)
  draft = shard_model(draft, mesh, replicate=config.replicate_draft)
  # The target's generation_config.json (else config.json): EOS ids, default sampling.
  settings = specjax.hf.generation_settings(target_path)
  if config.checkpoint_sampling:
    sampling = settings.sampling
  else:
    sampling = specjax.SamplingParams(
      temperature=float(config.temperature), top_k=config.top_k, top_p=float(config.top_p)
    )
  texts_in, prompts, lengths = _prompt_batch(config, tokenizer)
  ids = np.asarray(prompts[0, : lengths[0]]).tolist()
  prompts, lengths = shard_batch(prompts, mesh), shard_batch(lengths, mesh)
  eos = (list(settings.eos_ids) or None) if config.stop_at_eos else None
  key = jax.random.key(config.seed)
  drafter, draft_fields = _drafter(config, target, draft, draft_tokenizer, tokenizer, draft_path)
  auto_gamma = config.gamma == 0
  if auto_gamma:
    config = config.copy_and_resolve_references()
    config.gamma = default_gamma(config.batch_size, config.drafter)
  calls = {
    "ar": lambda: specjax.autoregressive_generate(
      target,
      prompts,
      lengths,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      key=key,
      eos_id=eos,
    ),
  }
  shared = dict(
    gamma=config.gamma,
    max_new_tokens=config.max_new_tokens,
    sampling=sampling,
    key=key,
    eos_id=eos,
    verifier=config.verifier,
  )
  if config.drafter == "string_level":
    calls["spec"] = lambda: specjax.string_level_generate(
      target, draft, draft_tokenizer, tokenizer, prompts, lengths, **shared
    )
  else:
    calls["spec"] = lambda: specjax.speculative_generate(
      target,
      drafter,
      prompts,
      lengths,
      adaptive=config.adaptive or None,
      confidence_threshold=config.confidence_threshold,
      **shared,
    )
  with jax.set_mesh(mesh):
    timings, outputs = bench.time_calls(calls, config.num_runs)
  texts, ms, host_tokens = {}, {}, {}
  for name, out in outputs.items():
    n = _to_host(out.num_generated)
    host_tokens[name] = _to_host(out.tokens)
    texts[name] = tokenizer.decode(host_tokens[name][0, : n[0]].tolist())
    # The loop runs until its longest row is done.
    ms[name] = timings[name].median_s * 1e3 / int(n.max())
  stats = outputs["spec"].stats
  result = {
    "target": target_path,
    "target_params": target.num_params,
    **draft_fields,  # "draft", "draft_params": the drafter that decoded
    "prompt": texts_in[0],
    "prompt_tokens": len(ids),
    "ar_text": texts["ar"],
    "spec_text": texts["spec"],
    "gamma": config.gamma,
    "gamma_policy": "by batch size" if auto_gamma else "fixed",
    "temperature": float(sampling.temperature),
    "eos_ids": eos,
    "drafter": config.drafter,
    # FR-Spec: the head drafts among this many frequent ids (None: all)
    "vocab_subset": None
    if getattr(drafter, "vocab_subset", None) is None
    else int(drafter.vocab_subset.shape[0]),
    "verifier": config.verifier,
    "adaptive": config.adaptive or "fixed",
    "batch_size": config.batch_size,
    "ar_ms_per_token": ms["ar"],
    "spec_ms_per_token": ms["spec"],
    "speedup": ms["ar"] / ms["spec"],
    "acceptance_rate": float(stats.acceptance_rate),
    "tokens_per_iteration": float(stats.tokens_per_iteration),
    **bench.environment_info(),
  }
  if config.drafter in CROSS_DRAFTERS:
    result["vocab_map"] = build_vocab_map(
      draft_tokenizer, tokenizer, draft.cfg.vocab_size, target.cfg.vocab_size
    ).report()
  if config.drafter == "string_level":  # where a host loop's time goes
    result["string_level_timings"] = outputs["spec"].timings
  elif config.report_floor:
    result.update(
      _floor(
        config,
        target,
        draft,
        drafter,
        sampling,
        prompts,
        lengths,
        timings,
        stats,
        int(_to_host(outputs["ar"].num_generated).max()),
      )
    )
  if sampling.greedy:
    result["texts_identical"] = bool(np.array_equal(host_tokens["ar"], host_tokens["spec"]))
  if config.compare_transformers:
    from specjax.hf.transformers_baseline import time_transformers

    hf = time_transformers(
      target_path,
      draft_path,
      ids,
      gamma=config.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling,
      dtype=config.dtype,
      num_runs=config.num_runs,
      seed=config.seed,
    )
    result.update(
      hf_ms_per_token=hf["hf_ms_per_token"],
      hf_assisted_ms_per_token=hf["hf_assisted_ms_per_token"],
      spec_over_hf_assisted=ms["spec"] / hf["hf_assisted_ms_per_token"],
      ar_over_hf=ms["ar"] / hf["hf_ms_per_token"],
    )
    if sampling.greedy and eos is None:
      result["hf_assisted_matches_spec"] = (
        hf["hf_assisted_tokens"] == host_tokens["spec"][0].tolist()
      )
  return result


def main(argv):
  common.check_no_args(argv)
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the output
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  decode_and_report(flags.FLAGS.config, flags.FLAGS.output_json)


def decode_and_report(
  config: ml_collections.ConfigDict, output_json: str | None = None
) -> dict[str, Any]:
  """What `main` does once flags are read: decodes, prints, writes `output_json`.

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
  print(json.dumps(result, indent=2))
  common.write_json(output_json, result)
  return result


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Decode configuration (configs/decode.py).", "decode.py")
  common.define_output_flags()
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)

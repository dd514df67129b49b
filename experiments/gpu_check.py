"""The prepared accelerator check: decode speed against the memory floor.

  python -m experiments.gpu_check [--scale=full|smoke] [--sections=scoring,trees,decode]
      [--output_json=PATH]

Run once on a lent GPU at --scale=full (the cases are chosen to fit one
device-time budget); sections run in order, most wanted first, and the JSON is
rewritten after each, so a run cut short keeps what it measured (default:
step, scaled):
  step: the decode step at the scaled `1b` and `7b` target shapes (random
     bfloat16 weights, the platform's default layer layout), each with XLA:GPU
     command buffers on and off (`specjax.compiler_options`: on, a generation
     loop is one CUDA graph): from the compiled HLO after fusion, the kernels
     and host launches of a plain decode step and of a speculative iteration
     (the scaled draft, gamma 4), per layer and in total, and whether the loop
     is recorded in a command buffer (`specjax.bench.compile.step_launches`);
     autoregressive ms/token against the measured read floor and the device's
     nominal one; a `jax.profiler` trace of one generation, kept beside the
     JSON (`<output>_traces/`), read back for the device's busy time against
     the wall time and the ten costliest kernels (`specjax.bench.trace`; on a
     CPU there is no device timeline and the summary says so). The JSON is
     written after each row; `--step_shapes=1b` narrows the shapes. Smoke:
     tiny shapes, one row (no command buffers off a GPU);
  scaled: the bundled pair grown to the Llama-2-7B shape (`load_pair(scale="7b")`,
     bfloat16, real acceptance) decoded by the main job at T = 0 and 1 and with
     the grown EAGLE head (`specjax.jobs.decode_table`; smoke: the bundled pair);
  coupling: the coupled verifier (Gumbel-max, drafter-invariant) against the
     token rule at the scaled `1b` shape in bfloat16, with the grown draft and
     EAGLE head, at T = 0.7 and 1 (`configs/decode_table.py:coupling_1b`;
     smoke: the bundled pair, 8 tokens);
  scoring: the 1.1B-shaped target's cost of one call over T = 2..64 positions
     (a chain, and a token tree with tree attention) against one position:
     what a tree's extra nodes cost on memory-bound hardware;
  trees: `specjax.jobs.compare_drafters` with `configs/compare_trees.py` narrowed
     to fit (the bundled pair: chains against trees of 8 and 16 nodes with the
     draft model, EAGLE and Medusa, at T = 0 and 1; real acceptance);
  decode:
  1. measures read bandwidth (a read-only sum of a 2 GiB buffer, `specjax.bench.floor`);
  2. builds a TinyLlama-1.1B-shaped bfloat16 target (d_model 2048, 22 layers,
     32 heads, 4 kv heads, d_ff 5632, vocab 32000) and a 68M-shaped draft
     (d_model 768, 2 layers, 12 heads, d_ff 3072), random weights;
  3. times autoregressive decoding at batch 1 and 8 against the memory floor
     (parameter bytes / bandwidth per decode step), and speculative decoding
     with the 68M draft, with draft = target (alpha = 1 at temperature 0) and
     with an (untrained) EAGLE head on the target: its cost ratio c.
Prints a markdown table and the JSON, and writes the JSON to --output_json
(default: $OUT/gpu_check.json when $OUT is set). `--scale=smoke` shrinks every
size so the script can be checked on a CPU.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
from absl import flags
from flax import nnx

import specjax
from configs import compare_trees
from configs import decode_table as decode_table_config
from experiments import common
from specjax import bench, heads, trees
from specjax.jobs import compare_drafters, decode_table
from specjax.models.kv_cache import cache_capacity
from specjax.results import markdown_table, write_json
from specjax.validation import check_output_path

SIZES = {
  "full": dict(
    target=dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),
    draft=dict(vocab_size=32000, d_model=768, n_layers=2, n_heads=12, n_kv_heads=12, d_ff=3072),
    prompt_len=64,
    max_new_tokens=1 + 25 * 5,
    read_bytes=2 << 30,
    num_runs=3,
  ),
  "smoke": dict(
    target=dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
    draft=dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64),
    prompt_len=8,
    max_new_tokens=1 + 3 * 5,
    read_bytes=8 << 20,
    num_runs=3,
  ),
}
GAMMA = 4
# (batch, draft): the cases that fit the device-time budget. "eagle" is an
# untrained EAGLE head on the target (its cost c matters here; its alpha comes
# from the bundled pair, not from random weights).
CASES = ((1, "68m"), (1, "self"), (8, "68m"), (1, "eagle"))
SECTIONS = ("step", "scaled", "coupling", "scoring", "trees", "decode")
# What one lent GPU runs by default (a few minutes): the step at the scaled
# shapes with command buffers on and off, then the 7b pair's speedups.
DEFAULT_SECTIONS = ("step", "scaled")
# The step section's shapes: the scaled presets' target and draft (random
# bfloat16 weights); smoke: SIZES["smoke"]'s.
STEP_SCALES = {"full": ("1b", "7b"), "smoke": ("",)}
FLOOR_TOLERANCE = 0.97  # the least ar_over_floor a floor allows (timing noise)
STEP_COLUMNS = (
  ("shape", "{shape}"),
  ("layers", "{layout}"),
  ("command buffers", "{command_buffers}"),
  ("loop recorded", "{loop_in_command_buffer}"),
  ("kernels / layer", "{kernels_per_layer}"),
  ("kernels / step", "{kernels_per_step}"),
  ("launches / step", "{launches_per_step}"),
  ("spec kernels / layer", "{spec_kernels_per_layer}"),
  ("spec kernels / iteration", "{spec_kernels_per_iteration}"),
  ("AR ms/token", "{ar_ms_per_token:.3f}"),
  ("AR / floor", "{ar_over_floor:.2f}"),
  (
    "AR / nominal",
    lambda r: "-" if r["ar_over_nominal_floor"] is None else f"{r['ar_over_nominal_floor']:.2f}",
  ),
  ("busy / wall", lambda r: "-" if r["busy_fraction"] is None else f"{r['busy_fraction']:.2f}"),
  ("timeline", "{timeline}"),
)
# Positions scored in one call (scoring section): 1 is the decode step; trees
# (tree attention) at some of them. Each is a compile of the 1.1B shape.
SCORED = {"full": (1, 4, 8, 16, 32, 64), "smoke": (1, 4, 8)}
SCORED_TREES = {"full": (8, 32), "smoke": (8,)}
SCORING_COLUMNS = (
  ("batch", "{batch}"),
  ("positions", "{positions}"),
  ("chain ms", "{chain_ms:.3f}"),
  ("tree ms", lambda row: f"{row['tree_ms']:.3f}" if "tree_ms" in row else "-"),
  ("chain / 1 position", "{chain_cost:.2f}"),
  ("tree / 1 position", lambda row: f"{row['tree_cost']:.2f}" if "tree_cost" in row else "-"),
)
COLUMNS = (
  ("batch", "{batch}"),
  ("draft", "{draft}"),
  ("AR ms/token", "{ar_ms_per_token:.3f}"),
  ("AR / memory floor", "{ar_over_memory_floor:.2f}"),
  ("AR / matmul floor", "{ar_over_matmul_floor:.2f}"),
  ("spec ms/token", "{spec_ms_per_token:.3f}"),
  ("speedup", "{speedup:.2f}"),
  ("α", "{acceptance_rate:.2f}"),
  ("tokens/iter", "{tokens_per_iteration:.2f}"),
  ("c", "{c:.3f}"),
  ("verify cost ratio", "{verify_cost_ratio:.2f}"),
  ("spec overhead", "{spec_overhead_fraction:.2f}"),
)


def build(sizes: dict, max_seq_len: int):
  """(target, draft) with random bfloat16 weights, shaped by `sizes`."""

  def make(fields, seed):
    cfg = specjax.ModelConfig(
      max_seq_len=max_seq_len, dtype="bfloat16", param_dtype="bfloat16", **fields
    )
    return specjax.Transformer(cfg, rngs=nnx.Rngs(seed))

  return make(sizes["target"], 0), make(sizes["draft"], 1)


def scoring_rows(target, sizes: dict, scale: str) -> list[dict]:
  """The target's cost of one call over T positions (a chain, and for some T the
  best tree of T - 1 nodes under a root) against one position, at batch 1."""
  rows = []
  vocab = target.cfg.vocab_size
  for batch in (1,):
    prompts, lengths = bench.random_prompts(
      jax.random.key(batch), batch, sizes["prompt_len"], vocab
    )
    call = functools.partial(
      bench.call_seconds,
      target,
      prompts,
      lengths,
      capacity=sizes["prompt_len"] + max(SCORED[scale]),
      num_runs=3,
    )
    one = call(tokens_per_call=1)
    for t in SCORED[scale]:
      chain_s = call(tokens_per_call=t)
      row = dict(batch=batch, positions=t, chain_ms=chain_s * 1e3, chain_cost=chain_s / one)
      if t in SCORED_TREES[scale]:
        tree = (-1, *(u + 1 for u in trees.best((0.7, 0.2, 0.1), t - 1)))
        tree_s = call(tokens_per_call=t, tree=tree)
        row.update(tree_ms=tree_s * 1e3, tree_cost=tree_s / one)
      rows.append(row)
  return rows


def tree_config(scale: str):
  """`configs/compare_trees.py` cut to fit the device-time budget."""
  config = compare_trees.get_config()
  config.head_gammas = type(config.head_gammas)(dict(eagle=(), medusa=()))
  config.gamma_sweep = ()
  config.trees.sizes = (8, 16) if scale == "full" else (4,)
  # Trees may go deeper than the chains (up to 16 levels, Medusa: its 4 heads):
  # the 2026-11-30 H200 figures in the README were measured so.
  config.trees.max_depth = 16
  config.num_prompts = 2
  config.max_new_tokens = 64 if scale == "full" else 12
  return config


def coupling_config(scale: str):
  """`configs/decode_table.py:coupling_1b` in bfloat16 (smoke: the bundled pair)."""
  config = decode_table_config.get_config("coupling_1b" if scale == "full" else "coupling")
  config.decode.dtype = "bfloat16"
  config.decode.draft_dtype = ""
  if scale != "full":
    config.decode.max_new_tokens = 8
  return config


def scaled_config(scale: str):
  """`configs/decode_table.py` for the scaled section: the 7b pair in bfloat16
  (smoke: the bundled pair, 8 tokens)."""
  config = decode_table_config.get_config()
  config.decode.scale = "7b" if scale == "full" else ""
  config.decode.dtype = "bfloat16"
  config.decode.max_new_tokens = 64 if scale == "full" else 8
  config.decode.report_floor = scale == "full"
  config.rows = (
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.0, drafter="eagle"),
  )
  return config


def step_rows(
  scale: str,
  sizes: dict,
  trace_dir: str,
  progress=lambda rows, detail: None,
  shapes: tuple[str, ...] | None = None,
) -> tuple[list[dict], dict]:
  """The decode step at the scaled shapes (random bfloat16 weights, the
  platform's default layer layout), with command buffers on and off
  (`specjax.compiler_options`; the same programs off a GPU): from the compiled
  HLO the kernels and launches of a plain step and of a speculative iteration
  (`compile_bench.step_launches`), autoregressive ms/token against the measured
  and the nominal memory floor, and a `jax.profiler` trace of one generation
  (`specjax.bench.trace`: busy against wall time, the ten costliest kernels),
  kept under `trace_dir`. Returns `(rows, detail)`: the table's rows and, per
  row, the counts, command buffers and trace summary in full; `progress(rows,
  detail)` is called after each row (the JSON is written then, so a run cut
  short keeps its rows)."""
  from specjax import compiler_options
  from specjax.bench import compile as compile_bench
  from specjax.bench import trace as trace_bench
  from specjax.pretrained import bundled_configs
  from specjax.pretrained.scales import scaled_configs

  floor = bench.read_bandwidth(megabytes=sizes["read_bytes"] >> 20, num_runs=sizes["num_runs"])
  bandwidth, nominal = floor["read_bandwidth_gbs"] * 1e9, floor["nominal_bandwidth_gbs"]
  rows, detail = [], {"floor": floor, "cases": []}
  base = bundled_configs("bfloat16")
  tokens = sizes["max_new_tokens"]
  for shape in STEP_SCALES[scale] if shapes is None else shapes:
    if shape:
      cfg, draft_cfg = scaled_configs(shape, *base, "bfloat16")
    else:
      cfg, draft_cfg = (
        specjax.ModelConfig(
          max_seq_len=base[0].max_seq_len, dtype="bfloat16", param_dtype="bfloat16", **fields
        )
        for fields in (sizes["target"], sizes["draft"])
      )
    model = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
    weights = bench.weight_bytes(model)
    floor_ms = weights / bandwidth * 1e3
    prompts, lengths = bench.random_prompts(
      jax.random.key(0), 1, sizes["prompt_len"], cfg.vocab_size
    )
    run = functools.partial(
      specjax.autoregressive_generate,
      model,
      prompts,
      lengths,
      max_new_tokens=tokens,
      sampling=specjax.GREEDY,
      loop="while",
    )
    # Off a GPU the options change nothing: one row, its command buffers "none".
    on_gpu = jax.default_backend() in compiler_options.GPU_PLATFORMS
    for on in (True, False) if on_gpu else (False,):
      label = ("on" if on else "off") if on_gpu else "none"
      with compiler_options.command_buffers(on):
        # The generation first: where XLA refuses the options, it falls back
        # (one warning) and the counts below are of the programs that ran.
        timings, _ = bench.time_calls({"ar": run}, num_runs=sizes["num_runs"])
        counts = compile_bench.step_launches(cfg, draft_cfg, gamma=GAMMA)
        name = f"{shape or 'smoke'}_command_buffers_{label}"
        profile = trace_bench.trace_call(run, os.path.join(trace_dir, name))
      ms = timings["ar"].median_s * 1e3 / tokens
      ar, spec = counts["ar"], counts["spec"]
      row = dict(
        shape=shape or "smoke",
        layout="scanned" if cfg.scanned else "unrolled",
        command_buffers=label,
        kernels_per_layer=ar["kernels_per_layer"],
        kernels_per_step=ar["kernels_per_step"],
        launches_per_step=ar["launches_per_step"],
        loop_in_command_buffer=ar["command_buffers"]["loop_in_command_buffer"],
        spec_kernels_per_layer=spec["kernels_per_layer"],
        spec_kernels_per_iteration=spec["kernels_per_step"],
        spec_launches_per_iteration=spec["launches_per_step"],
        ar_ms_per_token=ms,
        ar_compile_s=timings["ar"].compile_s,
        floor_ms_per_step=floor_ms,
        ar_over_floor=ms / floor_ms,
        # A floor the step beats is no floor (issue 67: >= 0.97 everywhere).
        floor_holds=ms / floor_ms >= FLOOR_TOLERANCE,
        nominal_floor_ms_per_step=None if nominal is None else weights / (nominal * 1e9) * 1e3,
        ar_over_nominal_floor=None if nominal is None else ms / (weights / (nominal * 1e9) * 1e3),
        busy_fraction=profile.get("busy_fraction"),
        timeline=profile["timeline"],
        graph_launches=profile["graph_launches"],
        options_refused=compiler_options.refused(),
      )
      rows.append(row)
      if not row["floor_holds"]:
        print(f"WARNING: the step reads faster than the floor: ar_over_floor {ms / floor_ms:.2f}")
      detail["cases"].append(
        dict(shape=row["shape"], command_buffers=label, **counts, profile=profile)
      )
      progress(rows, detail)
    del model, run
    bench.free_compiled_programs()
  return rows, detail


def main(argv):
  common.check_no_args(argv)
  # On the lent machine, files under $OUT are what comes back.
  default = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None
  output_json = check_output_path("--output_json", flags.FLAGS.output_json or default)
  # jax.profiler traces (step section) beside the JSON.
  traces = os.path.splitext(output_json or "gpu_check.json")[0] + "_traces"
  sections = [x for x in flags.FLAGS.sections if x]
  if not sections or set(sections) - set(SECTIONS):
    raise ValueError(f"--sections must be a non-empty subset of {SECTIONS}, got {sections}.")
  scale = flags.FLAGS.scale
  sizes = SIZES[scale]
  start = time.perf_counter()
  result = {**bench.environment_info(), "scale": scale, "gamma": GAMMA}

  def save(name, rows, columns):
    result[name] = rows
    result["wall_seconds"] = time.perf_counter() - start
    print(f"## {name} ({result['wall_seconds']:.0f} s)\n" + markdown_table(rows, columns))
    write_json(output_json, result)

  max_seq_len = max(
    cache_capacity(sizes["prompt_len"], sizes["max_new_tokens"], GAMMA),
    sizes["prompt_len"] + max(SCORED[scale]),
  )
  target, draft = build(sizes, max_seq_len)
  for section in SECTIONS:
    if section not in sections:
      continue
    if section == "step":

      def partial(rows, detail):
        result.update(step=rows, step_detail=detail)
        write_json(output_json, result)

      shapes = tuple(flags.FLAGS.step_shapes) if flags.FLAGS.step_shapes else None
      rows, result["step_detail"] = step_rows(scale, sizes, traces, partial, shapes)
      save("step", rows, STEP_COLUMNS)
    elif section == "scaled":
      rows = decode_table.run(scaled_config(scale), progress=True)
      save("scaled", rows, decode_table.COLUMNS)
    elif section == "coupling":
      rows = decode_table.run(coupling_config(scale), progress=True)
      save("coupling", rows, decode_table.COLUMNS)
    elif section == "scoring":
      save("scoring", scoring_rows(target, sizes, scale), SCORING_COLUMNS)
    elif section == "trees":
      rows = compare_drafters.run(tree_config(scale), progress=True)
      save("trees", rows, compare_drafters.COLUMNS)
    else:
      save("cases", decode_rows(target, draft, sizes, result), COLUMNS)
    # The sections share no program (the cases of `decode` share the target's,
    # so they are kept together): free each section's before the next.
    bench.free_compiled_programs()
  print(json.dumps(result, indent=2))


def decode_rows(target, draft, sizes: dict, result: dict) -> list[dict]:
  """Autoregressive and speculative decoding of the 1.1B shape (`CASES`) against
  the memory floor; records the bandwidth and floor in `result`."""
  bandwidth = 1e9 * bench.read_bandwidth_gbs(
    megabytes=sizes["read_bytes"] >> 20, num_runs=sizes["num_runs"]
  )
  floor_ms = bench.weight_bytes(target) / bandwidth * 1e3
  result.update(
    read_bandwidth_gb_s=bandwidth / 1e9,
    target_params=target.num_params,
    draft_params=draft.num_params,
    target_param_bytes=bench.weight_bytes(target),
    memory_floor_ms_per_step=floor_ms,
  )
  print(
    f"{jax.devices()[0].device_kind}: read {bandwidth / 1e9:.0f} GB/s, target "
    f"{target.num_params / 1e6:.0f}M params, floor {floor_ms:.3f} ms/step"
  )
  vocab = sizes["target"]["vocab_size"]
  head = heads.make_head(heads.config("eagle", target.cfg), rngs=nnx.Rngs(2))
  eagle = heads.drafter(target, head)
  drafts = {"68m": draft, "self": target, "eagle": eagle}
  rows = []
  for batch, which in CASES:
    prompts, lengths = bench.random_prompts(
      jax.random.key(batch), batch, sizes["prompt_len"], vocab
    )
    case = bench.benchmark_generation(
      target,
      drafts[which],
      prompts,
      lengths,
      gamma=GAMMA,
      max_new_tokens=sizes["max_new_tokens"],
      sampling=specjax.GREEDY,
      key=jax.random.key(0),
      num_runs=sizes["num_runs"],
      step_timing_steps=8,
    )
    case = {k: v for k, v in case.items() if not k.endswith("_runs_ms")}
    case.update(
      batch=batch,
      draft=which,
      # The memory floor at this read bandwidth (`ar_over_floor` from
      # benchmark_generation measures its own, smaller read).
      ar_over_memory_floor=case["ar_ms_per_token"] / floor_ms,
      target_step_over_memory_floor=case["target_step_ms"] / floor_ms,
    )
    rows.append(case)
  return rows


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_enum(
    "scale", "full", ["full", "smoke"], "full: 1.1B target (GPU); smoke: tiny sizes (CPU check)."
  )
  flags.DEFINE_list(
    "sections",
    list(DEFAULT_SECTIONS),
    f"Sections to run, in this order: {SECTIONS} (default {DEFAULT_SECTIONS}).",
  )
  flags.DEFINE_list(
    "step_shapes",
    None,
    f"The step section's scaled shapes (default: {STEP_SCALES['full']} at --scale=full).",
  )
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)

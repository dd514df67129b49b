"""The prepared accelerator check: decode speed against the memory floor.

  python -m experiments.gpu_check [--scale=full|smoke] [--output_json=PATH]

Run once on a lent GPU (about 5 minutes on an H200 at --scale=full):
  1. measures copy bandwidth (read + write of a 2 GiB buffer);
  2. builds a TinyLlama-1.1B-shaped bfloat16 target (d_model 2048, 22 layers,
     32 heads, 4 kv heads, d_ff 5632, vocab 32000) and a 68M-shaped draft
     (d_model 768, 2 layers, 12 heads, d_ff 3072), random weights;
  3. times autoregressive decoding at batch 1 and 8 against the memory floor
     (parameter bytes / bandwidth per decode step), and speculative decoding
     with the 68M draft and with draft = target (alpha = 1 at temperature 0).
Prints a short table and the JSON. `--scale=smoke` shrinks every size so the
script can be checked on a CPU.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

import specjax
from specjax import benchmarking


SIZES = {
    "full": dict(
        target=dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                    d_ff=5632),
        draft=dict(vocab_size=32000, d_model=768, n_layers=2, n_heads=12, n_kv_heads=12,
                   d_ff=3072),
        prompt_len=64, max_new_tokens=1 + 25 * 5, copy_bytes=2 << 30, num_runs=3),
    "smoke": dict(
        target=dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    d_ff=128),
        draft=dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                   d_ff=64),
        prompt_len=8, max_new_tokens=1 + 3 * 5, copy_bytes=8 << 20, num_runs=3),
}
GAMMA = 4
# (batch, draft): the cases that fit the device-time budget.
CASES = ((1, "68m"), (1, "self"), (8, "68m"))


def copy_bandwidth(num_bytes: int, num_runs: int) -> float:
  """Bytes per second of a jitted elementwise pass (reads and writes num_bytes each)."""
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  double = jax.jit(lambda a: a * 2)
  timings, _ = benchmarking.time_calls({"copy": lambda: double(x)}, num_runs)
  return 2 * num_bytes / timings["copy"].median_s


def build(sizes: dict, max_seq_len: int):
  def make(fields, seed):
    cfg = specjax.ModelConfig(max_seq_len=max_seq_len, dtype="bfloat16",
                              param_dtype="bfloat16", **fields)
    return specjax.Transformer(cfg, rngs=nnx.Rngs(seed))
  return make(sizes["target"], 0), make(sizes["draft"], 1)


def param_bytes(model: specjax.Transformer) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(argv):
  del argv
  sizes = SIZES[flags.FLAGS.scale]
  start = time.perf_counter()
  bandwidth = copy_bandwidth(sizes["copy_bytes"], sizes["num_runs"])
  max_seq_len = sizes["prompt_len"] + sizes["max_new_tokens"] + GAMMA + 1
  target, draft = build(sizes, max_seq_len)
  floor_ms = param_bytes(target) / bandwidth * 1e3
  result = {**benchmarking.environment_info(), "scale": flags.FLAGS.scale,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "target_params": target.num_params,
            "draft_params": draft.num_params, "target_param_bytes": param_bytes(target),
            "memory_floor_ms_per_step": floor_ms, "gamma": GAMMA, "cases": []}
  vocab = sizes["target"]["vocab_size"]
  for batch, which in CASES:
    prompts = jax.random.randint(jax.random.key(batch), (batch, sizes["prompt_len"]), 0,
                                 vocab, jnp.int32)
    lengths = jnp.full((batch,), sizes["prompt_len"], jnp.int32)
    case = benchmarking.benchmark_generation(
        target, target if which == "self" else draft, prompts, lengths, gamma=GAMMA,
        max_new_tokens=sizes["max_new_tokens"], sampling=specjax.GREEDY,
        key=jax.random.key(0), num_runs=sizes["num_runs"], step_timing_steps=8)
    case = {k: v for k, v in case.items() if not k.endswith("_runs_ms")}
    case.update(batch=batch, draft=which,
                ar_over_floor=case["ar_ms_per_token"] / floor_ms,
                target_step_over_floor=case["target_step_ms"] / floor_ms)
    result["cases"].append(case)
  result["wall_seconds"] = time.perf_counter() - start

  print(f"{jax.devices()[0].device_kind}: copy {bandwidth / 1e9:.0f} GB/s, target "
        f"{target.num_params / 1e6:.0f}M params, floor {floor_ms:.3f} ms/step")
  print("batch draft  ar_ms  floor_x  spec_ms  speedup  alpha  tok/it  c      verify_x")
  for c in result["cases"]:
    print(f"{c['batch']:5d} {c['draft']:5s} {c['ar_ms_per_token']:6.3f} "
          f"{c['ar_over_floor']:7.2f} {c['spec_ms_per_token']:8.3f} {c['speedup']:7.2f} "
          f"{c['acceptance_rate']:6.2f} {c['tokens_per_iteration']:6.2f} "
          f"{c['c']:6.3f} {c['verify_cost_ratio']:6.2f}")
  text = json.dumps(result, indent=2)
  print(text)
  path = flags.FLAGS.output_json or (os.path.join(os.environ["OUT"], "gpu_check.json")
                                if os.environ.get("OUT") else None)
  if path:
    with open(path, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  flags.DEFINE_enum("scale", "full", ["full", "smoke"],
                    "full: 1.1B target (GPU); smoke: tiny sizes (CPU check).")
  flags.DEFINE_string("output_json", None, "Also write the JSON here.")
  app.run(main)

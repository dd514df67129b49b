"""The floor measurements and the kernel counter measure what they say they measure."""

import jax
import jax.numpy as jnp
from flax import nnx

import specjax
from specjax import bench
from specjax.bench import floor


def test_weight_bytes_count_every_parameter(target):
  assert bench.weight_bytes(target) == 4 * target.num_params  # float32


def test_matmul_skeleton_does_the_models_products(target, monkeypatch):
  """Its FLOPs per step are the model's projections and head, 2 * N * (weights in
  matrices), within the small extra of the residual adds. (XLA's dots: XLA's cost
  analysis does not see into the CPU kernel's custom calls.)"""
  monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
  layers, head = floor._kernels(target)
  n = 3
  x = jnp.ones((n, target.cfg.d_model))
  tied = target.cfg.tie_embeddings
  compiled = floor._matmul_skeleton.lower(layers, head, x, num_steps=1, tied=tied).compile()
  flops = compiled.cost_analysis()["flops"]
  matrix_weights = sum(w.size for mats in layers for w in mats.values()) + head.size
  assert 2 * n * matrix_weights <= flops <= 1.1 * 2 * n * matrix_weights
  assert len(layers) == target.cfg.n_layers and len(layers[0]) == 4  # qkv o gate_up down


def test_floor_measurements_are_positive():
  # Small sizes; machine_floor at its own sizes runs in every floor report (the
  # decode step of test_launchers.py, test_benchmark.py), which check its fields.
  assert bench.read_bandwidth_gbs(megabytes=8, num_runs=1) > 0
  assert bench.matmul_gflops(n=128, num_runs=1) > 0


def test_kernel_counts_see_loop_bodies_and_skip_free_ops():
  @jax.jit
  def f(x):
    def body(carry):
      i, x = carry
      return i + 1, jnp.tanh(x @ x) + 1.0

    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

  text = f.lower(jnp.ones((8, 8))).compile().as_text()
  loops = bench.loop_kernels(text)
  assert len(loops) == 1
  counts = bench.kernel_counts(text)[loops[0]["body"]]
  assert counts["dot"] + counts["fusion"] >= 1  # the product, fused or not
  assert not {"parameter", "constant", "tuple", "get-tuple-element"} & set(counts)


def test_greedy_iteration_draws_no_random_bits(target, draft):
  """At temperature 0 the speculative loop body calls no random-bit computation:
  no nested while loop but the drafter's own."""
  from specjax.generation.speculative import _speculative_program

  config = specjax.SpecConfig(gamma=3, max_new_tokens=8, sampling=specjax.GREEDY, verifier="greedy")
  prompts, lengths = jnp.ones((1, 4), jnp.int32), jnp.array([4])
  text = (
    _speculative_program.lower(
      target, specjax.drafting.as_drafter(draft), prompts, lengths, jax.random.key(0), config=config
    )
    .compile()
    .as_text()
  )
  counts = bench.kernel_counts(text)
  outer = [counts[body] for body in bench.while_bodies(text) if counts[body]["while"]]
  # The generation loop holds exactly one loop (the drafter's) and calls nothing
  # (random bits on CPU are a called loop).
  assert len(outer) == 1 and outer[0]["while"] == 1 and outer[0]["call"] == 0, outer


def test_no_decode_step_reads_faster_than_the_floor():
  """The floor is a floor: the matrix products of one decode step (a subset of
  its work) of a model whose 270 MB of weights dwarf the caches take at least
  the weights' bytes over the read bandwidth, within the timing noise. (The
  copy-loop floor measured before read at about half this bandwidth, so steps
  came out at 0.7 of it.)"""
  cfg = specjax.ModelConfig(
    vocab_size=512, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=4096, max_seq_len=64
  )
  model = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  bandwidth = bench.read_bandwidth_gbs(megabytes=512, num_runs=3) * 1e9
  step_s = bench.matmul_floor_seconds(model, batch=1, num_steps=8, num_runs=3)
  ratio = step_s / (bench.weight_bytes(model) / bandwidth)
  assert ratio >= 0.85, ratio  # 15%: the spread of back-to-back measurements here

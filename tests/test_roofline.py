"""The floor measurements and the kernel counter measure what they say they measure."""

import jax
import jax.numpy as jnp
import pytest
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


def test_nominal_bandwidth_by_device_kind():
  assert floor.nominal_bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350
  assert floor.nominal_bandwidth_gbs("NVIDIA H100 PCIe") == 2000
  assert floor.nominal_bandwidth_gbs("NVIDIA H200") == 4800
  assert floor.nominal_bandwidth_gbs("NVIDIA GH200 480GB") == 4000
  assert floor.nominal_bandwidth_gbs("NVIDIA A100-SXM4-80GB") == 2039
  assert floor.nominal_bandwidth_gbs("NVIDIA A100-SXM4-40GB") == 1555
  assert floor.nominal_bandwidth_gbs("TPU v5 lite") == 819
  assert floor.nominal_bandwidth_gbs("cpu") is None
  assert floor.nominal_bandwidth_gbs() is None  # this CPU


def test_read_bandwidth_is_the_best_of_its_readers():
  read = bench.read_bandwidth(megabytes=16, num_runs=1)
  methods = read["read_methods"]
  assert {"numpy", "xla_reduce"} <= set(methods)
  from specjax.kernels import cpu_matmul

  for lib in cpu_matmul.candidates():  # the kernel's own streaming read, each build
    assert methods[f"kernel_{lib.variant}_float32"] > 0, read["read_method_errors"]
    assert methods[f"kernel_{lib.variant}_bfloat16"] > 0, read["read_method_errors"]
  measured = {k: v for k, v in methods.items() if v is not None}
  assert read["read_bandwidth_gbs"] == max(measured.values()) == methods[read["read_method"]]
  assert read["nominal_bandwidth_gbs"] is None and read["device_kind"] == "cpu"


def test_a_reader_faster_than_the_nominal_bandwidth_is_dropped(monkeypatch):
  monkeypatch.setattr(floor, "nominal_bandwidth_gbs", lambda kind=None: 1e-6)
  with pytest.raises(RuntimeError, match="past the nominal"):
    bench.read_bandwidth(megabytes=4, num_runs=1)


def test_the_accelerator_readers_run_and_count_their_bytes():
  """The GPU's readers (a copy, row sums, one sum), run here on the CPU: each
  moves the bytes it claims."""
  nbytes = 4 * 8192 * 16
  readers = dict(floor._device_readers(nbytes))
  assert set(readers) == {"copy", "reduce_rows", "reduce"}
  for name, make in readers.items():
    fn, moved = make()
    jax.block_until_ready(fn())
    assert moved == (2 if name == "copy" else 1) * nbytes, name


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
  its work, through the same kernel) of a model whose 270 MB of weights dwarf
  the caches take at least the weights' bytes over the read bandwidth, within
  3% (issue 67's bar, `ar_over_floor` >= 0.97). Twice the floor failed it: a
  copy loop read at about half this bandwidth (steps at 0.7 of it), and numpy's
  and XLA's sums alone read slower than the kernel's own stream on an AVX2 Zen 3
  (steps at 0.85); `read_bandwidth` now takes the best of them and the kernel."""
  cfg = specjax.ModelConfig(
    vocab_size=512, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=4096, max_seq_len=64
  )
  model = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  read = bench.read_bandwidth(megabytes=512, num_runs=3)
  step_s = bench.matmul_floor_seconds(model, batch=1, num_steps=8, num_runs=3)
  ratio = step_s / (bench.weight_bytes(model) / (read["read_bandwidth_gbs"] * 1e9))
  assert ratio >= 0.97, (ratio, read["read_methods"])

"""The same programs on meshes 8x1, 2x4 and 1x8 give one device's results."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import specjax
from helpers import TINY, tiny_pair
from specjax import distributed as dist
from specjax.models.fused import gate_up_parts


def test_eight_devices():
  assert jax.device_count() == 8


@pytest.fixture(scope="module")
def models():
  return tiny_pair()


@pytest.fixture(scope="module")
def batch():
  prompts = jax.random.randint(jax.random.key(42), (8, 9), 0, 512, dtype=jnp.int32)
  return prompts, jnp.array([9, 2, 6, 1, 9, 3, 4, 5], jnp.int32)


SAMPLED = specjax.SamplingParams(temperature=1.0, top_p=0.95)


PROGRAMS = ("spec_greedy", "spec_sampled", "ar_sampled")


def _generate(target, draft, prompts, lengths, programs=PROGRAMS):
  kw = dict(max_new_tokens=12)
  calls = {
    "spec_greedy": lambda: specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=3, sampling=specjax.GREEDY, **kw
    ),
    "spec_sampled": lambda: specjax.speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      gamma=3,
      sampling=SAMPLED,
      key=jax.random.key(7),
      verifier="block",
      **kw,
    ),
    "ar_sampled": lambda: specjax.autoregressive_generate(
      target, prompts, lengths, sampling=SAMPLED, key=jax.random.key(7), **kw
    ),
  }
  return {name: calls[name]().tokens for name in programs}


@pytest.fixture(scope="module")
def single(models, batch):
  return {k: np.asarray(v) for k, v in _generate(*models, *batch).items()}


# Every mesh and both draft placements, each program on at least one mesh, without
# every combination (each is a compiled program: CI time).
@pytest.mark.parametrize(
  "shape, replicate_draft, programs",
  [((8, 1), True, ("spec_greedy",)), ((2, 4), False, PROGRAMS), ((1, 8), False, ("spec_sampled",))],
)
def test_generation_matches_one_device(models, batch, single, shape, replicate_draft, programs):
  target, draft = models
  mesh = dist.make_mesh(shape)
  sharded_target = dist.shard_model(target, mesh)
  sharded_draft = dist.shard_model(draft, mesh, replicate=replicate_draft)
  qkv = sharded_target.layers[0].attn.qkv_proj.kernel.get_value()
  assert qkv.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "model")), 2)
  with jax.set_mesh(mesh):
    out = _generate(
      sharded_target,
      sharded_draft,
      dist.shard_batch(batch[0], mesh),
      dist.shard_batch(batch[1], mesh),
      programs,
    )
  for name, tokens in out.items():
    np.testing.assert_array_equal(np.asarray(tokens), single[name], err_msg=name)
  if shape[0] > 1:
    for tokens in out.values():
      assert tokens.sharding.spec[0] == "data"  # rows stayed data-parallel


def test_cache_is_sharded_over_batch_and_kv_heads():
  mesh = dist.make_mesh((2, 4))
  cfg = specjax.ModelConfig(**{**TINY, "n_kv_heads": 4})
  with jax.set_mesh(mesh):
    cache = jax.jit(
      lambda: specjax.KVCache.zeros(
        n_layers=1, batch=8, capacity=16, n_kv_heads=cfg.n_kv_heads, head_dim=16, dtype=jnp.float32
      )
    )()
  expected = NamedSharding(mesh, PartitionSpec("data", "model", None, None))
  assert cache.k[0].sharding.is_equivalent_to(expected, 4)
  assert cache.k[0].addressable_shards[0].data.shape == (4, 1, 16, 16)


def _train_config(tmp_path, shape, devices=0, steps=2):
  import shutil

  from configs import train_tiny
  from specjax.data import corpus_files, stdlib_root

  root = tmp_path / "stdlib"
  if not root.exists():
    for split, count in {"train": 12, "validation": 2, "test": 2}.items():
      for path in corpus_files(split)[:count]:
        dest = root / os.path.relpath(path, stdlib_root())
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
  c = train_tiny.get_config()
  c.data.root, c.data.dir = str(root), str(tmp_path / "data")
  c.update(
    mesh_shape=shape,
    mesh_devices=devices,
    batch_size=8,
    num_steps=steps,
    eval_every=steps,
    checkpoint_every=2,
    warmup_steps=0,
  )
  return c


def test_train_step_matches_one_device(tmp_path):
  from specjax.training import load_trained_model, train

  runs = {}
  trained = ((2, 4),)  # both axes at once
  for shape, devices in (((1, 1), 1), *((shape, 0) for shape in trained)):
    workdir = str(tmp_path / f"run_{shape[0]}x{shape[1]}")
    history = train(_train_config(tmp_path, shape, devices), workdir, echo=lambda _: None)
    model, _ = load_trained_model(workdir)
    runs[shape] = ([r["loss"] for r in history], nnx.state(model, nnx.Param))
  ref_losses, ref_params = runs[(1, 1)]
  for shape in trained:
    losses, params = runs[shape]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_checkpoint_saved_on_2x4_restores_on_1x8(tmp_path):
  from specjax.training import Checkpointer, train
  from specjax.training.checkpoint import abstract_model, load_model_config

  workdir = str(tmp_path / "run")
  train(_train_config(tmp_path, (2, 4)), workdir, echo=lambda _: None)
  saved = Checkpointer(workdir, create=False)
  # Reference values, restored unsharded.
  cfg = load_model_config(workdir)
  _, abstract = abstract_model(cfg)
  plain = saved.restore(2, abstract)["params"]
  mesh = dist.make_mesh((1, 8))
  shardings = dist.param_shardings(specjax.Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  target = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  restored = saved.restore(2, target)["params"]
  saved.close()
  qkv = restored["layers"][0]["attn"]["qkv_proj"]["kernel"].get_value()
  assert qkv.sharding.mesh.shape == {"data": 1, "model": 8}
  assert qkv.addressable_shards[0].data.shape == (qkv.shape[0], qkv.shape[1] // 8)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_loader_places_each_tensor_in_its_sharding(tmp_path):
  from specjax.hf import load_model
  from specjax.hf.export import save_model

  cfg = specjax.ModelConfig(**TINY)
  model = specjax.Transformer(cfg, rngs=nnx.Rngs(3))
  save_model(model, str(tmp_path / "hf"), dtype="float32")
  mesh = dist.make_mesh((2, 4))
  loaded, _ = load_model(str(tmp_path / "hf"), dtype=jnp.float32, mesh=mesh)
  gate_up = loaded.layers[1].mlp.gate_up_proj.kernel.get_value()
  assert gate_up.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "model")), 2)
  assert gate_up.addressable_shards[0].data.shape == (64, 2 * 128 // 4)
  # Interleaved gate/up columns: each device holds the gate and up of whole hidden units.
  gate = gate_up_parts(128)[0].take(np.asarray(gate_up))
  for shard in gate_up.addressable_shards:
    cols = shard.index[1]
    local = gate_up_parts(shard.data.shape[1] // 2)[0].take(np.asarray(shard.data))
    np.testing.assert_array_equal(local, gate[:, cols.start // 2 : cols.stop // 2])
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(model(tokens)), atol=1e-5)

"""The training programs, lowered: one optimizer step of a head, or of the target itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.aot import place
from specjax.aot.models import TRAIN_KIND, Models

# --------------------------------------------------------------------- training


def train_config(kind: str = TRAIN_KIND):
  """The head-training config of `kind`: the repository's `configs/train_<kind>.py`
  where this is a source checkout, else `head_base_config(kind)`."""
  import importlib.util
  import os

  from specjax.training.config import head_base_config

  path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"train_{kind}.py")
  if not os.path.exists(path):
    return head_base_config(kind)
  spec = importlib.util.spec_from_file_location(f"_train_{kind}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _optimizer_state(optimizer, params, mesh: Mesh):
  """`optimizer.init(params)` as shapes, placed as a real run's: each moment where
  its parameter lives (`zeros_like` keeps a parameter's sharding), the rest (step
  counts) replicated. `jax.eval_shape` alone leaves them unplaced."""
  where = {
    jax.tree_util.keystr(path): (leaf.shape, leaf.sharding)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }

  def one(path, leaf):
    name = jax.tree_util.keystr(path)
    # An optax state's path ends with its parameter's: `[1][0].mu['fc']['kernel'].value`.
    found = [s for p, (shape, s) in where.items() if name.endswith(p) and shape == leaf.shape]
    sharding = found[0] if found else NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(one, jax.eval_shape(optimizer.init, params))


def train_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """One optimizer step of training the `TRAIN_KIND` head (`trainer.train_step`:
  the objective's gradient and the AdamW update) on `[batch, context]` token
  windows (`context - 1` inputs), the frozen target as its teacher. As
  `trainer.train` places them, the head's parameters and optimizer state
  follow the logical-axis rules (not replicated) and the windows' rows are split
  over `data`; the teacher is the abstract target in its own dtype (a real run
  loads it in float32). `gamma` is unused."""
  from specjax.training import heads as head_training
  from specjax.training import trainer
  from specjax.training.optimizer import make_optimizer

  config = train_config(TRAIN_KIND)
  head = place.place_module(models.head(TRAIN_KIND), mesh)
  graphdef, params = nnx.split(head, nnx.Param)
  optimizer = make_optimizer(config)
  opt_state = _optimizer_state(optimizer, params, mesh)
  head_loss = head_training.loss_settings(config)
  keyed = head_loss.keyed
  return trainer.train_step.lower(
    params,
    opt_state,
    place.array((batch, context), jnp.int32, mesh),
    models.target,
    place.key(mesh) if keyed else None,
    graphdef=graphdef,
    optimizer=optimizer,
    loss=config.loss,
    ce_weight=config.ce_weight,
    head=head_loss,
  )


def train_target(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """One optimizer step of training the target itself (`trainer.train_step` with
  configs/train_target.py's optimizer: next-token cross-entropy, AdamW) on
  `[batch, context]` token windows: what `experiments.train
  --config=configs/train_target.py` runs per step, its parameters and optimizer
  state placed by the logical-axis rules and the windows' rows split over
  `data`. `gamma` is unused."""
  from specjax.training import trainer
  from specjax.training.optimizer import make_optimizer

  config = train_config("target")
  graphdef, params = nnx.split(models.target, nnx.Param)
  optimizer = make_optimizer(config)
  return trainer.train_step.lower(
    params,
    _optimizer_state(optimizer, params, mesh),
    place.array((batch, context), jnp.int32, mesh),
    graphdef=graphdef,
    optimizer=optimizer,
  )

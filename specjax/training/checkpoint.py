"""Orbax checkpoints of training runs, and loading a trained model from a run.

A run directory (`workdir`) holds:
  model_config.json        the `ModelConfig` of the trained model
  checkpoints/<step>/      orbax items `params`, `opt_state`, `meta` (JSON)
  metrics.jsonl            one JSON object per logged/evaluated step

Steps count completed updates: checkpoint `s` holds the parameters after s
updates, so resuming from it runs update s + 1 next.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from specjax.dtypes import to_dtype
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.transformer import Transformer

MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_DIR = "checkpoints"


class CheckpointError(ValueError):
  """A checkpoint exists but cannot be read (corrupt, truncated or mismatched)."""


def save_model_config(workdir: str, cfg: ModelConfig) -> None:
  """Writes `cfg` as `workdir/model_config.json` (atomically: never half-written)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  os.replace(tmp, path)


def load_model_config(workdir: str) -> ModelConfig:
  """The `ModelConfig` a run in `workdir` trained."""
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"no {MODEL_CONFIG_FILE} in run directory {workdir} (looked for {path})"
    )
  try:
    with open(path) as f:
      fields = json.load(f)
    if fields.get("rope_scaling"):
      fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)
  except (json.JSONDecodeError, TypeError) as e:
    raise CheckpointError(f"cannot read model config {path}: {e}") from e


def has_checkpoints(workdir: str) -> bool:
  """Whether `workdir` holds at least one finished checkpoint (`checkpoints/<step>/`)."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  return os.path.isdir(directory) and any(
    name.isdigit() and os.path.isdir(os.path.join(directory, name))
    for name in os.listdir(directory)
  )


def check_resumable(workdir: str, cfg: ModelConfig) -> None:
  """Raises ValueError when `workdir` holds checkpoints of a model other than `cfg`.

  A resume restores those checkpoints into `cfg`'s model: this check reads
  only, so a refused resume leaves the run directory as it was.
  """
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  if not (os.path.isfile(path) and has_checkpoints(workdir)):
    return
  saved = load_model_config(workdir)
  if saved != cfg:
    diff = ", ".join(
      f"{f.name} ({getattr(saved, f.name)!r} saved, {getattr(cfg, f.name)!r} configured)"
      for f in dataclasses.fields(cfg)
      if getattr(saved, f.name) != getattr(cfg, f.name)
    )
    raise ValueError(
      f"cannot resume {workdir}: its checkpoints are of the model in {path}, "
      f"which differs from config.model in {diff}. Train this model in "
      "another workdir."
    )


class Checkpointer:
  """An orbax `CheckpointManager` saving every `save_every` steps, keeping `keep`.

  `cleanup_tmp` deletes unfinished saves (`<step>.orbax-checkpoint-tmp`) left
  by a killed run; only the run that writes `workdir` may set it, since a
  reader would delete a save in flight.
  """

  def __init__(
    self,
    workdir: str,
    save_every: int = 1,
    keep: int = 3,
    create: bool = True,
    cleanup_tmp: bool = False,
  ):
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    if not create and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"no checkpoint directory {self.directory}")
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        save_interval_steps=save_every,
        max_to_keep=keep,
        create=create,
        cleanup_tmp_directories=cleanup_tmp,
      ),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, meta: dict[str, Any], force: bool = False) -> bool:
    """Saves (asynchronously) when `step` is due or `force`; True if it saved."""
    return self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta),
      ),
      force=force,
    )

  def restore(self, step: int, abstract_params, abstract_opt_state=None) -> dict[str, Any]:
    """Restores `params` (and `opt_state` when its abstract tree is given) at `step`.

    Raises:
      FileNotFoundError: no checkpoint at `step`.
      CheckpointError: the checkpoint's files are corrupt, truncated or do not
        match the expected trees; the message names the step directory.
    """
    path = os.path.join(self.directory, str(step))
    if step not in self.manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}")
    items = {"params": ocp.args.StandardRestore(abstract_params), "meta": ocp.args.JsonRestore()}
    if abstract_opt_state is not None:
      items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for bad files
      raise CheckpointError(f"cannot restore checkpoint {path}: {type(e).__name__}: {e}") from e
    return dict(restored)

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is finished."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the save in flight, then releases the manager."""
    self.manager.close()


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract params) of a `Transformer(cfg)`, allocating nothing."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)


def load_trained_model(
  workdir: str, step: int | None = None, dtype: str | None = None
) -> tuple[Transformer, int]:
  """The model a training run saved: `(Transformer, step)` at `step` (default latest).

  `dtype` (a name in `specjax.dtypes.DTYPES`) overrides the compute and
  parameter dtype.
  """
  if dtype is not None:
    to_dtype(dtype, "dtype")
  saved = load_model_config(workdir)
  cfg = saved if dtype is None else saved.replace(dtype=dtype, param_dtype=dtype)
  checkpointer = Checkpointer(workdir, create=False)
  try:
    if step is None:
      step = checkpointer.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoints in {checkpointer.directory}")
    graphdef, abstract = abstract_model(saved)
    restored = checkpointer.restore(step, abstract)["params"]
  finally:
    checkpointer.close()
  model = nnx.merge(graphdef, restored)
  return (model if cfg == saved else with_config(model, cfg)), step


def with_config(model: Transformer, cfg: ModelConfig) -> Transformer:
  """`model`'s parameters in a `Transformer(cfg)`, cast to `cfg.param_dtype`.

  For a `cfg` that differs from `model.cfg` in dtypes only: the compute dtype
  is read from the config at construction, so the module tree is rebuilt.
  """
  graphdef, _ = abstract_model(cfg)
  dtype = to_dtype(cfg.param_dtype, "cfg.param_dtype")
  params = jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param))
  return nnx.merge(graphdef, params)

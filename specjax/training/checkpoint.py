"""Orbax checkpoints of training runs, and loading a trained model from a run.

A run directory (`workdir`) holds:
  model_config.json        the `ModelConfig` of the trained model, or
  head_config.json         the `HeadConfig` of a trained draft head
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
from flax import nnx

from specjax.dtypes import to_dtype
from specjax.heads import files as head_files
from specjax.heads.base import HeadConfig, make_head
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.transformer import Transformer

MODEL_CONFIG_FILE = "model_config.json"
HEAD_CONFIG_FILE = head_files.CONFIG_FILE
CHECKPOINT_DIR = "checkpoints"


class CheckpointError(ValueError):
  """A checkpoint exists but cannot be read (corrupt, truncated or mismatched)."""


def _write_json(path: str, fields: dict[str, Any]) -> None:
  """Writes `fields` to `path` atomically: a kill leaves the old file, never half of it."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(fields, f, indent=2)
  os.replace(tmp, path)


def save_model_config(workdir: str, cfg: ModelConfig) -> None:
  """Writes `cfg` as `workdir/model_config.json` (atomically: never half-written),
  with `scan_layers` resolved: the layer layout the checkpoints hold, whatever
  platform reads them."""
  _write_json(os.path.join(workdir, MODEL_CONFIG_FILE), dataclasses.asdict(_layout_fixed(cfg)))


def _layout_fixed(cfg: ModelConfig) -> ModelConfig:
  """`cfg` with `scan_layers` resolved on this platform (None -> True or False)."""
  return cfg.replace(scan_layers=cfg.scanned)


def save_head_config(workdir: str, cfg: HeadConfig) -> None:
  """Writes `cfg` as `workdir/head_config.json` (atomically: never half-written)."""
  head_files.write_config(workdir, cfg)


def save_run_config(workdir: str, cfg: ModelConfig | HeadConfig) -> None:
  """`save_head_config` for a `HeadConfig`, `save_model_config` otherwise."""
  if isinstance(cfg, HeadConfig):
    save_head_config(workdir, cfg)
  else:
    save_model_config(workdir, cfg)


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


def load_head_config(workdir: str) -> HeadConfig:
  """The `HeadConfig` a head-training run in `workdir` trained (`specjax.heads.files`'
  reader: FileNotFoundError when absent, HeadConfigError naming the file)."""
  path = os.path.join(workdir, HEAD_CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no {HEAD_CONFIG_FILE} in run directory {workdir} (looked for {path})")
  return head_files.read_config(path)


def _flat_fields(cfg: ModelConfig | HeadConfig) -> dict[str, Any]:
  """The config's fields by name, a head's target fields as `target.<name>`."""
  if not isinstance(cfg, HeadConfig):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "target"}
  fields.update({f"target.{k}": v for k, v in _flat_fields(cfg.target).items()})
  return fields


def has_checkpoints(workdir: str) -> bool:
  """Whether `workdir` holds at least one finished checkpoint (`checkpoints/<step>/`)."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  return os.path.isdir(directory) and any(
    name.isdigit() and os.path.isdir(os.path.join(directory, name))
    for name in os.listdir(directory)
  )


def check_run(workdir: str, name: str, kind: str = "model") -> None:
  """Raises FileNotFoundError, naming `name` (the flag or field that gave
  `workdir`), unless `workdir` is a training run of a `kind` with a checkpoint.

  For launchers to call before any work, so that a mistyped run directory is
  one line naming the flag, not a failure after other models have loaded.

  Args:
    workdir: the run directory (experiments.train's --workdir).
    name: e.g. "--target" or "config.teacher".
    kind: "model" (model_config.json) or "head" (head_config.json).
  """
  if kind not in ("model", "head"):
    raise ValueError(f"kind must be 'model' or 'head', got {kind!r}.")
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"{name}: {workdir}: no such run directory")
  want, other = (
    (HEAD_CONFIG_FILE, MODEL_CONFIG_FILE)
    if kind == "head"
    else (MODEL_CONFIG_FILE, HEAD_CONFIG_FILE)
  )
  if not os.path.isfile(os.path.join(workdir, want)):
    if os.path.isfile(os.path.join(workdir, other)):
      what = "a model" if kind == "head" else "a draft head"
      raise FileNotFoundError(
        f"{name}: {workdir} is the training run of {what} ({other}), not of a {kind}"
      )
    hint = (
      " (it is a Hugging Face checkpoint: config.json)"
      if os.path.isfile(os.path.join(workdir, "config.json"))
      else ""
    )
    raise FileNotFoundError(f"{name}: {workdir} is not a training run directory: no {want}{hint}")
  if not has_checkpoints(workdir):
    raise FileNotFoundError(
      f"{name}: the run {workdir} holds no checkpoint yet ({CHECKPOINT_DIR}/<step>/)"
    )


def check_resumable(workdir: str, cfg: ModelConfig | HeadConfig) -> None:
  """Raises ValueError when `workdir` holds checkpoints of a model (or head) other than `cfg`.

  A resume restores those checkpoints into `cfg`'s module: this check reads
  only, so a refused resume leaves the run directory as it was.
  """
  if not has_checkpoints(workdir):
    return
  is_head = isinstance(cfg, HeadConfig)
  name, other = (
    (HEAD_CONFIG_FILE, MODEL_CONFIG_FILE) if is_head else (MODEL_CONFIG_FILE, HEAD_CONFIG_FILE)
  )
  what, configured = ("head", "config.head") if is_head else ("model", "config.model")
  path = os.path.join(workdir, name)
  if not os.path.isfile(path):
    if os.path.isfile(os.path.join(workdir, other)):
      raise ValueError(
        f"cannot resume {workdir}: its checkpoints are of a "
        f"{'model' if is_head else 'draft head'} ({other}), not of a {what}. "
        f"Train this {what} in another workdir."
      )
    return
  saved = load_head_config(workdir) if is_head else load_model_config(workdir)
  if not is_head:
    cfg = _layout_fixed(cfg)
  if saved != cfg:
    old, new = _flat_fields(saved), _flat_fields(cfg)
    diff = ", ".join(
      f"{k} ({old[k]!r} saved, {new[k]!r} configured)" for k in new if old.get(k) != new[k]
    )
    raise ValueError(
      f"cannot resume {workdir}: its checkpoints are of the {what} in {path}, "
      f"which differs from {configured} in {diff}. Train this {what} in "
      "another workdir."
    )


def _orbax():
  """`orbax.checkpoint`, imported on first use: its import is slow, and every
  launcher that only loads the bundled pair or a trained run's config would
  otherwise pay it at start."""
  import orbax.checkpoint as ocp

  return ocp


def _check_readable(item_dir: str) -> None:
  """Reads every entry of an orbax item's OCDBT store (`manifest.ocdbt`), one at a time.

  Orbax reads a checkpoint's arrays concurrently, in an event loop it closes as
  soon as one read fails; the reads still in flight then complete into the
  closed loop, and Python reports "RuntimeError: Event loop is closed" as an
  unraisable exception later, far from the cause. Tensorstore's blocking calls
  use no event loop: a corrupt or truncated file fails here, as one exception,
  before orbax starts. The bytes read are in the page cache for the restore.
  """
  if not os.path.isfile(os.path.join(item_dir, "manifest.ocdbt")):
    return  # not an OCDBT item (e.g. `meta`, a JSON file)
  import tensorstore as ts  # orbax's storage layer

  store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
  for key in store.list().result():
    store.read(key).result()


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
    ocp = _orbax()
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
    ocp = _orbax()
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
    ocp = _orbax()
    items = {"params": ocp.args.StandardRestore(abstract_params), "meta": ocp.args.JsonRestore()}
    if abstract_opt_state is not None:
      items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    try:
      for name in items:
        _check_readable(os.path.join(path, name))
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
  graphdef, abstract = abstract_model(saved)
  restored, step = _restore_params(workdir, step, abstract)
  model = nnx.merge(graphdef, restored)
  return (model if cfg == saved else with_config(model, cfg)), step


def with_config(model: Transformer, cfg: ModelConfig) -> Transformer:
  """`model`'s parameters in a `Transformer(cfg)`, cast to `cfg.param_dtype`.

  For a `cfg` that differs from `model.cfg` in dtypes only: the compute dtype
  is read from the config at construction, so the module tree is rebuilt.
  """
  from specjax.models.scan import with_layout

  model = with_layout(model, cfg.scanned)  # a run saved on another platform may differ
  graphdef, _ = abstract_model(cfg)
  dtype = to_dtype(cfg.param_dtype, "cfg.param_dtype")
  params = jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param))
  return nnx.merge(graphdef, params)


def abstract_head(cfg: HeadConfig):
  """(graphdef, abstract params) of `make_head(cfg)`, allocating nothing."""
  head = nnx.eval_shape(lambda: make_head(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(head, nnx.Param)


def load_trained_head(workdir: str, step: int | None = None) -> tuple[nnx.Module, int]:
  """The draft head a head-training run saved: `(head, step)` at `step` (default latest).

  The head (its kind's module, per `head_config.json`)
  holds exactly the checkpoint's parameters, in the dtype it was trained in.
  """
  cfg = load_head_config(workdir)
  graphdef, abstract = abstract_head(cfg)
  restored, step = _restore_params(workdir, step, abstract)
  return nnx.merge(graphdef, restored), step


def _restore_params(workdir: str, step: int | None, abstract) -> tuple[Any, int]:
  """The `params` item of checkpoint `step` (default: the latest) of the run in
  `workdir`, restored onto `abstract`; FileNotFoundError when there is none."""
  checkpointer = Checkpointer(workdir, create=False)
  try:
    if step is None:
      step = checkpointer.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoints in {checkpointer.directory}")
    return checkpointer.restore(step, abstract)["params"], step
  finally:
    checkpointer.close()

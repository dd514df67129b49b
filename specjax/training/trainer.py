"""The training loop: language modelling or draft distillation, resumable.

  history = train(config, workdir)

Everything a run needs is derived from `config` and `workdir`: the tokenizer
and token files (built on first use), the model, AdamW, and an orbax
`Checkpointer` that resumes from the latest step automatically. Batches are a
pure function of `(seed, step)` and the step is jitted and deterministic, so an
interrupted run resumed from step s continues with the same losses as an
uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Callable

import jax
import ml_collections
import optax
from flax import nnx

from specjax.data import TokenDataset, Tokenizer, corpus_files, prepare_splits, train_tokenizer
from specjax.distributed import make_mesh, shard_batch, shard_model, shard_process_batch
from specjax.generation.validation import check_positive_int
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer
from specjax.training import checkpoint as ckpt
from specjax.training import losses
from specjax.training.optimizer import learning_rate_schedule, make_optimizer

LOSSES = ("ce",) + losses.DISTILL_LOSSES


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field and its allowed range (before any compile)."""
  for name in ("batch_size", "seq_len", "num_steps", "log_every", "eval_every",
               "eval_batches", "checkpoint_every", "keep_checkpoints"):
    check_positive_int(f"config.{name}", config[name])
  if not isinstance(config.warmup_steps, int) or not 0 <= config.warmup_steps < config.num_steps:
    raise ValueError(f"config.warmup_steps must be an int in [0, num_steps="
                     f"{config.num_steps}), got {config.warmup_steps!r}.")
  for name, low, high in (("learning_rate", 0.0, 1.0), ("min_lr_ratio", 0.0, 1.0),
                          ("b1", 0.0, 1.0), ("b2", 0.0, 1.0)):
    value = config[name]
    if not low <= value <= high or (name == "learning_rate" and value == 0):
      raise ValueError(f"config.{name} must be in ({low}, {high}], got {value!r}.")
  if config.clip_norm <= 0 or config.weight_decay < 0:
    raise ValueError(f"config.clip_norm must be > 0 and config.weight_decay >= 0, got "
                     f"{config.clip_norm!r} and {config.weight_decay!r}.")
  if config.loss not in LOSSES:
    raise ValueError(f"config.loss must be one of {LOSSES}, got {config.loss!r}.")
  if (config.loss != "ce") != bool(config.teacher):
    raise ValueError("config.teacher (the run directory of the target) must be set "
                     f"exactly when config.loss is a distillation loss; loss={config.loss!r}, "
                     f"teacher={config.teacher!r}.")
  if config.seq_len > config.model.max_seq_len:
    raise ValueError(f"config.seq_len must be <= config.model.max_seq_len="
                     f"{config.model.max_seq_len}, got {config.seq_len}.")


def prepare_data(config: ml_collections.ConfigDict, workdir: str,
                 log: Callable[[str], None] = print) -> tuple[Tokenizer, dict[str, str]]:
  """The tokenizer and `<split>.bin` paths, building whatever is missing.

  `config.data.tokenizer` names an existing tokenizer.json; when empty, one is
  trained on the train split (byte-level BPE, `config.data.vocab_size`) into
  `<data dir>/tokenizer.json`.
  """
  data_dir = config.data.dir or os.path.join(workdir, "data")
  os.makedirs(data_dir, exist_ok=True)
  path = config.data.tokenizer or os.path.join(data_dir, "tokenizer.json")
  if not os.path.exists(path) and not config.data.tokenizer:
    log(f"training a {config.data.vocab_size}-token byte-level BPE on the train split")
    files = corpus_files("train", config.data.root or None)
    train_tokenizer(files, config.data.vocab_size).save(path)
  tokenizer = Tokenizer.from_file(path)
  return tokenizer, prepare_splits(data_dir, tokenizer, config.data.root or None, log=log)


class _Log:
  """Progress lines to stdout and `metrics.jsonl`, from process 0 only."""

  def __init__(self, workdir: str, resume_step: int, echo: Callable[[str], None]):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.echo = echo
    if self.enabled and os.path.exists(self.path):
      # Drop records past the checkpoint we resume from: they will be redone.
      with open(self.path) as f:
        kept = [l for l in f if json.loads(l)["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(kept)

  def __call__(self, line: str, record: dict[str, Any] | None = None) -> None:
    if not self.enabled:
      return
    self.echo(line)
    if record is not None:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _format_seconds(seconds: float) -> str:
  minutes, secs = divmod(int(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def train(config: ml_collections.ConfigDict, workdir: str, *,
          stop_after: int | None = None,
          echo: Callable[[str], None] = print) -> list[dict[str, float]]:
  """Trains (or distills) as `config` says, resuming from `workdir`'s latest checkpoint.

  Args:
    config: a train config (see configs/train_*.py).
    workdir: run directory; created if missing.
    stop_after: stop after this global step without a final save, as an
      interruption would (tests use it to check resume equivalence).
    echo: where progress lines go.

  Returns:
    One record per update run in this call: {"step", "loss", ...metrics}.
  """
  check_config(config)
  os.makedirs(workdir, exist_ok=True)
  tokenizer, paths = prepare_data(config, workdir, echo)
  cfg = ModelConfig(**config.model.to_dict())
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"config.model.vocab_size ({cfg.vocab_size}) must be >= the "
                     f"tokenizer's {tokenizer.vocab_size} ids.")
  mesh = make_mesh(tuple(config.mesh_shape), devices=config.get("mesh_devices") or None)
  if config.batch_size % mesh.shape["data"]:
    raise ValueError(f"config.batch_size ({config.batch_size}) must be divisible by the "
                     f"mesh's data axis ({mesh.shape['data']}).")
  if jax.process_index() == 0:
    ckpt.save_model_config(workdir, cfg)
  # Models are built outside the mesh context (their logical axis names are not
  # mesh axes) and then placed by the rules.
  teacher = None
  if config.loss != "ce":
    teacher, teacher_step = ckpt.load_trained_model(config.teacher, dtype="float32")
    if teacher.cfg.vocab_size != cfg.vocab_size:
      raise ValueError(f"the teacher's vocab_size {teacher.cfg.vocab_size} differs from "
                       f"config.model.vocab_size {cfg.vocab_size}.")
    echo(f"teacher: {config.teacher} step {teacher_step}, {teacher.num_params:,} params")
    teacher = shard_model(teacher, mesh)
  if config.get("init_from"):
    # Fine-tuning: start from another run's parameters (fresh optimizer and
    # schedule); a checkpoint of this run, once there is one, takes precedence.
    model, init_step = ckpt.load_trained_model(config.init_from, dtype=cfg.param_dtype)
    if model.cfg.replace(dtype=cfg.dtype) != cfg:
      raise ValueError(f"config.init_from={config.init_from!r} holds a different model "
                       f"({model.cfg}) than config.model ({cfg}).")
    echo(f"initialised from {config.init_from} step {init_step}")
  else:
    model = Transformer(cfg, rngs=nnx.Rngs(config.seed))
  model = shard_model(model, mesh)
  with jax.set_mesh(mesh):
    return _train_on_mesh(config, workdir, mesh, model, teacher, paths, stop_after, echo)


def _train_on_mesh(config, workdir, mesh, model, teacher, paths, stop_after, echo):
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(params)
  schedule = learning_rate_schedule(config)

  checkpointer = ckpt.Checkpointer(workdir, config.checkpoint_every, config.keep_checkpoints)
  start = checkpointer.latest_step() or 0
  if start:
    restored = checkpointer.restore(start, params, opt_state)
    params, opt_state = restored["params"], restored["opt_state"]
  log = _Log(workdir, start, echo)
  log(f"{'resuming at' if start else 'starting'} step {start}/{config.num_steps}: "
      f"{model.num_params:,} params, loss {config.loss}, workdir {workdir}")

  def objective(params, batch, teacher):
    model = nnx.merge(graphdef, params)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    ce = losses.cross_entropy(logits, targets)
    metrics = {"ce": ce}
    if teacher is None:
      return ce, metrics
    teacher_logits = jax.lax.stop_gradient(teacher(inputs))
    distill = losses.distill_loss(config.loss, teacher_logits, logits)
    metrics.update(distill=distill, **losses.agreement(teacher_logits, logits))
    return distill + config.ce_weight * ce, metrics

  # Parameters and optimizer state are donated: updated in place, not copied.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch, teacher):
    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(
        params, batch, teacher)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
    return optax.apply_updates(params, updates), opt_state, metrics

  @jax.jit
  def eval_step(params, batch, teacher):
    return objective(params, batch, teacher)[1]

  train_data = TokenDataset(paths["train"])
  val_data = TokenDataset(paths["validation"])

  def evaluate(step: int) -> dict[str, float]:
    sums, count = {}, 0
    for batch in val_data.eval_batches(config.batch_size, config.seq_len,
                                       config.eval_batches):
      metrics = eval_step(params, shard_batch(batch, mesh), teacher)
      for k, v in jax.device_get(metrics).items():
        sums[k] = sums.get(k, 0.0) + float(v)
      count += 1
    result = {f"val_{k}": v / count for k, v in sums.items()}
    result["val_perplexity"] = math.exp(result["val_ce"])
    parts = "  ".join(f"{k} {v:.4f}" for k, v in result.items())
    log(f"eval step {step}: {parts}", {"step": step, "time": time.time(), **result})
    return result

  history = []
  tokens_per_step = config.batch_size * config.seq_len
  last = stop_after if stop_after is not None else config.num_steps
  timer_start, timed_steps = time.perf_counter(), 0
  for step in range(start + 1, min(last, config.num_steps) + 1):
    # Each process reads only its own rows of the global batch.
    rows = train_data.batch(step, config.batch_size, config.seq_len, config.seed,
                            jax.process_index(), jax.process_count())
    params, opt_state, metrics = train_step(params, opt_state,
                                            shard_process_batch(rows, mesh), teacher)
    record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
    history.append(record)
    if step == start + 1:  # the first step compiles; time from the second on
      timer_start, timed_steps = time.perf_counter(), 0
    else:
      timed_steps += 1
    if step % config.log_every == 0 or step == config.num_steps:
      elapsed = time.perf_counter() - timer_start
      rate = timed_steps * tokens_per_step / elapsed if timed_steps else float("nan")
      eta = (config.num_steps - step) * tokens_per_step / rate if timed_steps else 0.0
      record.update(lr=float(schedule(step - 1)), tokens_per_second=rate,
                    tokens_seen=step * tokens_per_step, time=time.time())
      log(f"step {step}/{config.num_steps}  loss {record['loss']:.4f}  "
          f"lr {record['lr']:.2e}  {rate:,.0f} tok/s  eta {_format_seconds(eta)}", record)
    if step % config.eval_every == 0 or step == config.num_steps:
      evaluate(step)
    if step == config.num_steps:
      checkpointer.save(step, params, opt_state, _meta(config, step), force=True)
    else:
      checkpointer.save(step, params, opt_state, _meta(config, step))
  checkpointer.wait()
  checkpointer.close()
  return history


def _meta(config: ml_collections.ConfigDict, step: int) -> dict[str, Any]:
  return {"step": step, "tokens_seen": step * config.batch_size * config.seq_len,
          "config": config.to_dict()}

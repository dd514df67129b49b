"""The training loop: language modelling, draft distillation or draft heads, resumable.

  history = train(config, workdir)

Everything a run needs is derived from `config` and `workdir`: the tokenizer
and token files (the corpus, encoded on first use; other data must exist, see
`check_data`), the model, AdamW, and an orbax
`Checkpointer` that resumes from the latest step automatically. Batches are a
pure function of `(seed, step)` and the step is jitted and deterministic, so an
interrupted run resumed from step s continues with the same losses as an
uninterrupted one.

The objective, `train_step` and `eval_step` are module-level functions of
(params, batch, teacher) with the model's graphdef and the loss as static
arguments, so they run without a config or run directory. `train` checks the
config, the run directory and the data before it writes a checkpoint, metrics
or model_config.json.

With `config.head.kind` set, the trained module is a draft head (any registered
kind, `specjax.heads`) on the frozen target `config.head.target`, which takes the
teacher's place; the objectives are `specjax.training.heads`' and the run
directory records head_config.json instead of model_config.json.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx

from specjax import heads, losses
from specjax.data import TokenDataset, Tokenizer, corpus_files, prepare_splits, train_tokenizer
from specjax.data.dataset import missing_splits
from specjax.distributed import make_mesh, shard_batch, shard_model, shard_process_batch
from specjax.dtypes import to_dtype
from specjax.heads import HeadConfig, make_head
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer
from specjax.training import checkpoint as ckpt
from specjax.training import heads as head_training
from specjax.training.evaluate import mean_metrics
from specjax.training.optimizer import learning_rate_schedule, make_optimizer
from specjax.validation import check_int, check_positive_int, is_int

LOSSES = ("ce",) + losses.DISTILL_LOSSES


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field and its allowed range (before any compile)."""
  for name in (
    "batch_size",
    "seq_len",
    "num_steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
  ):
    check_positive_int(f"config.{name}", config[name])
  check_int("config.seed", config.seed, minimum=0)
  if not is_int(config.warmup_steps) or not 0 <= config.warmup_steps < config.num_steps:
    raise ValueError(
      f"config.warmup_steps must be an int in [0, num_steps="
      f"{config.num_steps}), got {config.warmup_steps!r}."
    )
  for name, low, high in (
    ("learning_rate", 0.0, 1.0),
    ("min_lr_ratio", 0.0, 1.0),
    ("b1", 0.0, 1.0),
    ("b2", 0.0, 1.0),
  ):
    value = config[name]
    if not low <= value <= high or (name == "learning_rate" and value == 0):
      raise ValueError(f"config.{name} must be in ({low}, {high}], got {value!r}.")
  if config.clip_norm <= 0 or config.weight_decay < 0:
    raise ValueError(
      f"config.clip_norm must be > 0 and config.weight_decay >= 0, got "
      f"{config.clip_norm!r} and {config.weight_decay!r}."
    )
  if not config.ce_weight >= 0:
    raise ValueError(f"config.ce_weight must be >= 0, got {config.ce_weight!r}.")
  if head_training.head_kind(config):
    # A head's shape, vocabulary and context follow its target, not config.model.
    head_training.check_config(config)
    return
  if config.loss not in LOSSES:
    raise ValueError(f"config.loss must be one of {LOSSES}, got {config.loss!r}.")
  if (config.loss != "ce") != bool(config.teacher):
    raise ValueError(
      "config.teacher (the run directory of the target) must be set "
      f"exactly when config.loss is a distillation loss; loss={config.loss!r}, "
      f"teacher={config.teacher!r}."
    )
  for name in ("dtype", "param_dtype"):
    to_dtype(config.model[name], f"config.model.{name}")
  if config.seq_len > config.model.max_seq_len:
    raise ValueError(
      f"config.seq_len must be <= config.model.max_seq_len="
      f"{config.model.max_seq_len}, got {config.seq_len}."
    )


def data_dir_of(config: ml_collections.ConfigDict, workdir: str) -> str:
  """The run's data directory: `config.data.dir`, or `<workdir>/data` when empty."""
  return config.data.dir or os.path.join(workdir, "data")


def _shown(path: str) -> str:
  """`path` relative to the working directory when it lies under it (for commands)."""
  relative = os.path.relpath(path)
  return path if relative.startswith(os.pardir) else relative


def _same_path(a: str, b: str) -> bool:
  return os.path.realpath(a) == os.path.realpath(b)


def check_data(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Raises FileNotFoundError, naming --config.data.dir, when its token files are
  missing and it is not a directory the corpus may be encoded into.

  The corpus (`config.data.root`: the standard library) is encoded on first use
  into `<workdir>/data` (an empty `config.data.dir`) or, when the config names
  one, its corpus directory `config.data.corpus_dir` only (any data dir when it
  is empty). Another data directory holds data made for the run, e.g. the
  target's own continuations (`experiments.generate_data`) of a second phase:
  it must exist, since a corpus encoded in its place would be trained on
  without a word.
  """
  data_dir = data_dir_of(config, workdir)
  corpus_dir = config.data.corpus_dir
  if not config.data.dir or not corpus_dir or _same_path(data_dir, corpus_dir):
    return
  missing = missing_splits(data_dir)
  if not missing:
    return
  if head_training.head_kind(config) or config.teacher:
    target = (
      _shown(head_training.target_dir(config))
      if head_training.head_kind(config)
      else config.teacher
    )
    make = (
      f"python -m experiments.generate_data --target={target} --data_dir={corpus_dir} "
      f"--out={data_dir}"
    )
  else:
    make = (
      "experiments.generate_data (the target's continuations; re-encoded by "
      "experiments.bundle_cross_draft --reencode for a draft with a tokenizer of its own)"
    )
  found = (
    "no such directory"
    if not os.path.isdir(data_dir)
    else f"no token files {', '.join(f'{split}.bin' for split in missing)}"
  )
  raise FileNotFoundError(
    f"--config.data.dir={data_dir}: {found}. Only the corpus directory "
    f"(config.data.corpus_dir={corpus_dir}) is encoded on first use; another data "
    f"directory holds data made for this run. Make it first: {make} "
    f"(or set --config.data.corpus_dir={data_dir} to encode the corpus there)"
  )


def prepare_data(
  config: ml_collections.ConfigDict,
  workdir: str,
  log: Callable[[str], None] = print,
  vocab: tuple[str, int] | None = None,
) -> tuple[Tokenizer, dict[str, str]]:
  """The tokenizer and `<split>.bin` paths, building whatever is missing (only the
  corpus, only where `check_data` allows).

  `config.data.tokenizer` names an existing tokenizer.json; when empty, one is
  trained on the train split (byte-level BPE, `config.data.vocab_size`) into
  `<data dir>/tokenizer.json`. Token files already in the data dir must have
  been encoded with that tokenizer (ValueError otherwise), and a newly trained
  tokenizer is saved only once they are known to match it.

  `vocab` = (name, size) of a pretrained model's vocabulary (a head's target)
  instead of config.model's: the tokenizer must then exist already, since a
  new one would not give that model's ids.
  """
  if config.data.get("files"):
    return _prepare_files(config, workdir, log, vocab)
  check_data(config, workdir)
  data_dir = data_dir_of(config, workdir)
  path = config.data.tokenizer or os.path.join(data_dir, "tokenizer.json")
  trained = not config.data.tokenizer and not os.path.exists(path)
  vocab_name, vocab_size = vocab or ("config.model.vocab_size", config.model.vocab_size)
  if trained and vocab is not None:
    raise ValueError(
      f"config.data.tokenizer must name an existing tokenizer.json for {vocab_name}: the "
      f"data dir {data_dir} holds none, and a newly trained one would not give that "
      "model's ids."
    )
  if trained:
    log(f"training a {config.data.vocab_size}-token byte-level BPE on the train split")
    tokenizer = train_tokenizer(
      corpus_files("train", config.data.root or None), config.data.vocab_size
    )
  else:
    tokenizer = Tokenizer.from_file(path)
  _check_vocab(vocab_size, vocab_name, tokenizer, f"{'trained for' if trained else 'in'} {path}")
  paths = prepare_splits(data_dir, tokenizer, config.data.root or None, log=log)
  return tokenizer, _keep_tokenizer(data_dir, tokenizer, paths)


def _check_vocab(size: int, name: str, tokenizer: Tokenizer, where: str) -> None:
  if size < tokenizer.vocab_size:
    raise ValueError(
      f"{name} ({size}) must be >= the {tokenizer.vocab_size} ids of the tokenizer {where}."
    )


def _keep_tokenizer(data_dir: str, tokenizer: Tokenizer, paths: dict[str, str]) -> dict[str, str]:
  # The data dir keeps the tokenizer that encoded it (trained here, or a copy of
  # config.data.tokenizer), so that what reads it next (generate_data, decode's
  # data flags) needs only the directory.
  local = os.path.join(data_dir, "tokenizer.json")  # `path` itself when trained here
  if not os.path.exists(local):
    tokenizer.save(local)
  return paths


def _prepare_files(
  config: ml_collections.ConfigDict,
  workdir: str,
  log: Callable[[str], None],
  vocab: tuple[str, int] | None,
) -> tuple[Tokenizer, dict[str, str]]:
  """`prepare_data` for `config.data.files`, with a head's target's tokenizer.json (else
  config.data.tokenizer), EOS and chat template."""
  from specjax.data.chat import ChatTemplate
  from specjax.data.dataset import prepare_file_splits
  from specjax.data.files import eos_of, source_files
  from specjax.hf.loader import load_tokenizer

  files = source_files(config.data.files)  # a missing file fails before anything loads
  target = head_training.target_dir(config) if head_training.head_kind(config) else None
  tokenizer = load_tokenizer(target) if target else None
  if tokenizer is None:
    from specjax import pretrained

    # The bundled tokenizer (the head configs' default) gives only the bundled pair's ids.
    pair = os.path.realpath(pretrained.PAIR_DIR)
    other = target and os.path.commonpath([os.path.realpath(target), pair]) != pair
    if not config.data.tokenizer or (other and config.data.tokenizer == pretrained.TOKENIZER_FILE):
      raise ValueError(
        f"config.data.tokenizer must name the tokenizer.json of config.data.files' ids "
        f"({target or 'the model'} has none)."
      )
    tokenizer = Tokenizer.from_file(config.data.tokenizer)
  name, size = vocab or ("config.model.vocab_size", config.model.vocab_size)
  _check_vocab(size, name, tokenizer, "of config.data.files")
  data_dir = data_dir_of(config, workdir)
  template = ChatTemplate.from_checkpoint(target) if target else None
  check_positive_int("config.data.validation_every", config.data.validation_every)
  every = config.data.validation_every
  paths = prepare_file_splits(
    data_dir, files, tokenizer, eos_of(target, tokenizer), template, every, log
  )
  return tokenizer, _keep_tokenizer(data_dir, tokenizer, paths)


def check_data_fingerprint(workdir: str, train_path: str, files: str) -> None:
  """Records in `<workdir>/data.json` the sha256 of the train split's meta (its source
  files' sha256, tokenizer, split rule) and refuses, naming config.data.files, to
  resume a run on other data: the checkpoint's step is a position in this data only."""
  from specjax.data.dataset import meta_path

  with open(meta_path(train_path), "rb") as f:
    fingerprint = hashlib.sha256(f.read()).hexdigest()
  record = os.path.join(workdir, "data.json")
  if os.path.exists(record):
    with open(record) as f:
      old = json.load(f)
    if old["fingerprint"] != fingerprint:
      raise ValueError(
        f"config.data.files: the run in {workdir} was trained on other data "
        f"({old['files']}); resume with the same data or start a new workdir."
      )
  elif jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(record, "w") as f:
      json.dump({"files": files, "fingerprint": fingerprint}, f)


def objective(
  params: nnx.State,
  batch: jax.Array,
  teacher: Transformer | None = None,
  key: jax.Array | None = None,
  *,
  graphdef: nnx.GraphDef,
  loss: str = "ce",
  ce_weight: float = 0.0,
  head: heads.LossSettings | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss of the model `nnx.merge(graphdef, params)` on `batch`.

  Args:
    params: the model's `nnx.Param` state.
    batch: int32 `[B, T + 1]` windows: inputs `[:, :-1]`, targets `[:, 1:]`.
    teacher: the frozen target of a distillation loss or of a head; None for "ce".
    key: PRNG key of a head objective's noise (None: none); unused by models.
    graphdef: the model's graph definition (`nnx.split(model, nnx.Param)[0]`).
    loss: "ce" or one of `losses.DISTILL_LOSSES`.
    ce_weight: weight of the cross-entropy added to a distillation loss.
    head: for a draft head (graphdef of `make_head`), its kind's objective settings
      (`specjax.heads.LossSettings`); the objective is then
      `specjax.training.heads.objective`.

  Returns:
    (scalar loss, metrics): metrics holds `ce` (nats), and with a teacher also
    `distill`, `alpha_t0` and `alpha_t1` (see `losses.agreement`).
  """
  if head is not None:
    if teacher is None:
      raise ValueError("a head objective needs its frozen target (teacher), got None.")
    return head_training.objective(
      params, batch, teacher, key, graphdef=graphdef, loss=loss, ce_weight=ce_weight, settings=head
    )
  if loss not in LOSSES or (loss != "ce") != (teacher is not None):
    raise ValueError(
      f"loss must be one of {LOSSES}, with a teacher exactly when it is a "
      f"distillation loss; got loss={loss!r}, teacher={type(teacher).__name__}."
    )
  model = nnx.merge(graphdef, params)
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = model(inputs)
  ce = losses.cross_entropy(logits, targets)
  if teacher is None:
    return ce, {"ce": ce}
  teacher_logits = jax.lax.stop_gradient(teacher(inputs))
  distill = losses.distill_loss(loss, teacher_logits, logits)
  metrics = {"ce": ce, "distill": distill, **losses.agreement(teacher_logits, logits)}
  return distill + ce_weight * ce, metrics


# Parameters and optimizer state are donated: updated in place, not copied.
@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "optimizer", "loss", "ce_weight", "head"),
  donate_argnames=("params", "opt_state"),
)
def train_step(
  params: nnx.State,
  opt_state: optax.OptState,
  batch: jax.Array,
  teacher: Transformer | None = None,
  key: jax.Array | None = None,
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss: str = "ce",
  ce_weight: float = 0.0,
  head: heads.LossSettings | None = None,
) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
  """One update on `batch` (int32 `[B, T + 1]`): (params, opt_state, metrics).

  `key` and `head` are the objective's (a draft head's key, where its settings are
  `keyed`, and its objective settings). Metrics are the objective's plus `loss` and the pre-clipping
  `grad_norm`.
  """
  (value, metrics), grads = jax.value_and_grad(objective, has_aux=True)(
    params, batch, teacher, key, graphdef=graphdef, loss=loss, ce_weight=ce_weight, head=head
  )
  updates, opt_state = optimizer.update(grads, opt_state, params)
  metrics.update(loss=value, grad_norm=optax.tree.norm(grads))
  return optax.apply_updates(params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "head"))
def eval_step(
  params: nnx.State,
  batch: jax.Array,
  teacher: Transformer | None = None,
  *,
  graphdef: nnx.GraphDef,
  loss: str = "ce",
  head: heads.LossSettings | None = None,
) -> dict[str, jax.Array]:
  """The objective's metrics on `batch` (int32 `[B, T + 1]`), without an update
  (nor a head's training noise)."""
  return objective(params, batch, teacher, graphdef=graphdef, loss=loss, head=head)[1]


def kept_metrics(path: str, last_step: int, log: Callable[[str], None] = print) -> list[str]:
  """The lines of metrics file `path` for steps <= `last_step`, each ending in a newline.

  A partial last line (a kill during an append) is dropped; any other line that
  is not a JSON record with a "step" raises ValueError naming `path:line`.
  """
  with open(path) as f:
    lines = f.readlines()
  kept = []
  for number, line in enumerate(lines, 1):
    try:
      step = json.loads(line)["step"]
    except (json.JSONDecodeError, TypeError, KeyError) as e:
      if number == len(lines) and not line.endswith("\n"):
        log(f"dropped the partial last line of {path}")
        break
      raise ValueError(
        f"{path}:{number}: not a metrics record ({type(e).__name__}: {e}): {line[:80]!r}"
      ) from e
    if step <= last_step:
      kept.append(line if line.endswith("\n") else line + "\n")
  return kept


class _Log:
  """Progress lines to stdout and `metrics.jsonl`, from process 0 only."""

  def __init__(self, workdir: str, resume_step: int, echo: Callable[[str], None]):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.echo = echo
    if self.enabled and os.path.exists(self.path):
      # Drop records past the checkpoint we resume from: they will be redone.
      kept = kept_metrics(self.path, resume_step, echo)
      tmp = f"{self.path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        f.writelines(kept)
      os.replace(tmp, self.path)  # a kill here keeps the old file, never half of it

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


def validation_metrics(
  params: nnx.State,
  teacher: Transformer | None,
  data: TokenDataset,
  mesh: jax.sharding.Mesh,
  config: ml_collections.ConfigDict,
  graphdef: nnx.GraphDef,
  head: heads.LossSettings | None = None,
) -> dict[str, float]:
  """`eval_step`'s metrics averaged over `config.eval_batches` batches of `data`.

  Keys are prefixed `val_`, plus `val_perplexity` = exp(`val_ce`).
  """
  result = {
    f"val_{k}": v
    for k, v in mean_metrics(
      lambda batch: eval_step(
        params,
        shard_batch(batch, mesh),
        teacher,
        graphdef=graphdef,
        loss=config.loss,
        head=head,
      ),
      data.eval_batches(config.batch_size, config.seq_len, config.eval_batches),
    ).items()
  }
  result["val_perplexity"] = math.exp(result["val_ce"])
  return result


def _open_splits(
  config: ml_collections.ConfigDict, paths: dict[str, str]
) -> tuple[TokenDataset, TokenDataset]:
  """The train and validation datasets, checked to hold a window / an eval batch."""
  train_data, val_data = TokenDataset(paths["train"]), TokenDataset(paths["validation"])
  train_data.check_window(config.seq_len)
  val_data.check_eval(config.batch_size, config.seq_len)
  return train_data, val_data


def train(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  stop_after: int | None = None,
  echo: Callable[[str], None] = print,
) -> list[dict[str, float]]:
  """Trains (or distills) as `config` says, resuming from `workdir`'s latest checkpoint.

  Args:
    config: a train config (see configs/train_*.py); with `config.head.kind`
      set, a draft head on the frozen target `config.head.target`.
    workdir: run directory; created if missing.
    stop_after: stop after this global step without a final save, as an
      interruption would (tests use it to check resume equivalence).
    echo: where progress lines go.

  Returns:
    One record per update run in this call: {"step", "loss", ...metrics}.

  Raises:
    ValueError: a bad config, a resume with another model or head, a head that
      does not fit its target, token files of another tokenizer, or splits too
      small for a batch; all before a checkpoint, metrics or the run's config
      file is written, and before anything compiles.
    FileNotFoundError: a missing run (teacher, init_from), head target or data
      directory that is not the corpus's (`check_data`), naming the flag;
      before any data is encoded.
    FloatingPointError: the loss stopped being finite (the last checkpoint is
      kept as it was).
  """
  check_config(config)
  cfg, head_dir, vocab = _run_config(config, workdir)
  mesh = make_mesh(tuple(config.mesh_shape), devices=config.get("mesh_devices") or None)
  if config.batch_size % mesh.shape["data"]:
    raise ValueError(
      f"config.batch_size ({config.batch_size}) must be divisible by the "
      f"mesh's data axis ({mesh.shape['data']})."
    )
  tokenizer, paths = prepare_data(config, workdir, echo, vocab)
  train_data, val_data = _open_splits(config, paths)
  if config.data.get("files"):
    check_data_fingerprint(workdir, paths["train"], config.data.files)
  if head_dir is not None:  # what the data decides (EAGLE-3's draft vocabulary)
    cfg = head_training.prepare(cfg, workdir, train_data.tokens)
  model, teacher, head_loss = _models(config, cfg, head_dir, tokenizer, mesh, echo)
  with jax.set_mesh(mesh):
    return _fit(
      config,
      workdir,
      mesh,
      cfg,
      model,
      teacher,
      train_data,
      val_data,
      stop_after,
      echo,
      head_loss,
    )


def _run_config(
  config: ml_collections.ConfigDict, workdir: str
) -> tuple[ModelConfig | HeadConfig, str | None, tuple[str, int] | None]:
  """`(cfg, head_dir, vocab)` of a checked `config`: the model (or head) config to
  train, the head's target run (None for a model) and the vocabulary the data must
  match (`prepare_data`'s `vocab`; None for a model).

  Reads only JSON (the runs this one reads, the target's config), so a bad run
  directory or head config fails before any data is encoded or weights load; a
  resume with another model or head fails here too (`check_resumable`).
  """
  for name in ("teacher", "init_from"):
    if config.get(name):
      ckpt.check_run(config[name], f"--config.{name}")
  head_dir = vocab = None
  if head_training.head_kind(config):
    head_dir = head_training.target_dir(config)
    target_cfg = head_training.target_config(head_dir)
    cfg = head_training.prepare(head_training.head_config(config, target_cfg), workdir)
    vocab = (f"the target's vocab_size ({head_dir})", target_cfg.vocab_size)
  else:
    cfg = ModelConfig(**config.model.to_dict())
  ckpt.check_resumable(workdir, cfg)
  return cfg, head_dir, vocab


def _models(
  config: ml_collections.ConfigDict,
  cfg: ModelConfig | HeadConfig,
  head_dir: str | None,
  tokenizer: Tokenizer,
  mesh: jax.sharding.Mesh,
  echo: Callable[[str], None],
) -> tuple[nnx.Module, Transformer | None, heads.LossSettings | None]:
  """`(model, teacher, head_loss)` placed on `mesh`: the model (or head) to train,
  the frozen teacher (a head's target; None for a cross-entropy run) and a head's
  objective settings (None for a model)."""
  # Models are built outside the mesh context (their logical axis names are not
  # mesh axes) and then placed by the rules.
  head_loss = None
  if head_dir is not None:
    teacher, model = _target_and_head(cfg, head_dir, tokenizer, config, echo)
    head_loss = head_training.loss_settings(config)
  else:
    teacher = _teacher(config, cfg, echo) if config.loss != "ce" else None
    model = _initial_model(config, cfg, echo)
  if teacher is not None:
    teacher = shard_model(teacher, mesh)
  return shard_model(model, mesh), teacher, head_loss


def _target_and_head(
  cfg: HeadConfig,
  path: str,
  tokenizer: Tokenizer,
  config: ml_collections.ConfigDict,
  echo: Callable[[str], None],
) -> tuple[Transformer, nnx.Module]:
  """The frozen target at `path` (float32) and a fresh head of `cfg` (seed `config.seed`)."""
  from specjax.hf.loader import load_tokenizer

  own = load_tokenizer(path)
  if own is not None and own.get_vocab() != tokenizer.get_vocab():
    raise ValueError(
      f"the data's tokenizer ({config.data.tokenizer or 'in the data dir'}) differs from the "
      f"target's ({path}/tokenizer.json); set config.data.tokenizer to the target's."
    )
  target = head_training.load_target(path)
  echo(f"target (frozen): {path}, {target.num_params:,} params")
  head = make_head(cfg, rngs=nnx.Rngs(config.seed))
  if config.head.get("warm_start"):  # `head_training.check_config`: the kind has one
    head = heads.of(cfg).training.warm_start(
      head, target, config.head, head_training.load_head_from
    )
  return target, head


def _teacher(
  config: ml_collections.ConfigDict, cfg: ModelConfig, echo: Callable[[str], None]
) -> Transformer:
  """The frozen teacher of a distillation run (float32), checked against `cfg`."""
  teacher, teacher_step = ckpt.load_trained_model(config.teacher, dtype="float32")
  if teacher.cfg.vocab_size != cfg.vocab_size:
    raise ValueError(
      f"the teacher's vocab_size {teacher.cfg.vocab_size} differs from "
      f"config.model.vocab_size {cfg.vocab_size}."
    )
  if teacher.cfg.max_seq_len < config.seq_len:
    raise ValueError(
      f"the teacher's max_seq_len {teacher.cfg.max_seq_len} is below "
      f"config.seq_len {config.seq_len}."
    )
  echo(f"teacher: {config.teacher} step {teacher_step}, {teacher.num_params:,} params")
  return teacher


def _initial_model(
  config: ml_collections.ConfigDict, cfg: ModelConfig, echo: Callable[[str], None]
) -> Transformer:
  """A fresh `Transformer(cfg)`, or `config.init_from`'s parameters in one."""
  if not config.get("init_from"):
    return Transformer(cfg, rngs=nnx.Rngs(config.seed))
  # Fine-tuning: start from another run's parameters (fresh optimizer and
  # schedule); a checkpoint of this run, once there is one, takes precedence.
  model, init_step = ckpt.load_trained_model(config.init_from)
  # Saved runs record the resolved layer layout (`scan_layers`); compare it resolved.
  resolved = cfg.replace(scan_layers=cfg.scanned)
  if model.cfg.replace(dtype=cfg.dtype, param_dtype=cfg.param_dtype) != resolved:
    raise ValueError(
      f"config.init_from={config.init_from!r} holds a different model "
      f"({model.cfg}) than config.model ({cfg})."
    )
  echo(f"initialised from {config.init_from} step {init_step}")
  return ckpt.with_config(model, cfg)


def _fit(
  config: ml_collections.ConfigDict,
  workdir: str,
  mesh: jax.sharding.Mesh,
  cfg: ModelConfig | HeadConfig,
  model: nnx.Module,
  teacher: Transformer | None,
  train_data: TokenDataset,
  val_data: TokenDataset,
  stop_after: int | None,
  echo: Callable[[str], None],
  head_loss: heads.LossSettings | None = None,
) -> list[dict[str, float]]:
  """The loop of `train` once everything is checked: restore, step, log, evaluate, save.

  `model` is a `Transformer` (cfg a `ModelConfig`) or a draft head (cfg a
  `HeadConfig`, `head_loss` its objective settings, `teacher` its frozen target).
  """
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(params)
  checkpointer = ckpt.Checkpointer(
    workdir, config.checkpoint_every, config.keep_checkpoints, cleanup_tmp=True
  )
  update = functools.partial(
    _update,
    config=config,
    mesh=mesh,
    train_data=train_data,
    teacher=teacher,
    graphdef=graphdef,
    optimizer=optimizer,
    head_loss=head_loss,
    checkpoint_dir=checkpointer.directory,
  )
  # Closing waits for the save in flight: a run failing for any reason leaves
  # its last checkpoint finished, not a `<step>.orbax-checkpoint-tmp`.
  try:
    start, params, opt_state = _resume(checkpointer, params, opt_state)
    log = _start_log(config, workdir, cfg, model, start, echo)
    history = []
    last = min(stop_after if stop_after is not None else config.num_steps, config.num_steps)
    timer = _Throughput(config.batch_size * config.seq_len)
    for step in range(start + 1, last + 1):
      params, opt_state, record = update(params, opt_state, step)
      history.append(record)
      timer.tick(first=step == start + 1)
      if step % config.log_every == 0 or step == config.num_steps:
        _log_progress(log, record, config, timer)
      if step % config.eval_every == 0 or step == config.num_steps:
        result = validation_metrics(params, teacher, val_data, mesh, config, graphdef, head_loss)
        parts = "  ".join(f"{k} {v:.4f}" for k, v in result.items())
        log(f"eval step {step}: {parts}", {"step": step, "time": time.time(), **result})
      checkpointer.save(
        step, params, opt_state, _meta(config, step), force=step == config.num_steps
      )
  finally:
    checkpointer.close()
  return history


def _resume(checkpointer: ckpt.Checkpointer, params, opt_state) -> tuple[int, Any, Any]:
  """`(start, params, opt_state)`: the latest checkpoint's step and state, or 0 and the
  fresh state when there is none."""
  start = checkpointer.latest_step() or 0
  if start:
    restored = checkpointer.restore(start, params, opt_state)
    params, opt_state = restored["params"], restored["opt_state"]
  return start, params, opt_state


def _start_log(
  config: ml_collections.ConfigDict,
  workdir: str,
  cfg: ModelConfig | HeadConfig,
  model: nnx.Module,
  start: int,
  echo: Callable[[str], None],
) -> _Log:
  """Writes the run's config (process 0) and opens its log at `start`, with a first line."""
  if jax.process_index() == 0:
    ckpt.save_run_config(workdir, cfg)
  log = _Log(workdir, start, echo)
  what = f"{cfg.kind} head, " if isinstance(cfg, HeadConfig) else ""
  log(
    f"{'resuming at' if start else 'starting'} step {start}/{config.num_steps}: "
    f"{head_training.num_params(model):,} params, {what}loss {config.loss}, workdir {workdir}"
  )
  return log


def _update(
  params,
  opt_state,
  step: int,
  *,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  train_data: TokenDataset,
  teacher: Transformer | None,
  graphdef,
  optimizer: optax.GradientTransformation,
  head_loss: heads.LossSettings | None,
  checkpoint_dir: str,
) -> tuple[Any, Any, dict[str, float]]:
  """Update `step` (1-based) on its batch: `(params, opt_state, {"step", "loss", ...})`.

  Raises FloatingPointError, naming `checkpoint_dir` (left as it was), when the
  loss is not finite.
  """
  # Each process reads only its own rows of the global batch.
  rows = train_data.batch(
    step,
    config.batch_size,
    config.seq_len,
    config.seed,
    jax.process_index(),
    jax.process_count(),
  )
  # A head's key (where its settings say the objective draws: EAGLE's feature noise,
  # the block drafters' anchors) is a pure function of (seed, step), like its
  # batches, so a resumed run draws the same noise and anchors as an uninterrupted one.
  keyed = head_loss is not None and head_loss.keyed
  params, opt_state, metrics = train_step(
    params,
    opt_state,
    shard_process_batch(rows, mesh),
    teacher,
    jax.random.fold_in(jax.random.key(config.seed), step) if keyed else None,
    graphdef=graphdef,
    optimizer=optimizer,
    loss=config.loss,
    ce_weight=config.ce_weight,
    head=head_loss,
  )
  record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
  if not math.isfinite(record["loss"]):
    raise FloatingPointError(
      f"step {step}: the loss is {record['loss']}; the last "
      f"checkpoint in {checkpoint_dir} is unaffected."
    )
  return params, opt_state, record


class _Throughput:
  """Tokens per second over the updates of one `train` call after its first (which compiles)."""

  def __init__(self, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.start, self.steps = time.perf_counter(), 0

  def tick(self, first: bool) -> None:
    """Counts an update; the first restarts the clock."""
    if first:
      self.start, self.steps = time.perf_counter(), 0
    else:
      self.steps += 1

  def rate(self) -> float:
    """Tokens per second so far; NaN before a timed update."""
    elapsed = time.perf_counter() - self.start
    return self.steps * self.tokens_per_step / elapsed if self.steps else float("nan")


def _log_progress(
  log: _Log, record: dict[str, Any], config: ml_collections.ConfigDict, timer: _Throughput
) -> None:
  """Adds the rate, learning rate and tokens seen to `record`, and logs it."""
  step = record["step"]
  rate = timer.rate()
  eta = (config.num_steps - step) * timer.tokens_per_step / rate if timer.steps else 0.0
  record.update(
    lr=float(learning_rate_schedule(config)(step - 1)),
    tokens_per_second=rate,
    tokens_seen=step * timer.tokens_per_step,
    time=time.time(),
  )
  log(
    f"step {step}/{config.num_steps}  loss {record['loss']:.4f}  "
    f"lr {record['lr']:.2e}  {rate:,.0f} tok/s  eta {_format_seconds(eta)}",
    record,
  )


def _meta(config: ml_collections.ConfigDict, step: int) -> dict[str, Any]:
  return {
    "step": step,
    "tokens_seen": step * config.batch_size * config.seq_len,
    "config": config.to_dict(),
  }

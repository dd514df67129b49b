"""The HTTP server's job (`experiments/serve.py`): load the models a config names,
warm an engine fitted to their context up, and serve it until SIGINT / SIGTERM.

`load_models`, `load_tokenizer` and `engine_config` are shared with the load
test (`specjax.jobs.load_test`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time

import jax
import ml_collections
from absl import logging

from specjax import dtypes
from specjax.bench.serving.load import MODES
from specjax.jobs import drafters
from specjax.serving import limits
from specjax.serving import mesh as serving_mesh
from specjax.serving.lockstep import Lockstep, broadcast
from specjax.testing import ByteTokenizer, tiny_setup
from specjax.validation import check_int, is_int

MODEL_KINDS = ("bundled", "hf", "tiny")
FIELDS = ("config.model", "config.target", "config.draft")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# How messages about fitting the engine to the model's context name its fields.
FIT_FLAGS = {name: f"--config.{name}" for name in ("prompt_buckets", "max_new_tokens", "gamma")}


def load_models(
  kind: str,
  target: str = "",
  draft: str = "",
  *,
  dtype: str = "float32",
  stop_at_eos: bool = True,
  seed: int = 0,
  need_draft: bool = True,
  fields: tuple[str, str, str] = FIELDS,
):
  """`(target, draft, tokenizer, eos_ids, name)` of the served models.

  Args:
    kind: "bundled" (the pair in `specjax/pretrained`), "hf" (`target` and
      `draft`: checkpoint directories or hub repo ids in the local cache) or
      "tiny" (random tiny models, seed `seed`, and a byte-level tokenizer).
      A non-empty `target` means "hf".
    dtype, stop_at_eos: the weights' dtype name; whether requests stop at the
      checkpoint's EOS ids (`eos_ids` None otherwise, and for "tiny").
    need_draft: False for plain decoding: `draft` is then None (and not loaded).
    fields: the config fields of `kind`, `target` and `draft`, for messages.
  """
  kind = _model_kind(kind, target, draft, fields)
  if kind == "tiny":
    target_model, draft_model, tokenizer = tiny_setup(seed)
    return target_model, draft_model if need_draft else None, tokenizer, None, "tiny"

  import specjax.hf
  from specjax import pretrained

  if kind == "hf" and need_draft and not draft:
    raise ValueError(
      f"{fields[2]} must name the draft checkpoint (or set config.policy='never' to serve "
      "without speculation)."
    )
  models = pretrained.load_checkpoints(
    target if kind == "hf" else "",
    draft if kind == "hf" else "",
    dtype=dtypes.to_dtype(dtype, "config.dtype"),
    need_draft=need_draft,
    fields=fields[1:],
  )
  name = "stdlib_pair"
  if kind == "hf":
    name = target.rstrip("/")
    name = os.path.basename(name) if os.path.isdir(name) else name
  eos = None
  if stop_at_eos:
    eos = list(specjax.hf.generation_settings(models.target_path).eos_ids) or None
  return models.target, models.draft, models.tokenizer, eos, name


def load_tokenizer(
  kind: str,
  target: str = "",
  fields: tuple[str, str, str] = FIELDS,
):
  """The tokenizer `load_models` would return, without loading any weights."""
  kind = _model_kind(kind, target, "", fields)
  if kind == "tiny":
    return ByteTokenizer()
  from specjax import pretrained
  from specjax.data.tokenizer import Tokenizer

  if kind == "bundled":
    return Tokenizer.from_file(pretrained.TOKENIZER_FILE)
  import specjax.hf

  tokenizer = specjax.hf.load_tokenizer(
    specjax.hf.resolve_checkpoint(target, flag=f"--{fields[1]}")
  )
  if tokenizer is None:
    raise ValueError(f"{fields[1]}: {target} has no tokenizer.json.")
  return tokenizer


def chat_template(config: ml_collections.ConfigDict):
  """The served checkpoint's `ChatTemplate` (the bundled pair's own), None for
  "tiny" or a checkpoint without one."""
  from specjax.data.chat import ChatTemplate

  kind = _model_kind(config.model, config.target, config.draft, FIELDS)
  if kind == "tiny":
    return None
  from specjax import pretrained

  if kind == "bundled":
    return ChatTemplate.from_checkpoint(pretrained.PAIR_DIR)
  import specjax.hf

  return ChatTemplate.from_checkpoint(
    specjax.hf.resolve_checkpoint(config.target, flag="--config.target")
  )


def _model_kind(kind: str, target: str, draft: str, fields) -> str:
  if kind not in MODEL_KINDS:
    raise ValueError(f"{fields[0]} must be one of {', '.join(MODEL_KINDS)}, got {kind!r}.")
  if target and kind not in ("bundled", "hf"):
    raise ValueError(f"{fields[1]} names a checkpoint: {fields[0]} must be 'hf', got {kind!r}.")
  if kind == "hf" and not target:
    raise ValueError(f"{fields[0]}='hf' needs {fields[1]} (a checkpoint dir or hub repo id).")
  if not target and draft:
    raise ValueError(f"{fields[2]} needs {fields[1]} (both Hugging Face checkpoints).")
  return "hf" if target else kind


def engine_config(
  config: ml_collections.ConfigDict,
  policy: str | None = None,
  *,
  fit_model: bool = True,
  gamma: int | None = None,
):
  """The `EngineConfig` of `config`'s engine fields, with `policy` if given.

  Args:
    config: a launcher's config with the engine's fields.
    policy: overrides `config.policy`.
    fit_model: `()` prompt buckets and 0 max_new_tokens mean "fit the model's
      context" (None: `specjax.serving.fit_config` derives them, the server's
      defaults); False passes them on as given (the load test's
      max_new_tokens is every request's budget, and must be >= 1).
    gamma: the largest draft length (`drafters.resolve_gamma`'s, for the drafter
      served); None: `config.gamma`, 0 meaning the default at batch 1.
  """
  from specjax.serving import EngineConfig

  buckets, budget = tuple(config.prompt_buckets), config.max_new_tokens
  if fit_model:
    if not is_int(budget) or budget < 0:
      raise ValueError(
        f"max_new_tokens must be an integer >= 0 (0: fit the model's context), got {budget!r}."
      )
    buckets, budget = buckets or None, budget or None
  if gamma is None:
    gamma = config.gamma or drafters.GAMMA_BY_BATCH[1]
  seed = config.get("sampling_seed", config.seed)
  if seed < 0:  # unseeded requests draw differently at each start
    seed = secrets.randbits(63)
  return EngineConfig(
    slots=config.slots,
    gamma=gamma,
    policy=config.policy if policy is None else policy,
    prompt_buckets=buckets,
    max_new_tokens=budget,
    widths=tuple(config.widths) or None,
    seed=seed,
    logprobs=config.get("logprobs", 0),  # the server's; the load test records none
    constraint_states=config.get("constraint_states", 0),
    max_queue=config.get("max_queue", 0),
    verify_lengths=tuple(config.get("verify_lengths", ())) or None,
    forced_drafts=config.get("forced_drafts", True),
    mesh=tuple(config.get("mesh", ())) or None,
    draft_placement=config.get("draft_placement", "replicate"),
    vocab_placement=config.get("vocab_placement", "replicate"),
  )


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the field for a bad server setting (the
  engine's own fields are checked by `EngineConfig`)."""
  policies = tuple(MODES.values())
  if config.policy not in policies:
    raise ValueError(f"config.policy must be one of {', '.join(policies)}, got {config.policy!r}.")
  check_int("config.port", config.port, 0, 65535)
  if config.log_level not in LOG_LEVELS:
    raise ValueError(
      f"config.log_level must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}."
    )
  # The draft model, or the drafter of a head kind: the bundled head of that kind, or
  # config.head's.
  drafters.check_drafter_name(config.drafter, allowed=("model", *drafters.head_drafters()))
  check_int("config.gamma (0: the drafter's default)", config.gamma, 0)
  head = config.get("head") or config.drafter != "model"
  if head and (config.draft or config.policy == "never"):
    what = "config.head" if config.get("head") else f"config.drafter={config.drafter!r}"
    raise ValueError(
      f"{what} drafts in place of config.draft: leave config.draft empty and set a policy "
      f"other than 'never' (got draft={config.draft!r}, policy={config.policy!r})."
    )
  if config.drafter != "model" and not config.get("head"):
    _check_bundled_head(config)
  if not config.shutdown_timeout_s >= 0:
    raise ValueError(
      f"config.shutdown_timeout_s must be a number >= 0, got {config.shutdown_timeout_s!r}."
    )
  try:
    engine_config(config)
  except ValueError as e:  # EngineConfig's messages start with the field's name
    raise ValueError(f"config.{e}") from None
  check_int("config.sampling_seed (-1: random at each start)", config.sampling_seed, -1)
  if config.get("mesh"):  # against this job's devices, before any model loads
    try:
      serving_mesh.resolve(serving_mesh.check_shape(tuple(config.mesh)))
    except ValueError as e:
      raise ValueError(f"config.{e}") from None
  limits.from_config(config)
  if not isinstance(config.api_key, str) or not isinstance(config.allowed_hosts, str):
    raise ValueError("config.api_key and config.allowed_hosts must be strings.")


API_KEY_ENV = "SPECJAX_API_KEY"


def api_key(config: ml_collections.ConfigDict) -> str | None:
  """The key the server requires: `config.api_key`, else $SPECJAX_API_KEY, else None."""
  return config.get("api_key") or os.environ.get(API_KEY_ENV) or None


def allowed_hosts(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  return tuple(h.strip() for h in config.get("allowed_hosts", "").split(",") if h.strip())


def serve(config: ml_collections.ConfigDict) -> None:
  """Loads the models, warms the engine up and serves until SIGINT / SIGTERM.

  In a job of several processes (`--distributed`), every process runs this: all
  build and warm the same engine on one mesh over the job's devices; process 0
  serves HTTP and schedules, the others follow its steps
  (`specjax.serving.lockstep`) until it stops."""
  check_config(config)
  signals = _Shutdown()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signals)

  import uvicorn

  from specjax.serving.background import BackgroundEngine
  from specjax.serving.http import make_app

  engine, tokenizer, name = warm_engine(config)
  lockstep = None
  if jax.process_count() > 1:
    lockstep = Lockstep(engine)
    if not lockstep.leader:
      logging.info("process %d: following process 0's steps", jax.process_index())
      lockstep.follow()
      logging.info("stopped (process 0 closed)")
      return
  background = BackgroundEngine(lockstep or engine)
  signals.serving = True
  key = api_key(config)
  app = make_app(
    background,
    tokenizer,
    name,
    chat_template(config),
    limits=limits.from_config(config),
    api_key=key,
    allowed_hosts=allowed_hosts(config),
  )
  try:
    server = make_server(
      uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=None,  # uvicorn's records go through absl's handler like ours
        timeout_graceful_shutdown=config.shutdown_timeout_s,
      )
    )
    logging.info(
      "serving %s on http://%s:%d (%s)",
      name,
      config.host,
      config.port,
      "API key required" if key else "no API key: anyone who can reach the port may use it",
    )
    if lockstep is not None:  # a dead or stuck process stops the server
      lockstep.on_broken = lambda: setattr(server, "should_exit", True)
      lockstep.keep_alive(background)
    server.run()
  finally:
    app.state.close()
    background.close()
    if lockstep is not None:
      lockstep.close()
  if lockstep is not None and lockstep.broken:
    raise RuntimeError(f"stopped: the job's processes fell out of step: {lockstep.broken}")
  logging.info("stopped")


def _server_class():
  import uvicorn

  class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT / SIGTERM also stops the constraint
    compiles at once (their requests answer 503): a compile in Rust would
    otherwise hold the shutdown for as long as it runs."""

    def handle_exit(self, sig, frame) -> None:
      close = getattr(self.config.app.state, "close", None)
      if close is not None:
        close()
      super().handle_exit(sig, frame)

  return _Server


def make_server(config):
  """A `uvicorn.Server` for `config` that stops compiles on SIGINT / SIGTERM."""
  return _server_class()(config)


class _Shutdown:
  """The SIGINT / SIGTERM handler. A signal before the server starts (loading,
  warm-up) ends the process at once, with code 0 (Python runs the handler when
  the compile under way returns). uvicorn installs its own handlers while it
  serves and raises the signal again once it has shut down: this handler
  absorbs that, so the engine is closed and the process exits normally (code 0)."""

  serving = False

  def __call__(self, signum, _frame) -> None:
    logging.info("%s: shutting down", signal.Signals(signum).name)
    if not self.serving:
      raise SystemExit(0)


def _check_bundled_head(config: ml_collections.ConfigDict) -> None:
  """Raises unless the bundled head of kind `config.drafter` can draft for the
  target `config` names (before any model loads)."""
  drafters.check_bundled_head(config.drafter, _own_target(config))


def _own_target(config: ml_collections.ConfigDict) -> str:
  """ "" for the bundled pair's target, else how messages name the user's."""
  bundled = _model_kind(config.model, config.target, config.draft, FIELDS) == "bundled"
  return "" if bundled else f"config.model={config.model!r}"


def _measured_gamma(target, draft, tokenizer) -> tuple[int, bool]:
  """A block drafter's largest gamma, measured at start-up on a held-out prompt at
  batch 1 (`specjax.bench.gamma_choice`) at temperatures 0 and 1 (a request's default):
  the gamma whose slower speedup of the two is best, and whether it beats plain
  decoding at both."""
  import specjax
  from specjax.bench import gamma_choice
  from specjax.data.prompts import encode_prompts, held_out_prompts
  from specjax.drafting import as_drafter

  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(1))
  candidates = gamma_choice.candidate_gammas(as_drafter(draft).block_size - 1)
  choices = []
  for temperature in (0.0, 1.0):
    shared = dict(
      max_new_tokens=32, sampling=specjax.SamplingParams(temperature=temperature),
      key=jax.random.key(0),
    )  # fmt: skip
    choices.append(
      gamma_choice.choose_gamma(
        lambda g, shared=shared: (
          lambda: specjax.speculative_generate(target, draft, prompts, lengths, gamma=g, **shared)
        ),
        lambda shared=shared: specjax.autoregressive_generate(target, prompts, lengths, **shared),
        candidates,
      )
    )
  gamma, speedup = gamma_choice.worst_case(choices)
  logging.info(
    "block drafter: gamma %d measured at start-up (the slower of its speedups at T=0 and "
    "T=1: %.2fx; by gamma at T=0: %s)",
    gamma,
    speedup,
    ", ".join(f"{g}: {choices[0].plain_ms / ms:.2f}x" for g, ms in choices[0].ms_per_token.items()),
  )
  if speedup < 1.0:
    logging.warning("no gamma beat plain decoding at both temperatures: serving plainly")
  return gamma, speedup >= 1.0


def warm_engine(config: ml_collections.ConfigDict):
  """`(engine, tokenizer, model name)`: the models `config` names, an engine
  fitted to their context and warmed up (every program compiled)."""
  from specjax.serving import Engine, fit_config

  plain = config.policy == "never"
  heads_draft = bool(config.get("head")) or config.drafter != "model"
  target, draft, tokenizer, eos, name = load_models(
    config.model,
    config.target,
    config.draft,
    dtype=config.dtype,
    stop_at_eos=config.stop_at_eos,
    seed=config.seed,
    need_draft=not (plain or heads_draft),
  )
  if heads_draft:
    draft = drafters.build_drafter(
      config.drafter,
      target,
      head=config.get("head", ""),
      own_target=_own_target(config),
      dtype=dtypes.to_dtype(config.dtype, "config.dtype"),
    )
  # The engine's largest draft length (its policy drafts less under load); a block
  # drafter's, by default, measured on this machine (`_measured_gamma`).
  gamma = None if draft is None else drafters.resolve_gamma(config.gamma, draft)
  if draft is not None and not plain and config.gamma == 0 and drafters.is_block(draft):
    gamma, faster = _measured_gamma(target, draft, tokenizer)
    if jax.process_count() > 1:  # every process serves process 0's measurement
      gamma, faster = broadcast((gamma, faster))
    if not faster:  # plain decoding served faster on this machine at both temperatures
      config = config.copy_and_resolve_references()
      config.policy = "never"
  # Prompt buckets and budget fitted to the models' context (derived when left
  # unset, logged), or refused naming the flags, before anything compiles.
  fitted = fit_config(engine_config(config, gamma=gamma), target, draft, names=FIT_FLAGS)
  if jax.process_count() > 1:  # every process samples with process 0's seed
    fitted = dataclasses.replace(fitted, seed=broadcast(fitted.seed))
  logging.info(
    "engine: %d slots, caches of %d positions each (prompt <= %d + new tokens <= %d + "
    "gamma + 1); building the blank batch",
    fitted.slots,
    fitted.max_prompt_len + fitted.max_new_tokens + fitted.gamma + 1,
    fitted.max_prompt_len,
    fitted.max_new_tokens,
  )
  engine = Engine(target, draft, fitted, eos_ids=eos)
  start = time.perf_counter()
  engine.warmup()  # logs a line per program group
  logging.info(
    "warm-up: every program compiled in %.1f s (policy %s, %d slots, prompts up to %d "
    "tokens, up to %d new tokens)",
    time.perf_counter() - start,
    config.policy,
    config.slots,
    engine.config.max_prompt_len,
    engine.config.max_new_tokens,
  )
  return engine, tokenizer, config.model_name or name

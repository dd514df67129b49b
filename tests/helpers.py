"""Test helpers shared across test files (tiny configs, statistics, drafters).

Importable as `helpers` from any test: pytest puts tests/ on sys.path because
tests/conftest.py lives there.
"""

import collections
import contextlib
import functools

import jax
import numpy as np
from flax import nnx
from scipy import stats

import specjax
from specjax import heads
from specjax.drafting import ModelDrafter, NGramDrafter, count_drafter, layer_skip
from specjax.heads import config as head_config
from specjax.heads import make_head

# Compiler options for the sampling simulations that run 10^6 iterations in one
# program (tests/test_verify_exactness.py, tests/test_tree_verify.py). The suite
# compiles at --xla_backend_optimization_level=0 (tests/conftest.py), right for
# model programs that run briefly; one such simulation ran 17.8 s at level 0
# against 1.7 s at level 1, whose compile costs about 6 s more (2-core AMD EPYC,
# 2026-12-02).
SIMULATION_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}

# The tiny target every generation test shares, and the draft's overrides of it.
# The serving tests' engine (tests/test_serving*.py, tests/test_load_test.py): one
# shape set for all, on `specjax.testing.tiny_setup`'s models, so each
# program compiles once per suite.
SERVING_ENGINE = dict(slots=4, gamma=3, prompt_buckets=(32,), max_new_tokens=16, widths=(2, 4))

TINY = dict(
  vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128
)
TINY_DRAFT = dict(d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, n_layers=1)
# Gemma 2/3's features on top of TINY: layer 0 local (a 3-token window, its own
# RoPE base), layer 1 global; soft-caps, sandwich norms, GeGLU, q/k norms.
GEMMA_STYLE = dict(
  sliding_window=3,
  local_layers=(0,),
  rope_local_theta=100.0,
  norm_offset=1.0,
  sandwich_norms=True,
  scale_embeddings=True,
  mlp="geglu",
  qk_norm=True,
  attn_scale=0.3,
  attn_softcap=5.0,
  logit_softcap=10.0,
  tie_embeddings=True,
)


def pytest_process(args: list[str], python: str | None = None, env: dict | None = None):
  """`python -m pytest -q -p no:cacheprovider *args` started in the repository
  root in a process of its own (default: this interpreter and environment),
  stdout and stderr piped together, for `suite_output`."""
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen(
    [python or sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
    cwd=root,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def suite_output(suite, timeout: float = 1500) -> str:
  """The output of a test suite started in its own process (`pytest_process`),
  waiting at most `timeout` seconds before killing it (then said at its end)."""
  import subprocess

  try:
    return suite.communicate(timeout=timeout)[0]
  except subprocess.TimeoutExpired:
    suite.kill()
    return suite.communicate()[0] + f"\n[killed after {timeout} s]"


def tiny_pair(**overrides) -> tuple[specjax.Transformer, specjax.Transformer]:
  """(target, draft) of the TINY config (with `overrides` on both), seeds 0 and 1."""
  cfg = specjax.ModelConfig(**{**TINY, **overrides})
  return (
    specjax.Transformer(cfg, rngs=nnx.Rngs(0)),
    specjax.Transformer(cfg.replace(**TINY_DRAFT), rngs=nnx.Rngs(1)),
  )


# What JAX records each time `jax.jit` traces a function into a new program (a
# call whose shapes and static arguments the function's cache already holds
# records nothing).
JAXPR_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def traces():
  """Counts the programs `jax.jit` traces inside the block, by function name.

  Observed from outside through `jax.monitoring`: tests prove "no recompilation"
  by an empty count, e.g. `with traces() as traced: ...; assert not traced`.
  Only top-level traces are recorded (a jitted function called inside another
  is part of that program).
  """
  counts: collections.Counter = collections.Counter()

  def listen(event, duration, **kwargs):
    del duration
    if event == JAXPR_TRACE_EVENT:
      counts[kwargs.get("fun_name")] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


@jax.jit
def full_logits(model, tokens):
  """`model(tokens)`: `[B, T]` -> `[B, T, V]` logits, as one compiled program.

  Run eagerly, a forward compiles each of its operations as a program of its
  own (about 60 per new input shape, seconds on a small CPU); the tests'
  reference forwards go through this instead."""
  return model(tokens)


@functools.partial(jax.jit, static_argnames=("options",))
def _forward_cached(model, tokens, cache, options):
  return model.forward_cached(tokens, cache, **dict(options))


def forward_cached(model, tokens, cache, **options):
  """`model.forward_cached(tokens, cache, **options)` as one compiled program
  (`options` static: `return_hidden`, `num_layers`)."""
  return _forward_cached(model, tokens, cache, tuple(sorted(options.items())))


def head_drafter(kind: str, target, seed: int = 7, **settings):
  """A drafter of `kind` with a fresh (untrained) head for `target`."""
  head = make_head(head_config(kind, target.cfg, **settings), rngs=nnx.Rngs(seed))
  return heads.drafter(target, head)


def dspark_drafter(target, seed: int = 7, **settings):
  """A sequential block drafter (fresh) whose Markov head is random, not zero as a
  fresh one's: each law really depends on the token drafted before it."""
  drafter = head_drafter(
    "dspark", target, seed, **{"block_size": 4, "draft_layers": 2, "markov_rank": 8, **settings}
  )
  head = drafter.head
  if head.cfg.markov_rank:
    w2 = jax.random.normal(jax.random.key(seed), head.markov_w2[...].shape) * 2.0
    head.markov_w2[...] = w2.astype(head.markov_w2[...].dtype)
  return drafter


def _corpus(vocab_size: int) -> list[np.ndarray]:
  """20 random documents of 40 ids, skewed towards small ids (a corpus to count)."""
  rng = np.random.default_rng(0)
  weights = 1.0 / np.arange(1, vocab_size + 1)
  return [rng.choice(vocab_size, 40, p=weights / weights.sum()) for _ in range(20)]


def make_drafter(name: str, target, draft, max_ngram: int = 3):
  """The drafter called `name` ("model", "model_one_width", "ngram", "layer_skip", "eagle",
  "medusa", "early_exit", "dflash", "dspark", "unigram" or "bigram"; heads fresh) for
  `target`."""
  return {
    "model": lambda: draft,
    # The accelerators' draft loop (one model width per iteration), forced on the CPU.
    "model_one_width": lambda: ModelDrafter(draft, one_width=True),
    "ngram": lambda: NGramDrafter(target.cfg.vocab_size, max_ngram=max_ngram),
    "layer_skip": lambda: layer_skip(target, 1),
    "eagle": lambda: head_drafter("eagle", target),
    "medusa": lambda: head_drafter("medusa", target),
    "early_exit": lambda: head_drafter("early_exit", target, exit_layer=1),
    "dflash": lambda: head_drafter("dflash", target, block_size=4, draft_layers=2),
    "dspark": lambda: dspark_drafter(target),
    # Count drafters of a random corpus (documents of 40 ids).
    "unigram": lambda: count_drafter(_corpus(target.cfg.vocab_size), target.cfg.vocab_size, 1),
    "bigram": lambda: count_drafter(_corpus(target.cfg.vocab_size), target.cfg.vocab_size, 2),
    # FR-Spec: drafting among the even ids only (q = 0 on the others).
    "eagle_subset": lambda: head_drafter("eagle", target).with_vocab_subset(
      np.arange(0, target.cfg.vocab_size, 2)
    ),
  }[name]()


def copy_corpus(root, files_per_split: dict[str, int]) -> str:
  """Copies the first files of each stdlib split under `root` (a pathlib.Path):
  a corpus small enough to tokenize and train on in a test."""
  from specjax.data.corpus import copy_subset

  return copy_subset(str(root), files_per_split)


def tiny_token_data(path: str, corpus_root: str) -> str:
  """A 512-id tokenizer trained on `corpus_root` and its token files, in `path`."""
  import os

  from specjax.data import corpus_files, prepare_splits, train_tokenizer

  tokenizer = train_tokenizer(corpus_files("train", corpus_root), vocab_size=512)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  prepare_splits(path, tokenizer, corpus_root, log=lambda _: None)
  return path


def chisquare_pvalue(observed, probs) -> float:
  """Chi-square goodness-of-fit p-value, pooling the cells with expected count < 5.

  Args:
    observed: counts per cell (any shape).
    probs: the law of the cells (same size; need not be normalised).

  Cells of probability zero must never be observed (asserted) and are dropped.
  """
  observed, probs = np.asarray(observed).ravel(), np.asarray(probs).ravel()
  impossible = probs <= 0
  assert observed[impossible].sum() == 0, "observed an outcome of probability zero"
  observed, probs = observed[~impossible], probs[~impossible]
  expected = probs / probs.sum() * observed.sum()
  order = np.argsort(expected)
  observed, expected = observed[order], expected[order]
  # Pool every cell expected fewer than 5 times (and, if that pool is still
  # under 5, the next smallest cells), as the chi-square approximation needs.
  small = int(np.sum(expected < 5))
  if small:
    small = max(small, int(np.searchsorted(np.cumsum(expected), 5.0)) + 1)
  if small:
    observed = np.concatenate([[observed[:small].sum()], observed[small:]])
    expected = np.concatenate([[expected[:small].sum()], expected[small:]])
  if len(observed) < 2:
    return 1.0  # a single possible cell: nothing to test beyond the zero cells
  return stats.chisquare(observed, expected).pvalue


def sequence_counts(tokens, vocab_size: int) -> np.ndarray:
  """`[N, T]` sampled sequences -> counts `[V ** T]` of each sequence (row-major)."""
  tokens = np.asarray(tokens)
  flat = np.ravel_multi_index(tuple(tokens.T), (vocab_size,) * tokens.shape[1])
  return np.bincount(flat, minlength=vocab_size ** tokens.shape[1])


def word_tokenizer(words, specials=()):
  """A `tokenizers.Tokenizer` of whole strings (no pre-tokenizer), ids in the order
  of `words`, those in `specials` marked special; unknown text is words[0]."""
  from tokenizers import Tokenizer, models

  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  tok.add_special_tokens(list(specials))
  return tok


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a snapshot's commit in `hub_cache`


def hub_cache(root, repo: str, source, commit: str = COMMIT, ref: str = "main") -> str:
  """Puts checkpoint directory `source` into `root` (a pathlib.Path) as the Hugging
  Face cache's snapshot of `repo` at `commit`, which `ref` points to."""
  import shutil

  repo_dir = root / f"models--{repo.replace('/', '--')}"
  shutil.copytree(source, repo_dir / "snapshots" / commit)
  (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
  (repo_dir / "refs" / ref).write_text(commit)
  return str(root)


class Schedule:
  """A serving engine's policy that cycles through draft lengths: plain and
  speculative steps mix, so the drafter is re-synced after plain runs."""

  kind = "schedule"

  def __init__(self, gammas):
    self.gammas, self.i = gammas, 0

  def choose(self, width):
    self.i += 1
    return self.gammas[self.i % len(self.gammas)]

  def observe(self, *args, **kwargs):
    pass


def serve_app(app, make_server=None, **config):
  """Runs the ASGI `app` with uvicorn on a free local port, in a daemon thread, and
  waits until it has started (at most 30 s); returns `(url, server, thread)`.
  `make_server` builds the server from its `uvicorn.Config` (default
  `uvicorn.Server`); `config` adds `uvicorn.Config` fields."""
  import socket
  import threading
  import time

  import uvicorn

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  options = dict(host="127.0.0.1", port=port, log_level="warning", log_config=None)
  server = (make_server or uvicorn.Server)(uvicorn.Config(app, **options, **config))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not server.started and thread.is_alive() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert server.started
  return f"http://127.0.0.1:{port}", server, thread

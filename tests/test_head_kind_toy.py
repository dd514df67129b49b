"""A new draft-head kind is one file (issue 62, requirement 3): this module defines a toy
kind (one linear layer over the target's last hidden state, drafting one token), registers
it, and with no other file changed it trains through `experiments.train`'s code path,
drafts exactly, saves and loads its run directory, and serves through the engine.
docs/heads.md ("Adding a kind") walks through the same kind.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import specjax
from configs import train_tiny
from experiments import train as train_launcher
from helpers import TINY, copy_corpus, tiny_token_data
from specjax import heads, losses
from specjax.coupling import sample_tokens
from specjax.drafting import DrafterBase, Proposal
from specjax.sampling import warp_probs

# -- the kind: everything it is, in one place


@dataclasses.dataclass(frozen=True)
class ToyConfig(heads.HeadConfig):
  """A toy head's settings: none of its own (`HeadConfig`'s target is all it needs)."""

  kind = "toy"


class ToyHead(nnx.Module):
  """f -> f + W f over the target's last-layer feature f `[..., D]` (W starts at zero:
  a fresh head predicts the target's own next law one position early)."""

  def __init__(self, cfg: ToyConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.target.d_model
    self.proj = heads.base.linear(cfg.target, d, d, rngs=rngs, zero=True)

  def __call__(self, features: jax.Array) -> jax.Array:
    return features + self.proj(features)


@struct.dataclass
class ToyDrafter(DrafterBase):
  """Drafts one token per iteration from the target's feature at s[-2]'s position."""

  target: specjax.Transformer
  head: ToyHead
  target_features = True
  preferred_gamma = 1

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    return jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

  def propose(self, feature, recent, key, limit, *, gamma, sampling):
    logits = self.target.features_to_logits(self.head(feature))  # [B, V]: after s[-1]
    if sampling.greedy:
      token, q = jnp.argmax(logits, -1).astype(jnp.int32), None
    else:
      q = warp_probs(logits, sampling)
      token = sample_tokens(key, q)
    tokens = jnp.repeat(token[:, None], gamma, axis=1)  # [B, gamma]: the first is proposed
    probs = None if q is None else jnp.repeat(q[:, None], gamma, axis=1)
    return Proposal(tokens, probs, jnp.minimum(limit, 1), calls=jnp.int32(1)), feature

  def commit(self, feature, commit):
    kept = commit.new_length - commit.old_length  # hidden[kept - 1] predicted s'[-1]
    new = jnp.take_along_axis(commit.hidden, (kept - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(commit.goes_on[:, None], new, feature)


def toy_objective(head, target, batch, key, *, loss, settings):
  """The head at t against the target's law at t + 1 (what it drafts)."""
  del key, settings
  inputs = batch[:, :-1]
  p_logits, features = losses.target_outputs(target, inputs, True)
  q_logits = target.features_to_logits(head(features[:, :-1]))
  metrics = losses.law_metrics(loss, p_logits[:, 1:], q_logits, batch[:, 2:])
  return metrics["distill"], metrics


KIND = heads.HeadKind(
  name="toy",
  title="toy head",
  config=ToyConfig,
  make=ToyHead,
  drafter=ToyDrafter,
  holds="head",
  objective=toy_objective,
  training=heads.TrainingRules(fields=("d_ff",)),
  bundled=False,
)

# -- the proof


@pytest.fixture(scope="module")
def registered():
  heads.register(KIND)
  yield KIND
  heads.unregister(KIND.name)


@pytest.fixture(scope="module")
def run(registered, tmp_path_factory):
  """A toy head trained for one step on a tiny saved target, through the launcher's
  `train` (experiments/train.py's call); `(run dir, target dir)`."""
  from specjax.hf.export import save_model

  root = tmp_path_factory.mktemp("toy")
  target_dir = str(root / "target")
  cfg = specjax.ModelConfig(**{**TINY, "init_std": 0.1})
  save_model(specjax.Transformer(cfg, rngs=nnx.Rngs(0)), target_dir, dtype="float32")
  corpus = copy_corpus(root / "corpus", {"train": 4, "validation": 1, "test": 1})
  config = train_tiny.get_config()
  config.data.root = corpus
  (root / "data").mkdir()
  config.data.dir = tiny_token_data(str(root / "data"), corpus)
  config.loss = "kl"
  config.num_steps, config.warmup_steps, config.checkpoint_every, config.eval_every = 1, 0, 1, 1
  config.head.update(kind="toy", target=target_dir)
  workdir = str(root / "run")
  train_launcher.train(config, workdir, echo=lambda _: None)
  return workdir, target_dir


def test_a_new_kind_trains_drafts_exactly_saves_loads_and_serves(run, tmp_path):
  from specjax.serving import Engine, EngineConfig, Request
  from specjax.training import heads as head_training
  from specjax.training import load_head_config, load_trained_head

  workdir, target_dir = run
  # Its run directory: its own config class, and the head it trained.
  assert type(load_head_config(workdir)) is ToyConfig
  head, step = load_trained_head(workdir)
  assert step == 1 and isinstance(head, ToyHead)
  assert np.any(np.asarray(head.proj.kernel[...]))  # trained away from its zero start
  target = head_training.load_target(target_dir)
  # Saved and loaded by path (specjax's layout) bit-identically.
  specjax.hf.save_head(head, str(tmp_path / "toy"), layout="specjax")
  back = specjax.hf.load_head(str(tmp_path / "toy"), target)
  np.testing.assert_array_equal(back.proj.kernel[...], head.proj.kernel[...])
  # Exact drafting: greedy speculative decoding is plain greedy decoding.
  drafter = specjax.hf.load_drafter(workdir, target)
  assert type(drafter) is ToyDrafter
  prompts = jnp.asarray([[5, 9, 2, 7, 1, 3], [4, 4, 8, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([6, 3], jnp.int32)
  greedy = dict(max_new_tokens=12, sampling=specjax.GREEDY)
  plain = specjax.autoregressive_generate(target, prompts, lengths, **greedy)
  spec = specjax.speculative_generate(target, drafter, prompts, lengths, gamma=1, **greedy)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert int(spec.stats.accepted.sum()) > 0  # it drafted, and some drafts survived
  # Served: the engine's greedy completions are plain greedy decoding's too.
  engine = Engine(
    target, drafter, EngineConfig(slots=2, gamma=1, prompt_buckets=(8,), max_new_tokens=12)
  )
  done = engine.run(
    [
      Request(prompt=[5, 9, 2, 7, 1, 3], max_new_tokens=12),
      Request(prompt=[4, 4, 8], max_new_tokens=12),
    ]
  )
  for row, completion in enumerate(done):
    n = int(plain.num_generated[row])
    assert completion.tokens == np.asarray(plain.tokens[row, :n]).tolist()

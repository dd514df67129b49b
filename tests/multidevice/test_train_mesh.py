"""One command for your own target and data (issue 32): an EAGLE head, and a block
drafter (DFlash: random anchors from the step's key), trained on a mesh of 8
devices (data 4 x model 2: the frozen target sharded by the logical-axis rules, the
batch split over data) follow the one-device run's loss curve."""

import numpy as np
import pytest

from configs import train_tiny
from data_fixtures import user_chats, user_checkpoint
from helpers import copy_corpus
from specjax.training import train

# float32 sums in another order (sharded matmuls' partial sums, the data-parallel
# gradient mean): measured within 1.6e-7 relative over the 4 steps, on 4x2 and 8x1
# (2-core AMD EPYC, 2026-12-03).
RTOL = 1e-5


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  corpus = copy_corpus(tmp_path_factory.mktemp("stdlib"), {"train": 6, "validation": 1, "test": 1})
  root = str(tmp_path_factory.mktemp("user"))
  return user_checkpoint(f"{root}/target", corpus), user_chats(root, corpus)


HEADS = {
  "eagle": dict(kind="eagle", d_ff=64, feature_noise=0.1),
  "dflash": dict(kind="dflash", d_ff=64, block_size=4, draft_layers=2, num_anchors=8),
}


def _run(target, chats, workdir, mesh_shape, devices, kind="eagle"):
  config = train_tiny.get_config()  # batch 4 x 32 tokens
  config.update(loss="kl", num_steps=4, batch_size=8, eval_every=4, checkpoint_every=4)
  config.update(mesh_shape=mesh_shape, mesh_devices=devices)
  config.data.update(files=chats, validation_every=6)
  config.head.update(target=target, **HEADS[kind])
  return train(config, workdir, echo=lambda _: None)


@pytest.mark.parametrize("kind", HEADS)
def test_head_on_a_mesh_of_8_follows_one_device(tmp_path, user, kind):
  target, chats = user
  one = _run(target, chats, str(tmp_path / "one"), (1, 1), 1, kind)
  mesh = _run(target, chats, str(tmp_path / "mesh"), (4, 2), 8, kind)
  for key in ("loss", "alpha_t1", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in mesh], [r[key] for r in one], rtol=RTOL)
  assert one[-1]["loss"] < one[0]["loss"]  # it learns, on both

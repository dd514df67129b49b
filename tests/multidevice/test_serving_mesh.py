"""The serving engine on meshes 8x1, 2x4 and 1x8 serves what one device serves.

Greedy and seeded requests, with speculation on (policy "always"), through the
engine and through the HTTP server, drafting with a draft model and with an
EAGLE head: the tokens equal the single-device engine's. On the mesh the
caches stay split (rows over data, kv heads over model) and nothing compiles
after warm-up.
"""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import specjax
from helpers import head_drafter, serve_app, traces
from specjax.bench import hlo
from specjax.serving import Engine, EngineConfig, Request
from specjax.serving import slots as programs
from specjax.serving.background import BackgroundEngine
from specjax.serving.http import make_app
from specjax.testing import ByteTokenizer

# Heads and kv heads that a model axis of 4 divides (8 splits the heads, not the kv
# heads: those caches are replicated over `model`); vocabulary 256 for the byte tokenizer.
CFG = specjax.ModelConfig(
  vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, max_seq_len=64
)
BASE = dict(slots=8, gamma=3, policy="always", prompt_buckets=(16,), max_new_tokens=12)
SAMPLED = specjax.SamplingParams(temperature=0.8, top_p=0.95)
PROGRAMS = {"_step", "_admit", "_move", "_release", "_resync", "_blank", "_shift_constraints"}


@pytest.fixture(scope="module")
def models():
  target = specjax.Transformer(CFG, rngs=nnx.Rngs(0))
  small = CFG.replace(d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, n_layers=1)
  draft = specjax.Transformer(small, rngs=nnx.Rngs(1))
  return {"model": (target, draft), "eagle": (target, head_drafter("eagle", target, d_ff=64))}


def _requests():
  """Greedy and seeded sampled requests of assorted lengths and budgets."""
  rng = np.random.default_rng(0)
  return [
    Request(
      prompt=rng.integers(0, 256, int(rng.integers(1, 15))).tolist(),
      max_new_tokens=int(rng.integers(3, 13)),
      sampling=specjax.GREEDY if i % 2 == 0 else SAMPLED,
      seed=None if i % 2 == 0 else 1000 + i,
    )
    for i in range(10)
  ]


@pytest.fixture(scope="module")
def single(models):
  """The single-device engines' tokens, by drafter."""
  return {
    kind: [c.tokens for c in Engine(*pair, EngineConfig(**BASE, widths=(8,))).run(_requests())]
    for kind, pair in models.items()
  }


@pytest.mark.parametrize(
  "shape, kind, placement, widths",
  [
    ((8, 1), "model", "replicate", (8,)),
    ((2, 4), "model", "shard", (4, 8)),  # narrow steps: each block's first rows; vocab split
    ((2, 4), "eagle", "replicate", (8,)),
    ((1, 8), "eagle", "shard", (2, 8)),
  ],
)
def test_engine_on_a_mesh_serves_what_one_device_serves(
  models, single, shape, kind, placement, widths
):
  # The vocabulary split over `model` with a split draft, copied with a replicated one.
  config = EngineConfig(
    **BASE, widths=widths, mesh=shape, draft_placement=placement, vocab_placement=placement
  )
  engine = Engine(*models[kind], config)
  engine.warmup(timed_runs=0)
  with traces() as traced:
    done = engine.run(_requests())
  assert not PROGRAMS & set(traced), dict(traced)  # warm-up compiled every program
  assert [c.tokens for c in done] == single[kind]
  assert sum(c.proposed for c in done) > 0  # speculation was on
  mesh = engine.mesh
  assert dict(mesh.shape) == {"data": shape[0], "model": shape[1]}
  cache = engine.runner.state.spec.target_cache.k[0]  # [B, K, S, H]
  kv_split = "model" if CFG.n_kv_heads % shape[1] == 0 and shape[1] > 1 else None
  expected = PartitionSpec("data" if shape[0] > 1 else None, kv_split)
  assert cache.sharding.is_equivalent_to(NamedSharding(mesh, expected), 4)
  qkv = engine.target.layers[0].attn.qkv_proj.kernel.get_value()
  assert qkv.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "model")), 2)
  if placement == "shard":
    return  # a split head whose kv heads 8 does not divide gathers its own cache (docs)
  # No program moves a cache between devices: every collective of the drafting
  # step and of a row move exchanges less than one layer's keys.
  layer = cache.nbytes
  step = engine.lowered_step(BASE["gamma"]).compile().as_text()
  source, dest = engine.runner.put((np.int32(5), np.int32(0)))
  move = programs.move.lower(engine.runner.state, source, dest, mesh=mesh).compile().as_text()
  for text in (step, move):
    big = [op for op in hlo.collectives(text, 8) if op.bytes >= layer]
    assert not big, (layer, big)


@pytest.mark.parametrize("kind, shape", [("model", (2, 4)), ("eagle", (1, 8))])
def test_http_on_a_mesh_answers_what_one_device_answers(models, kind, shape):
  """Two servers, one device and a mesh: the same completions, greedy and seeded."""
  bodies = [
    {"prompt": "def add(a, b):\n", "max_tokens": 10, "temperature": 0},
    {"prompt": "import os\n", "max_tokens": 10, "temperature": 0.8, "seed": 5},
    {"prompt": "x = [", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 11, "n": 2},
  ]
  texts = []
  for mesh in (None, shape):
    engine = Engine(*models[kind], EngineConfig(**BASE, widths=(8,), mesh=mesh))
    engine.warmup(timed_runs=0)
    background = BackgroundEngine(engine)
    url, server, thread = serve_app(make_app(background, ByteTokenizer(), "tiny"))
    try:
      with httpx.Client(base_url=url, timeout=60) as client:
        answers = [client.post("/v1/completions", json=body) for body in bodies]
      assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
      texts.append([[c["text"] for c in a.json()["choices"]] for a in answers])
    finally:
      server.should_exit = True
      thread.join(10)
      background.close()
  assert texts[0] == texts[1]
  assert texts[0][1] != texts[0][0]  # the seeded request sampled


def test_a_mesh_that_does_not_fit_is_refused_naming_it(models):
  with pytest.raises(ValueError, match=r"mesh \(4, 4\) does not fit this job's 8 cpu"):
    Engine(*models["model"], EngineConfig(**BASE, mesh=(4, 4)))
  assert jax.device_count() == 8


def test_collectives_are_read_from_the_hlo_with_their_groups_and_trips():
  from specjax.distributed import make_mesh

  mesh = make_mesh((2, 4))
  x = jax.device_put(
    np.ones((8, 16), np.float32), NamedSharding(mesh, PartitionSpec(None, "model"))
  )

  def looped(x):  # one reduction over `model` per trip
    return jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(x * i.astype(x.dtype), axis=1), x[:, 0])

  ops = hlo.collectives(jax.jit(looped).lower(x).compile().as_text(), 8)
  reduce = [op for op in ops if op.opcode == "all-reduce"]
  assert any(op.times == 3 for op in reduce), ops  # in the loop: once per trip
  assert {op.group for op in reduce} <= {4, 8} and any(op.group == 4 for op in reduce), ops
  summary = hlo.collective_summary(ops)
  assert summary["all-reduce"]["count"] == sum(op.times for op in reduce)
  assert summary["all-reduce"]["link_bytes"] == pytest.approx(  # ring: 2 (g - 1) / g
    sum(op.times * op.bytes * 2 * (op.group - 1) / op.group for op in reduce)
  )
  one = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32)).compile().as_text()
  assert hlo.collectives(one, 1) == []

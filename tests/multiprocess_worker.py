"""One process of the two-process test (tests/test_multiprocess.py).

  python tests/multiprocess_worker.py PROCESS_ID PORT OUT_JSON

Two such processes, 4 CPU devices each, join through `jax.distributed` on a
loopback coordinator, build the same tiny models, place them on a 2x4 mesh
spanning both processes, and run one sharded speculative_generate call.
Process 0 writes the gathered tokens to OUT_JSON.
"""

import json
import os
import sys

# The compile flags of tests/conftest.py, so the single-process reference
# (computed under them) compares like with like.
os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
  "--xla_cpu_use_fusion_emitters=false"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: str, out: str) -> None:
  from specjax.distributed.launch import initialize

  initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.process_count() == 2 and jax.device_count() == 8
  assert jax.local_device_count() == 4

  from jax.experimental import multihost_utils

  import specjax
  from specjax import distributed as dist

  sys.path.insert(0, os.path.dirname(__file__))
  from test_multiprocess import make_inputs

  target, draft, prompts, lengths, kwargs = make_inputs()
  mesh = dist.make_mesh((2, 4))
  target = dist.shard_model(target, mesh)
  draft = dist.shard_model(draft, mesh, replicate=True)
  with jax.set_mesh(mesh):
    result = specjax.speculative_generate(
      target, draft, dist.shard_batch(prompts, mesh), dist.shard_batch(lengths, mesh), **kwargs
    )
  tokens = multihost_utils.process_allgather(result.tokens, tiled=True)
  if jax.process_index() == 0:
    with open(out, "w") as f:
      json.dump({"tokens": tokens.tolist(), "devices": jax.device_count()}, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

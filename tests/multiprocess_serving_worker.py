"""One process of the two-process server test (tests/test_multiprocess.py).

  python tests/multiprocess_serving_worker.py PROCESS_ID PORT OUT_JSON [DIE_AFTER_STEPS]

Two such processes, 4 CPU devices each, join through `jax.distributed` on a
loopback coordinator and build the same engine on a 2x4 mesh spanning both.
Process 0 serves it over HTTP (`specjax.serving.lockstep`: it schedules, both
step), sends itself the test's completion requests as a client would, and
writes the answers to OUT_JSON; process 1 follows its steps. With
DIE_AFTER_STEPS, process 1 exits abruptly after that many steps: process 0
must then stop with an error, not wait.
"""

import json
import os
import sys
import threading

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
  "--xla_cpu_use_fusion_emitters=false"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: str, out: str, die_after: int = 0) -> None:
  from specjax.distributed.launch import initialize

  initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    heartbeat_timeout_seconds=10,
  )
  assert jax.process_count() == 2 and jax.device_count() == 8

  import httpx

  from specjax.serving import Engine
  from specjax.serving.background import BackgroundEngine
  from specjax.serving.http import make_app
  from specjax.serving.lockstep import Lockstep
  from specjax.testing import ByteTokenizer

  sys.path.insert(0, os.path.dirname(__file__))
  from test_multiprocess import BODIES, serving_config, serving_models

  from helpers import serve_app

  engine = Engine(*serving_models(), serving_config(mesh=(2, 4)))
  engine.warmup(timed_runs=0)
  lockstep = Lockstep(engine)
  if process_id == 1:
    if die_after:
      step, steps = engine.step, [0]

      def dying_step(**kwargs):
        steps[0] += 1
        if steps[0] > die_after:
          os._exit(17)  # no goodbye: as a crashed host
        return step(**kwargs)

      engine.step = dying_step
    lockstep.follow()
    return
  broken = threading.Event()
  lockstep.on_broken = broken.set
  background = BackgroundEngine(lockstep)
  url, server, thread = serve_app(make_app(background, ByteTokenizer(), "tiny"))
  answers = []
  try:
    with httpx.Client(base_url=url, timeout=120) as client:
      for body in BODIES:
        response = client.post("/v1/completions", json=body)
        answers.append({"status": response.status_code, "body": response.json()})
  finally:
    server.should_exit = True
    thread.join(10)
    background.close()
    lockstep.close()
  with open(out, "w") as f:
    json.dump({"answers": answers, "broken": lockstep.broken}, f)
  if lockstep.broken:
    sys.exit(3)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:]))

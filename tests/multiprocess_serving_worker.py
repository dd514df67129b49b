"""One process of the two-process server test (tests/test_multiprocess.py).

  python tests/multiprocess_serving_worker.py PROCESS_ID PORT OUT_JSON [DIE_AFTER_STEPS]
  python tests/multiprocess_serving_worker.py PROCESS_ID PORT OUT_JSON constrained

Two such processes, 4 CPU devices each, join through `jax.distributed` on a
loopback coordinator and build the same engine on a 2x4 mesh spanning both.
Process 0 serves it over HTTP (`specjax.serving.lockstep`: it schedules, both
step), sends itself the test's completion requests as a client would, and
writes the answers to OUT_JSON; process 1 follows its steps. With
DIE_AFTER_STEPS, process 1 exits abruptly after that many steps: process 0
must then stop with an error, not wait. With `constrained` the engine has a
constraint table and the requests are `CONSTRAINED_BODIES`: sent one by one
(their automata compiled and cached), then the first and, once it runs, the
others at once (both rounds' answers are written, and the leader's counters).
"""

import concurrent.futures
import json
import os
import sys
import threading
import time

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
  "--xla_cpu_use_fusion_emitters=false"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: str, out: str, mode: str = "") -> None:
  constrained = mode == "constrained"
  die_after = 0 if constrained or not mode else int(mode)
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
  from test_multiprocess import BODIES, CONSTRAINED_BODIES, serving_config, serving_models

  from helpers import serve_app

  config = serving_config(mesh=(2, 4), constrained=constrained)
  engine = Engine(*serving_models(), config, eos_ids=0 if constrained else None)
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
      for body in CONSTRAINED_BODIES if constrained else BODIES:
        answers.append(_answer(client.post("/v1/completions", json=body)))
      overlapping = [_answer(r) for r in _overlapping(client, engine)] if constrained else None
  finally:
    server.should_exit = True
    thread.join(10)
    background.close()
    lockstep.close()
  with open(out, "w") as f:
    written = {"answers": answers, "broken": lockstep.broken, "counters": engine.counters}
    json.dump(written | ({"overlapping": overlapping} if constrained else {}), f)
  if lockstep.broken:
    sys.exit(3)
  jax.distributed.shutdown()


def _overlapping(client, engine) -> list:
  """`CONSTRAINED_BODIES`' responses: the first sent, the others at once while it
  runs (the leader reuses its cached automata; the engine is read for whether
  the first holds a slot yet)."""
  from test_multiprocess import CONSTRAINED_BODIES

  with concurrent.futures.ThreadPoolExecutor(len(CONSTRAINED_BODIES)) as pool:
    first = pool.submit(client.post, "/v1/completions", json=CONSTRAINED_BODIES[0])
    while not engine.live_requests() and not first.done():
      time.sleep(0.005)
    rest = [pool.submit(client.post, "/v1/completions", json=b) for b in CONSTRAINED_BODIES[1:]]
    return [first.result()] + [f.result() for f in rest]


def _answer(response) -> dict:
  return {"status": response.status_code, "body": response.json()}


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3], *sys.argv[4:])

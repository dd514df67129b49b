"""Serve completions over HTTP: continuous batching with speculation, OpenAI-style API.

  python -m experiments.serve                       # the bundled pair on 127.0.0.1:8000
  python -m experiments.serve --config.port=8080 --config.policy=always --config.slots=16
  python -m experiments.serve --config.target=Qwen/Qwen2.5-1.5B --config.draft=Qwen/Qwen2.5-0.5B
  python -m experiments.serve --config.model=tiny   # random tiny models: a smoke test
  python -m experiments.serve --config.mesh='(1, 8)'  # tensor parallel over 8 devices

  J='Content-Type: application/json'    # the JSON endpoints take no other (415)
  curl -H "$J" localhost:8000/v1/completions -d '{"prompt": "def f(a, b):\\n", "max_tokens": 32}'
  curl -H "$J" -N localhost:8000/v1/completions -d '{"prompt": "import os\\n", "stream": true}'
  curl -H "$J" localhost:8000/v1/chat/completions \\
    -d '{"messages": [{"role": "user", "content": "hi"}]}'
  curl localhost:8000/v1/models; curl localhost:8000/health
  curl localhost:8000/metrics          # Prometheus text format (/metrics.json: the JSON)

Prompt buckets and the per-request token budget are fitted to the model's
context unless set (`--config.prompt_buckets`, `--config.max_new_tokens`; values
that cannot fit are refused before anything compiles). Every engine program is
compiled before requests are accepted, with a log line per program group (about
a minute on 2 cores). SIGINT or SIGTERM stop it cleanly: no new connections,
running requests get `config.shutdown_timeout_s` to finish, the rest are
cancelled, exit code 0.
See configs/serve.py for the settings, `specjax.jobs.serve` for the job and
`specjax.serving.http` for the API.
"""

from __future__ import annotations

from absl import flags

from experiments import common
from specjax.distributed import launch
from specjax.jobs import serve


def main(argv):
  common.check_no_args(argv)
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  serve.serve(flags.FLAGS.config)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Server configuration (configs/serve.py).", "serve.py")
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)

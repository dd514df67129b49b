"""Configuration of `experiments/load_test.py`: serve held-out prompts at Poisson rates.

  python -m experiments.load_test --output_dir=DIR                 # bundled pair, in process
  python -m experiments.load_test --output_dir=DIR --config.rates="(1, 2, 4, 8)" \\
      --config.modes="('plain', 'adaptive')" --config.num_requests=64
  python -m experiments.load_test --output_dir=DIR --config.target=http://127.0.0.1:8000
  python -m experiments.load_test --output_dir=DIR --config.target=http://127.0.0.1:8000 \\
      --config.soak_s=120 --config.rates="(2.0,)" --config.server_pid=PID   # the soak

`target` is "inprocess" (one engine per mode, built here from `model`,
`hf_target`, `hf_draft` and the engine fields) or the URL of a running
`experiments.serve`, whose own engine is measured (its policy must be among
`modes`); `model` then only names the tokenizer the prompts are encoded with.
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The load-test configuration (no presets)."""
  config = ml_collections.ConfigDict()
  config.target = "inprocess"  # or a server's URL, http://host:port
  config.rates = (1.0, 2.0, 4.0)  # offered loads, requests/s: one rate, or a sweep
  # plain (no draft) | always (gamma every step) | adaptive (the policy picks)
  config.modes = ("plain", "always", "adaptive")
  config.num_requests = 32  # per (mode, rate): held-out test-split prompts, reused past 71
  # Rounds per rate: in each, every mode serves the same arrivals (seed + round),
  # taking turns in a rotated order, so modes compare round by round.
  config.repeats = 1
  config.seed = 0  # arrival times (every mode sees the same at a rate) and the engine's key
  # Each request: its budget and sampling.
  config.max_new_tokens = 64
  config.temperature = 0.0
  # Request i carries seed i: at temperature > 0 its text is the same in every
  # mode (seeded requests speculate with the coupled verifier; docs/serving.md).
  config.seeded = False
  config.top_k = 0
  config.top_p = 1.0
  # Goodput counts requests meeting both objectives (0: no objective).
  config.slo_ttft_s = 1.0
  config.slo_tpot_s = 0.1
  # The models (in process; for a URL target, the tokenizer).
  config.model = "bundled"  # bundled | hf | tiny (random tiny models: a smoke test)
  config.hf_target = ""  # Hugging Face checkpoint dirs or hub repo ids (model "hf")
  config.hf_draft = ""
  config.dtype = "float32"
  # Requests stop at the checkpoint's EOS ids. At temperature > 0 each mode samples
  # its own continuations, so their output lengths differ with EOS stops: set
  # False to compare the modes' throughput on equal work (every request its budget).
  config.stop_at_eos = True
  # The engines (specjax.serving.EngineConfig); their max_new_tokens is the requests'.
  config.slots = 8
  config.gamma = 4
  # What drafts (model "bundled"): the draft model, or a bundled head's drafter by name
  # (specjax.jobs.drafters.build_drafter: eagle, dspark, ...).
  config.drafter = "model"
  config.prompt_buckets = (32, 64, 128)  # the largest is the prompt limit (longer: cut)
  config.widths = ()  # batch widths compiled for steps (): powers of 2 up to slots
  # The soak under hostility (a server URL as target; docs/serving.md): for soak_s
  # seconds, normal requests at the first rate, once calm, once with soak_hostile
  # hostile requests per second on top (specjax.bench.serving.soak.HOSTILE). 0: no soak.
  config.soak_s = 0.0
  config.soak_hostile = 1.0
  config.server_pid = 0  # the server's process id on this machine, for its memory (0: none)
  config.api_key = ""  # sent as a Bearer token ("": $SPECJAX_API_KEY, if set)
  return config

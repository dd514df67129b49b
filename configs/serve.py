"""Configuration of `experiments/serve.py`: an OpenAI-style HTTP server.

  python -m experiments.serve                                  # the bundled pair
  python -m experiments.serve --config.port=8000 --config.policy=always
  python -m experiments.serve --config.target=/path/hf_target --config.draft=/path/hf_draft
  python -m experiments.serve --config.model=tiny              # random tiny models (smoke tests)
  python -m experiments.serve --config.drafter=dflash          # a draft head (or config.head)

`model` is "bundled" (the pair in `specjax/pretrained`), "hf" (`target` and
`draft`: local Hugging Face checkpoint directories or hub repo ids found
offline in the local cache, sharing a tokenizer; `draft` may be empty with
policy "never") or "tiny" (random tiny models and a byte-level tokenizer: the
text is noise, for testing the server). Setting `target` implies "hf".
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The server configuration (no presets)."""
  config = ml_collections.ConfigDict()
  config.model = "bundled"  # bundled | hf | tiny
  config.target = ""
  config.draft = ""
  # What drafts: "model" (config.draft, or the bundled pair's draft) or a draft head's
  # kind, eagle | medusa | early_exit | dflash (the block drafter): the bundled head of
  # that kind, or config.head's (needed for a target other than the bundled one).
  config.drafter = "model"
  # A draft head in place of config.draft: a head's training run, an export or a
  # hub layout (EAGLE-1/2, EAGLE-3, Medusa), as `specjax.hf.load_drafter` reads them;
  # of config.drafter's kind (with drafter "model": any kind).
  config.head = ""
  config.dtype = "float32"  # float32 | bfloat16
  config.model_name = ""  # what clients see ("": from the model)
  # The engine (specjax.serving.EngineConfig).
  config.slots = 8
  # The largest draft length; 0: the drafter's default, 4, or for a block drafter
  # (dflash, dspark) the one measured at start-up, the fastest of 1, 2, 4 and
  # block_size - 1 at T = 0 and T = 1 on a held-out prompt (plain decoding, policy
  # "never", when none beats it at both).
  config.gamma = 0
  config.policy = "adaptive"  # never (plain decoding, no draft) | always | adaptive
  # Prompt widths compiled (the largest is the prompt limit) and the most tokens a
  # request may ask for; () and 0: fitted to the model's context (logged at start-up;
  # the bundled pair: (64, 128, 256) and 251). A slot holds the largest bucket +
  # max_new_tokens + gamma + 1 positions, at most the model's max_seq_len.
  config.prompt_buckets = ()
  config.max_new_tokens = 0
  config.widths = ()  # batch widths compiled for steps (): powers of 2 up to slots
  # Confidence-driven verification length (EngineConfig.verify_lengths): () off, or the
  # lengths compiled, e.g. '(1,2,4)' (gamma last); warm-up measures their costs.
  config.verify_lengths = ()
  # Drafts the grammar forces (EngineConfig.forced_drafts): under a constraint, the
  # tokens a request's state allows alone are drafted first, at no drafter cost.
  config.forced_drafts = True
  config.seed = 0  # the tiny models' weights
  # The device mesh (EngineConfig.mesh): () one device; '(data, model)' over every
  # device of the job, one entry may be -1 (the rest), e.g. '(1, 8)' tensor
  # parallel over 8 GPUs or a TPU v5e-8. Slots (and widths) split over data.
  config.mesh = ()
  # On a mesh, the drafter's own modules: "replicate" (each device a copy: a small
  # draft drafts with no communication) or "shard" (split like the target).
  config.draft_placement = "replicate"
  # On a mesh, the embedding and LM head: "replicate" (whole logits on every device:
  # sampling and verification need no communication) or "shard" (less memory).
  config.vocab_placement = "replicate"
  # The engine's seed, which unseeded sampled requests draw from: -1 a fresh random
  # one at each start (their texts differ across restarts), >= 0 fixed.
  config.sampling_seed = -1
  # Log-probabilities: the most alternatives a request may ask for (completions'
  # `logprobs`, chat's `top_logprobs`); 0 records none (and computes nothing).
  config.logprobs = 5
  # Structured output (`response_format`, `guided_regex`, `guided_choice`): the
  # states of the constraint table the live requests' automata share (json_object
  # takes 1,624 over the bundled vocabulary); 0 refuses constraints, masks nothing.
  config.constraint_states = 4096
  config.stop_at_eos = True  # requests stop at the checkpoint's EOS ids
  # The HTTP server.
  config.host = "127.0.0.1"
  config.port = 8000
  config.log_level = "info"  # uvicorn's: critical | error | warning | info | debug
  # On SIGINT / SIGTERM: how long running requests may take to finish before
  # they are cancelled (constraint compiles are stopped at once).
  config.shutdown_timeout_s = 3.0
  # Access: the key every endpoint but /health requires (Authorization: Bearer <key>);
  # "" reads the SPECJAX_API_KEY environment variable (unset: no key). Host names
  # accepted (any port), comma-separated, against DNS rebinding; "": on a loopback
  # address only localhost, 127.0.0.1, ::1 and that address, elsewhere any; "*": any.
  # Behind a proxy, list the Host it forwards.
  config.api_key = ""
  config.allowed_hosts = ""
  # Limits (specjax.serving.limits.ServerLimits; docs/serving.md "Limits and security").
  config.max_queue = 256  # requests waiting for a slot; past it, 429
  config.max_body_bytes = 1 << 20
  config.max_json_depth = 64
  config.max_requests = 256  # HTTP requests in flight (/health aside); past it, 429
  config.max_stop_chars = 256
  config.max_regex_chars = 4096
  config.max_regex_repeat = 1024
  config.max_schema_bytes = 16 << 10
  config.max_schema_depth = 32
  config.max_choices = 256
  config.max_choice_chars = 16 << 10
  config.max_tools = 64
  config.compile_workers = 2  # constraint compiles at once, each in a worker process
  config.compile_queue = 8  # compiles waiting for a worker; past it, 429
  # compiles one client (peer address) may have started and not finished; past it,
  # 429 to that client alone (behind a proxy every client is the proxy: raise it)
  config.compile_per_client = 1
  config.compile_timeout_s = 30.0
  config.compile_memory_mb = 4096  # a compile worker's address space (0: no limit)
  config.compile_cache_mb = 256
  config.request_timeout_s = 0.0  # a request's seconds at most (0: none)
  config.body_timeout_s = 10.0  # the seconds a client has to send its body; past it, 408
  return config

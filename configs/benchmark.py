"""Configuration of `experiments/benchmark.py`: autoregressive vs speculative decoding.

Select a preset after a colon (the default is tiny):
  --config=configs/benchmark.py            tiny: 0.43M target, 42K draft (smoke runs)
  --config=configs/benchmark.py:medium     24.9M target, 1.12M draft (the real figures)
  --config=configs/benchmark.py:self       tiny target drafting for itself: alpha = 1
                                           at temperature 0, an overhead check
and override fields with flags, e.g. `--config.max_new_tokens=16`.

`target` and `draft` hold `specjax.ModelConfig` keyword arguments. `max_seq_len`
is left out on purpose: the launcher sets it to the cache capacity speculative
decoding allocates (`specjax.models.kv_cache.cache_capacity`), so overriding
the budget never needs a second override (adding max_seq_len explicitly is
allowed; it must then be at least that).
"""

from __future__ import annotations

import ml_collections

_TINY_TARGET = dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256)
_TINY_DRAFT = dict(vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
# 24,910,336 parameters; d_ff a multiple of 128 keeps the matmuls tile-friendly.
_MEDIUM_TARGET = dict(vocab_size=8192, d_model=512, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=1280)
# 1,122,624 parameters, of which the embedding and the untied head are 1,048,576:
# with the target's vocabulary the draft's cost is mostly its output head.
_MEDIUM_DRAFT = dict(vocab_size=8192, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128)

PRESETS = {
  "tiny": (_TINY_TARGET, _TINY_DRAFT, False),
  "medium": (_MEDIUM_TARGET, _MEDIUM_DRAFT, False),
  "self": (_TINY_TARGET, _TINY_TARGET, True),
}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration of `preset` ("tiny" when None or empty)."""
  preset = preset or "tiny"
  if preset not in PRESETS:
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
  target, draft, draft_is_target = PRESETS[preset]
  config = ml_collections.ConfigDict()
  config.preset = preset
  config.target = ml_collections.ConfigDict(dict(target))
  # Ignored when draft_is_target (the target model object is passed twice);
  # kept equal to the target then so the echo in the result file is truthful.
  config.draft = ml_collections.ConfigDict(dict(draft))
  config.draft_is_target = draft_is_target
  config.batch_size = 1
  config.prompt_len = 32
  config.gamma = 4
  # 1 + k (gamma + 1): the prefill emits one token, then each fully accepted
  # iteration gamma + 1, so a perfect draft ends exactly on the budget.
  config.max_new_tokens = 1 + 12 * (config.gamma + 1)
  config.temperature = 0.0
  config.top_k = 0
  config.top_p = 1.0
  config.num_runs = 5
  # "while": the loops test for finished rows after every iteration; "chunked":
  # after every loop_chunk iterations (on GPU, one device-to-host wait per chunk).
  config.loop = "while"
  config.loop_chunk = 8
  # N model calls per jitted loop when timing one call (c, verify cost).
  config.step_timing_steps = 16
  config.seed = 0
  config.dtype = "float32"  # compute and parameter dtype of both models
  return config

"""Sampling warps: logits -> the probabilities that are sampled *and* verified.

Exactness needs q to be the very law each draft token was drawn from and p the
target's after the same warp, so `warp_probs` serves draft and target alike and
`sample` draws from its probabilities, never raw logits. Settings are static
(`SamplingParams`) or per-row data (`RowSampling`). All arithmetic is float32.

The order is vLLM's (v1 sampler). On the raw logits: `logit_bias`, the
`min_tokens` mask (EOS and stop ids at -inf until then), then the repetition
penalty (over the prompt and the generated tokens, as vLLM and Hugging Face
define it), then the frequency and presence penalties (over the generated
tokens only, as OpenAI defines them). Then temperature, then min-p, top-k and
top-p (min-p and top-k commute: both keep the tokens above a threshold of one
order); temperature 0 is one-hot at the argmax of the penalised logits (lowest
index on ties).

The penalties read a row's text (`TokenHistory`): under speculation the warp at
draft position t reads the counts including the drafted tokens before t, and
the target's p at scored row t the same (`TokenHistory.along`), so p and q are
warped alike and every verifier stays exact.

The package, by seam:

  params.py  static settings and their checks (`SamplingParams`, `RANGES`, the
             float32 and int32 limits, `check_logit_bias`, `GREEDY`)
  rows.py    per-row data: the rows' text (`TokenHistory`), their settings as
             arrays (`RowSampling`) and its checks
  warps.py   logits -> probabilities (`warp_probs`, `penalized_logits`,
             `finite_rows`)
  draws.py   probabilities -> tokens (`sample`, `sample_with_uniform`,
             `sample_tokens`)
"""

from specjax.sampling.draws import sample, sample_tokens, sample_with_uniform
from specjax.sampling.params import (
  GREEDY,
  MAX_FLOAT32,
  MAX_INT32,
  MAX_LOGIT_BIAS,
  MAX_STOP_TOKEN_IDS,
  MIN_TEMPERATURE,
  RANGES,
  SamplingParams,
  check_logit_bias,
  check_stop_token_ids,
)
from specjax.sampling.rows import RowSampling, TokenHistory
from specjax.sampling.warps import finite_rows, penalized_logits, warp_probs

__all__ = [
  "GREEDY",
  "MAX_FLOAT32",
  "MAX_INT32",
  "MAX_LOGIT_BIAS",
  "MAX_STOP_TOKEN_IDS",
  "MIN_TEMPERATURE",
  "RANGES",
  "RowSampling",
  "SamplingParams",
  "TokenHistory",
  "check_logit_bias",
  "check_stop_token_ids",
  "finite_rows",
  "penalized_logits",
  "sample",
  "sample_tokens",
  "sample_with_uniform",
  "warp_probs",
]

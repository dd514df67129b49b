"""Generation loops: autoregressive baseline and speculative decoding.

speculative.py     speculative_step (draft, score, verify, commit) and its loop
autoregressive.py  the baseline loop, one target call per token
string_level.py    string-level exact match: a draft of another tokenizer drafts text
                   (a host loop around jitted draft and verify calls)
common.py          what both loops share: prefill, padding, output, trace counts
state.py           loop states, statistics, outputs, SpecConfig
validation.py      argument checks of the generate calls
"""

from specjax.drafting import as_drafter
from specjax.generation.autoregressive import autoregressive_generate, autoregressive_step
from specjax.generation.speculative import init_state, speculative_generate, speculative_step
from specjax.generation.state import (
  AutoregressiveStats,
  GenerateOutput,
  SpecConfig,
  SpecState,
  SpeculativeStats,
)
from specjax.generation.string_level import StringLevelOutput, string_level_generate

__all__ = [
  "autoregressive_generate",
  "autoregressive_step",
  "as_drafter",
  "init_state",
  "speculative_generate",
  "speculative_step",
  "string_level_generate",
  "StringLevelOutput",
  "AutoregressiveStats",
  "GenerateOutput",
  "SpecConfig",
  "SpeculativeStats",
  "SpecState",
]

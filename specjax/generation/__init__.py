"""Generation loops: autoregressive baseline and speculative decoding.

string_level.py is string-level exact match (a host loop, another tokenizer).
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

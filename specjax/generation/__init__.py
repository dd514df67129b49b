"""Generation loops: autoregressive baseline and speculative decoding."""

from specjax.generation.autoregressive import autoregressive_generate, autoregressive_step
from specjax.generation.speculative import (as_drafter, init_state, speculative_generate,
                                            speculative_step)
from specjax.generation.state import (AutoregressiveStats, GenerateOutput, SpecConfig,
                                      SpeculativeStats, SpecState)

__all__ = [
    "autoregressive_generate", "autoregressive_step", "as_drafter", "init_state",
    "speculative_generate", "speculative_step", "AutoregressiveStats", "GenerateOutput",
    "SpecConfig", "SpeculativeStats", "SpecState",
]

"""specjax: exact speculative decoding for JAX/Flax.

Public surface:
  ModelConfig, Transformer, KVCache           -- models (specjax.models)
  SamplingParams, RowSampling, warp_probs     -- sampling warps (specjax.sampling)
  verify.token_verify, verify.block_verify, verify.greedy_verify
                                              -- verification rules (specjax.verify)
  drafting.NGramDrafter, drafting.layer_skip  -- drafters besides a draft model
  heads.config, heads.make_head, heads.drafter -- draft heads, one file per kind (specjax.heads)
  trees, drafting.TreeDrafter, verify.tree_verify -- token trees
  drafting.CrossTokenizerDrafter, string_level_generate, vocab_map
                                              -- drafts with another tokenizer
  pretrained.load_pair                        -- the bundled trained pair
                                                 (`from specjax import pretrained`)
  distributed.make_mesh, distributed.shard_model -- meshes and placement (specjax.distributed)
  speculative_generate, autoregressive_generate, speculative_step
                                              -- generation loops (specjax.generation)
  theory                                      -- Leviathan et al. formulas
"""

from specjax import distributed, drafting, heads, theory, trees, verify, vocab_map
from specjax.generation import (
  GenerateOutput,
  SpecConfig,
  SpecState,
  SpeculativeStats,
  autoregressive_generate,
  speculative_generate,
  speculative_step,
  string_level_generate,
)
from specjax.models import KVCache, ModelConfig, Transformer
from specjax.sampling import GREEDY, RowSampling, SamplingParams, warp_probs

__version__ = "0.1.0"

__all__ = [
  "GREEDY",
  "GenerateOutput",
  "KVCache",
  "ModelConfig",
  "RowSampling",
  "SamplingParams",
  "SpecConfig",
  "SpecState",
  "SpeculativeStats",
  "Transformer",
  "autoregressive_generate",
  "speculative_generate",
  "speculative_step",
  "string_level_generate",
  "theory",
  "trees",
  "verify",
  "warp_probs",
  "distributed",
  "drafting",
  "heads",
  "vocab_map",
]

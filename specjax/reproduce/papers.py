"""The published numbers the reproduction puts ours next to (see
../shared/REFERENCES.md), each with where it comes from."""

from __future__ import annotations

LEVIATHAN = "Leviathan, Kalman, Matias 2023 (arXiv 2211.17192)"
CHEN = "Chen et al. 2023 (arXiv 2302.01318)"
SUN = "Sun et al. 2024, block verification (arXiv 2403.10444)"
DISTILLSPEC = "Zhou et al. 2023, DistillSpec (arXiv 2310.08461)"
DALIRI = (
  "Daliri, Musco, Suresh 2024, Coupling without Communication and Drafter-Invariant "
  "Speculative Decoding (arXiv 2408.07978)"
)

# Leviathan Table 1 (c = 0) and section 3.3's optimum: printed values.
TABLE1_TOKENS = {"alpha": 0.8, "gamma": 5, "tokens_per_iteration": 3.69, "ops_factor": 1.63}
OPTIMAL_GAMMA = {"alpha": 0.8, "c": 0.04, "gamma": 9, "speedup": 3.28}

# Leviathan Table 3: alpha by kind of draft, the range over the paper's tasks.
TABLE3_RANGES = {
  "unigram": (0.03, 0.13),
  "bigram": (0.05, 0.23),
  "small model": (0.6, 0.9),  # T5-small..large, LaMDA 100M..8B, a 6M GPT-like: .53-.89
}

# Leviathan Table 4: predicted and measured speedups differ by up to about 30%.
TABLE4_MAX_GAP = 0.30

# Chen et al.: Chinchilla 70B with a 4B draft, K = 4, TPU v4.
CHEN_SPEEDUPS = {"XSum, nucleus": 1.92, "XSum, greedy": 2.01, "HumanEval, greedy": 2.46}
CHEN_K = 4

# Sun et al.: the binary toy's expected accepted tokens, and the wall-clock gain.
SUN_TOY = {"token": 10 / 9, "block": 11 / 9}
SUN_GAIN = (0.05, 0.08)

# DistillSpec: speedup of a distilled draft over the plain (corpus-trained) one.
DISTILLSPEC_GAIN = (0.10, 0.45)

# The explainers' one-token examples: (q, p, acceptance of A).
WORKED_EXAMPLES = (
  {"q": (0.4, 0.6), "p": (0.3, 0.7), "acceptance_of_A": 0.75},
  {"q": (0.8, 0.2), "p": (0.3, 0.7), "acceptance_of_A": 0.375},
)

# Daliri et al.: the output is a function of the seed alone, whatever the drafter
# (drafter invariance); Gumbel-max coupling accepts at least (1 - TV) / (1 + TV)
# where the residual rule accepts 1 - TV (their Theorem 2; the bound, not a table).
DALIRI_CLAIMS = ("drafter-invariant output", "acceptance >= (1 - TV) / (1 + TV)")

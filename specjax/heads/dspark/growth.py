"""How a sequential block drafter's parameters grow with a scaled target
(`specjax.models.expand`): its two heads' here, the rest as the block drafter's do."""

from __future__ import annotations

from specjax.heads.dflash.growth import expansion_axes as block_expansion_axes


def expansion_axes(path: tuple) -> tuple[str, str] | None:
  """How a sequential block drafter's parameter grows with the target: (its plan, its
  letters, "=" keeping an axis's size), or None for a path it lacks."""
  own = {
    ("markov_w1",): ("target", "V="),
    ("markov_w2",): ("target", "=V"),
    ("confidence_hidden", "kernel"): ("target", "D="),
    ("confidence_markov", "kernel"): ("target", "=="),
    ("confidence_bias",): ("target", "="),
  }
  return own.get(path) or block_expansion_axes(path)

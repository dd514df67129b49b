"""Shapes shared by specjax's Pallas (Triton) kernels (`append_attention`,
`gated_down`): every tensor Triton loads has a power-of-two size, so query rows,
new slots and output rows are padded to one and masked."""

from __future__ import annotations


def pow2_at_least(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())

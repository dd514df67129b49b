"""The column layouts of the fused projections, and their per-projection names.

  attn.qkv_proj `[D, K*(G+2)*H]` viewed as `[K, G+2, H]`: kv head k's G query
    heads (query head n = k*G + g), then its key, then its value.
  mlp.gate_up_proj `[D, 2F]` viewed as `[F, 2]`: unit f's gate, then its up.

A column-chunk sharding thus hands each device whole kv-head groups and hidden
units (docs/performance.md, "Fused projections"). Biases follow their kernel's
columns. Checkpoints keep per-projection tensors (`q_proj`, ..., `up_proj`):
loaders write each into its `Part`, exporters take it out again.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Part:
  """One projection's columns inside a fused parameter.

  Attributes:
    name: the projection's own name, e.g. "k_proj".
    view: the fused last axis split into these axes, e.g. `(K, G + 2, H)`.
    axis, start, stop: the projection is entries [start, stop) of `view`'s axis
      `axis`, all of the others; its columns are those entries in row-major order.
  """

  name: str
  view: tuple[int, ...]
  axis: int
  start: int
  stop: int

  @property
  def width(self) -> int:
    """The projection's number of columns."""
    return math.prod(self.view) // self.view[self.axis] * (self.stop - self.start)

  def _index(self) -> tuple:
    before = (slice(None),) * self.axis
    after = (slice(None),) * (len(self.view) - self.axis - 1)
    return (Ellipsis, *before, slice(self.start, self.stop), *after)

  def take(self, fused):
    """The projection's columns `[..., width]` of `fused [..., prod(view)]`
    (a NumPy or jax array: a kernel, a bias, or a product's output)."""
    lead = fused.shape[:-1]
    return fused.reshape(*lead, *self.view)[self._index()].reshape(*lead, self.width)

  def put(self, fused: np.ndarray, value: np.ndarray) -> None:
    """Writes `value [..., width]` into its columns of the C-contiguous NumPy
    array `fused [..., prod(view)]`, in place (cast to fused's dtype)."""
    lead = fused.shape[:-1]
    blocks = fused.reshape(*lead, *self.view)  # a view of fused's memory
    target = blocks[self._index()]
    target[...] = np.asarray(value).reshape(target.shape).astype(fused.dtype)


def qkv_parts(cfg: ModelConfig) -> tuple[Part, Part, Part]:
  """`(q_proj, k_proj, v_proj)`'s parts of `attn.qkv_proj`: view `(K, G+2, H)`."""
  k = cfg.n_kv_heads
  g = cfg.n_heads // k
  view = (k, g + 2, cfg.resolved_head_dim)
  return (
    Part("q_proj", view, 1, 0, g),
    Part("k_proj", view, 1, g, g + 1),
    Part("v_proj", view, 1, g + 1, g + 2),
  )


def gate_up_parts(d_ff: int) -> tuple[Part, Part]:
  """`(gate_proj, up_proj)`'s parts of `mlp.gate_up_proj`: view `(F, 2)`."""
  view = (d_ff, 2)
  return Part("gate_proj", view, 1, 0, 1), Part("up_proj", view, 1, 1, 2)


def fused_parts(cfg: ModelConfig) -> dict[str, tuple[Part, ...]]:
  """The fused projections of a decoder block of `cfg`, each with its parts."""
  parts = {"qkv_proj": qkv_parts(cfg)}
  if cfg.mlp != "gelu":
    parts["gate_up_proj"] = gate_up_parts(cfg.d_ff)
  return parts


def unfuse(params: dict[tuple, object], cfg: ModelConfig) -> dict[tuple, object]:
  """Flat `params` (path -> array) with each fused projection's kernel and bias
  replaced by its parts', named as checkpoints name them:
  `(..., "attn", "qkv_proj", "kernel")` -> `(..., "attn", "q_proj", "kernel")`,
  `k_proj`, `v_proj`, and `gate_up_proj` -> `gate_proj`, `up_proj`. Every other
  parameter is kept; `cfg` is the blocks' config."""
  parts = fused_parts(cfg)
  out = {}
  for path, value in params.items():
    fused = parts.get(path[-2]) if len(path) >= 2 else None
    if fused is None:
      out[path] = value
      continue
    for part in fused:
      out[(*path[:-2], part.name, path[-1])] = part.take(value)
  return out

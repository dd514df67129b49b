"""Scanned layers: the decoder blocks' weights stacked along a leading layer axis
and run by a loop over that axis (`ModelConfig(scan_layers=True)`).

One block compiles instead of L (same results to float rounding).
`Transformer.layers` is a `ScannedBlocks` (`len`, iteration and `layers[i]`
still give per-layer views); `KVCache.k` is one `[B, L, K, S, H]` array (rows
first, so the serving engine moves rows leaf by leaf). `scan_model` /
`unscan_model` convert a model, `stack_state` / `unstack_state` a state.
Measurements: docs/performance.md ("Scanned layers").
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

LAYER_AXIS = "layers"  # logical name of the stacked parameters' leading axis


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _stack_variables(*variables: nnx.Variable) -> nnx.Variable:
  first = variables[0]
  stacked = first.replace(jnp.stack([v.get_value() for v in variables]))
  names = first.get_metadata().get("out_sharding")
  if names is not None:
    stacked.set_metadata(out_sharding=(LAYER_AXIS, *names))
  return stacked


def _unstack_variable(variable: nnx.Variable, i: int) -> nnx.Variable:
  layer = variable.replace(variable.get_value()[i])
  names = variable.get_metadata().get("out_sharding")
  if names is not None:
    layer.set_metadata(out_sharding=tuple(names[1:]))
  return layer


def stack_state(states: Sequence[nnx.State]) -> nnx.State:
  """L per-layer states of one block structure -> one state with `[L, ...]` leaves
  (sharding names gain the leading "layers")."""
  return jax.tree.map(_stack_variables, *states, is_leaf=_is_variable)


def unstack_state(state: nnx.State, num_layers: int) -> list[nnx.State]:
  """The inverse of `stack_state`: `num_layers` per-layer states."""
  return [
    jax.tree.map(lambda v, i=i: _unstack_variable(v, i), state, is_leaf=_is_variable)
    for i in range(num_layers)
  ]


def layer_slice(state: nnx.State, i: jax.Array) -> nnx.State:
  """Layer `i` (traced) of a stacked state: each leaf's `[i]`, read in the loop
  body (on accelerators XLA folds the dynamic slice into the consumer's read)."""
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), state)


class ScannedBlocks(nnx.Module):
  """L decoder blocks as one `Block` with stacked `[L, ...]` parameters.

  `windows` and `ropes` are the per-layer sliding windows and (theta, scaling)
  of RoPE (static), which the loop selects by layer index.
  """

  def __init__(self, blocks: Sequence[nnx.Module], windows: Sequence, ropes: Sequence):
    if not blocks:
      raise ValueError("ScannedBlocks needs at least one block.")
    graphdef, _ = nnx.split(blocks[0])
    self.block = nnx.merge(graphdef, stack_state([nnx.state(b) for b in blocks]))
    self.num_layers = len(blocks)
    self.windows = tuple(windows)
    self.ropes = tuple(ropes)

  def __len__(self) -> int:
    return self.num_layers

  def __getitem__(self, i: int) -> nnx.Module:
    """Layer `i` as a `Block` of its own (a copy of its weights, for inspection)."""
    if not -self.num_layers <= i < self.num_layers:
      raise IndexError(f"layer {i} out of range for {self.num_layers} layers.")
    return self.unstacked()[i]

  def __iter__(self):
    graphdef, state = nnx.split(self.block)
    for i, layer_state in enumerate(unstack_state(state, self.num_layers)):
      block = nnx.merge(graphdef, layer_state)
      # The graph definition is layer 0's: give the view its own layer's window and RoPE.
      block.attn.window, block.attn.rope = self.windows[i], self.ropes[i]
      yield block

  def unstacked(self) -> list[nnx.Module]:
    """The L blocks with weights of their own (the unrolled layout)."""
    return list(self)

  def run(
    self,
    x: jax.Array,
    positions: jax.Array,
    masks: dict,
    cache_kv: tuple[jax.Array, jax.Array] | None,
    starts: jax.Array | None,
    inv_freqs: jax.Array | None,
    start: int,
    stop: int,
    contiguous: bool = True,
  ):
    """Runs layers `start .. stop - 1` over `x [B, T, D]` in one loop.

    `positions [B, T]`, `masks` (window -> `[B, T, S or T]`), `starts [B]` and
    `contiguous` as for `Attention`; `cache_kv` None or the stacked `(k, v)`;
    `inv_freqs [L, H/2]` or None. Returns `(x [B, T, D], cache_kv)`.
    """

    graphdef, state = nnx.split(self.block)
    windows = sorted(set(self.windows[start:stop]), key=lambda w: (w is not None, w or 0))
    if len(windows) == 1:
      select_mask = lambda i: masks[windows[0]]
    else:  # a per-layer choice among the few distinct windows
      stacked = jnp.stack([masks[w] for w in windows])
      table = jnp.asarray([windows.index(w) for w in self.windows], jnp.int32)
      select_mask = lambda i: stacked[table[i]]

    def body(i, carry):
      x, cache_kv = carry
      block = nnx.merge(graphdef, layer_slice(state, i))
      layer_cache = None if cache_kv is None else (*cache_kv, i)
      inv_freq = None if inv_freqs is None else inv_freqs[i]
      x, layer_cache = block(
        x, positions, select_mask(i), layer_cache, starts, inv_freq, contiguous
      )
      return x, None if cache_kv is None else layer_cache[:2]

    if stop <= start:
      return x, cache_kv
    return jax.lax.fori_loop(start, stop, body, (x, cache_kv))


def stack_layer_params(params: dict, num_layers: int) -> dict:
  """Flat parameters `{path: array}`, `("layers", i, ...)` -> `("layers", "block",
  ...)` `[L, ...]`; per-layer arrays leave `params` as they are stacked (peak
  memory: one stacked parameter more)."""

  out, rests = {}, []
  for path in list(params):
    if path[0] != LAYER_AXIS:
      out[path] = params.pop(path)
    elif path[1] == 0:
      rests.append(path[2:])
  for rest in rests:
    layers = [params.pop((LAYER_AXIS, i, *rest)) for i in range(num_layers)]
    out[(LAYER_AXIS, "block", *rest)] = jnp.stack(layers)
    del layers
  if params:
    raise ValueError(f"parameters outside the {num_layers} layers: {sorted(params)[:3]}.")
  return out


def unstack_layer_params(params: dict) -> dict:
  """The inverse of `stack_layer_params`: `("layers", "block", ...)` `[L, ...]`
  -> `("layers", i, ...)`."""
  out = {}
  for path, value in params.items():
    if path[:2] == (LAYER_AXIS, "block"):
      for i in range(value.shape[0]):
        out[(LAYER_AXIS, i, *path[2:])] = value[i]
    else:
      out[path] = value
  return out


def _rebuild(model: nnx.Module, scanned: bool) -> nnx.Module:
  """`model` (a `Transformer`) in the other layer layout, same weights."""
  cfg = model.cfg.replace(scan_layers=scanned)
  params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  params = stack_layer_params(params, cfg.n_layers) if scanned else unstack_layer_params(params)
  abstract = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(params[p])) for p, v in flat]))


def scan_model(model: nnx.Module) -> nnx.Module:
  """`model` with scanned layers (`cfg.scan_layers=True`); itself if it has them."""
  return model if isinstance(model.layers, ScannedBlocks) else _rebuild(model, True)


def unscan_model(model: nnx.Module) -> nnx.Module:
  """`model` with unrolled layers (`cfg.scan_layers=False`); itself if it has them."""
  return _rebuild(model, False) if isinstance(model.layers, ScannedBlocks) else model


def with_layout(model: nnx.Module, scanned: bool) -> nnx.Module:
  """`model` in the scanned (True) or unrolled (False) layer layout."""
  return scan_model(model) if scanned else unscan_model(model)

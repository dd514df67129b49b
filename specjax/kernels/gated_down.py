"""A decode call's gated MLP tail in one GPU kernel: the activation, `down` and the
residual add.

  gated_down(gate_up [M, 2F], w_down [F, D], residual [M, D], sums, ...) -> [M, D]

XLA:GPU compiles the tail of a folded SwiGLU block (`specjax.models.block`) to
three or four kernels for a decode call's few rows: the activation times up, the
`down` product (split over K in two kernels where it picks split-K) and the
residual add. Here one Pallas (Triton) kernel per block of `D` columns computes
the hidden activations from the `gate_up` product's raw output (the folded
norm's 1 / rms from its sums of squares, the bias, rounding to the compute dtype
as `Linear.scaled` does), multiplies them into its columns of `w_down` in
float32 and adds the residual. Gate and up are interleaved per hidden unit
(`specjax.models.fused`: columns 2f and 2f + 1).

For GPU calls of at most `MAX_ROWS` rows; SPECJAX_PALLAS_INTERPRET=1 runs it in
interpret mode on any backend (the tests). Compiled for an H100 on a CPU
(specjax.aot); not yet timed on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.kernels.tiles import pow2_at_least

MAX_ROWS = 16  # a decode step, a draft's call, a verify block of gamma + 1 <= 16
_BLOCK_D = 32  # output columns per program: D / 32 programs, each reading F x 32 weights
# Hidden units per loop step. Under 16 rows Triton's dot does not apply: the
# products are broadcast and summed in registers, [rows, 64, 32] elements a step.
_BLOCK_F = 64
_ACTIVATIONS = ("swiglu", "geglu")


def applies(rows: int, d_ff: int, d_model: int, kind: str) -> bool:
  """Whether a call of `rows` rows takes the kernel (static shapes only)."""
  return kind in _ACTIVATIONS and rows <= MAX_ROWS and d_ff >= _BLOCK_F and d_model >= _BLOCK_D


@dataclasses.dataclass(frozen=True)
class _Static:
  rows: int  # M
  d_ff: int  # F
  d_model: int  # D
  kind: str
  norm: tuple | None  # (width, eps) of a folded RMSNorm, or None
  gate_bias: bool
  down_bias: bool
  dtype: jnp.dtype  # the compute dtype (the hidden activations' rounding)
  scratch: bool  # the output is padded to whole blocks (interpreted: see gated_down)
  round_product: bool  # the product rounds to `dtype` before the add (`Linear.product`)

  @property
  def padded(self) -> int:
    return pow2_at_least(self.rows)

  @property
  def dot(self) -> bool:
    return self.padded >= 16


def _activation(kind: str, gate: jax.Array) -> jax.Array:
  if kind == "swiglu":
    return gate * jax.nn.sigmoid(gate)
  return jax.nn.gelu(gate, approximate=True)


def _hidden(st: _Static, refs: dict, rows, factor, f0):
  """`[M', BF]` hidden activations of units `f0 .. f0 + BF` (rows past M zero),
  in the compute dtype, from the raw gate/up product."""
  from jax.experimental.pallas import triton as plgpu

  units = f0 + jnp.arange(_BLOCK_F, dtype=jnp.int32)
  inside = units < st.d_ff
  valid = (rows < st.rows)[:, None] & inside[None, :]
  row_index = jnp.minimum(rows, st.rows - 1)[:, None]
  unit = jnp.minimum(units, st.d_ff - 1)
  parts = []
  for half in (0, 1):  # gate, then up
    column = (2 * unit + half)[None, :]
    y = plgpu.load(refs["gate_up"].at[row_index, column], mask=valid, other=0)
    y = y.astype(jnp.float32)
    if factor is not None:
      y = y * factor[:, None]
    if st.gate_bias:
      y = y + plgpu.load(refs["gate_bias"].at[2 * unit + half]).astype(jnp.float32)[None, :]
    parts.append(y.astype(st.dtype).astype(jnp.float32))
  hidden = _activation(st.kind, parts[0]).astype(st.dtype).astype(jnp.float32) * parts[1]
  return jnp.where(valid, hidden, 0.0).astype(st.dtype)


def _kernel(st: _Static, names: tuple[str, ...]):
  """The body of one program: output columns `j * BD .. (j + 1) * BD` of every row."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  def kernel(*operands):
    refs = dict(zip(names, operands))
    j = pl.program_id(0)
    rows = jnp.arange(st.padded, dtype=jnp.int32)
    live = rows < st.rows
    row_index = jnp.minimum(rows, st.rows - 1)
    factor = None
    if st.norm is not None:
      width, eps = st.norm
      sums = plgpu.load(refs["sums"].at[row_index], mask=live, other=1)
      factor = jnp.where(live, jax.lax.rsqrt(sums / width + eps), 0.0)
    columns = j * _BLOCK_D + jnp.arange(_BLOCK_D, dtype=jnp.int32)
    out_cols = columns < st.d_model
    column = jnp.minimum(columns, st.d_model - 1)[None, :]

    def step(i, acc):
      f0 = i * _BLOCK_F
      hidden = _hidden(st, refs, rows, factor, f0)  # [M', BF]
      units = jnp.minimum(f0 + jnp.arange(_BLOCK_F, dtype=jnp.int32), st.d_ff - 1)[:, None]
      weights = plgpu.load(refs["w_down"].at[units, column], mask=out_cols[None, :], other=0)
      if st.dot:
        return acc + plgpu.dot(hidden, weights.astype(hidden.dtype)).astype(jnp.float32)
      product = hidden.astype(jnp.float32)[:, :, None] * weights.astype(jnp.float32)[None]
      return acc + jnp.sum(product, axis=1)

    steps = pl.cdiv(st.d_ff, _BLOCK_F)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((st.padded, _BLOCK_D), jnp.float32))
    if st.round_product:
      acc = acc.astype(st.dtype).astype(jnp.float32)
    if st.down_bias:
      bias = plgpu.load(refs["down_bias"].at[column[0]]).astype(jnp.float32)
      acc = acc + bias[None, :]
    mask = live[:, None] & out_cols[None, :]
    residual = plgpu.load(refs["residual"].at[row_index[:, None], column], mask=mask, other=0)
    # The XLA path rounds the product to float32 and adds it to the float32 residual.
    out = (residual.astype(jnp.float32) + acc).astype(refs["out"].dtype)
    at = (rows[:, None], columns[None, :]) if st.scratch else (row_index[:, None], column)
    plgpu.store(refs["out"].at[at], out, mask=mask)

  return kernel


@functools.partial(
  jax.jit,
  static_argnames=("kind", "dtype", "norm_width", "norm_eps", "round_product", "interpret"),
)
def gated_down(
  gate_up: jax.Array,
  w_down: jax.Array,
  residual: jax.Array,
  sums: jax.Array | None = None,
  gate_bias: jax.Array | None = None,
  down_bias: jax.Array | None = None,
  *,
  kind: str = "swiglu",
  dtype=jnp.bfloat16,
  norm_width: int = 0,
  norm_eps: float = 0.0,
  round_product: bool = False,
  interpret: bool = False,
) -> jax.Array:
  """`residual + down(act(gate) * up)` of a decode call's rows, in one kernel.

  Args:
    gate_up: `[M, 2F]` the fused gate/up product's raw output (before the norm's
      factor and the bias), gate and up interleaved per unit.
    w_down: `[F, D]` the down projection's kernel.
    residual: `[M, D]` the residual stream the output is added to.
    sums: `[M]` float32: a folded RMSNorm's sums of squares over `norm_width`
      features (every gate/up value is scaled by `rsqrt(sums / norm_width +
      norm_eps)`), or None.
    gate_bias, down_bias: `[2F]`, `[D]`, or None.
    kind: "swiglu" (silu) or "geglu" (tanh-GELU) on the gate.
    dtype: the compute dtype the gate/up values and activations round to.
    round_product: round the product to `dtype` before the bias and the add
      (what `Linear.product` does for products XLA:GPU makes GEMMs).
    interpret: run the kernel in interpret mode (any backend).

  Returns:
    `[M, D]` in residual's dtype.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  m, d = residual.shape
  f = w_down.shape[0]
  operands = {"gate_up": gate_up, "w_down": w_down, "residual": residual}
  if sums is not None:
    operands["sums"] = sums.astype(jnp.float32)
  if gate_bias is not None:
    operands["gate_bias"] = gate_bias
  if down_bias is not None:
    operands["down_bias"] = down_bias
  st = _Static(
    rows=m,
    d_ff=f,
    d_model=d,
    kind=kind,
    norm=None if sums is None else (norm_width, norm_eps),
    gate_bias=gate_bias is not None,
    down_bias=down_bias is not None,
    dtype=jnp.dtype(dtype),
    scratch=interpret,
    round_product=round_product,
  )
  names = (*operands, "out")
  blocks = pl.cdiv(d, _BLOCK_D)
  # Interpreted, masked stores write back what they read, so padded lanes need
  # addresses of their own: the output is padded to whole blocks, then cut. A
  # GPU's masked stores write nothing.
  shape = (st.padded, blocks * _BLOCK_D) if interpret else (m, d)
  out = pl.pallas_call(
    _kernel(st, names),
    grid=(blocks,),
    out_shape=jax.ShapeDtypeStruct(shape, residual.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="specjax_gated_down",
  )(*operands.values())
  return out[:m, :d] if interpret else out

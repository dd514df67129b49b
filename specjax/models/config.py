"""`ModelConfig`: the static description of a decoder-only transformer.

One frozen, hashable dataclass; the defaults give a Llama-style decoder, the
variant fields GPT-2- and Gemma-style ones. Axis glossary used across specjax:
  B batch, T tokens in one call, S cache capacity (slots), P prompt width,
  V vocabulary, D d_model, N query heads, K kv heads, G = N // K, H head dim,
  F d_ff, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from specjax.dtypes import DTYPES, to_dtype
from specjax.validation import is_int

# The implementations of attention a model may run (`specjax.models.attention`).
ATTENTION_IMPLS = ("auto", "einsum", "dot_product", "pallas")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (`rope_type` in Hugging Face configs).

  kind "llama3": wavelengths longer than original_max_len / low_freq_factor are
  divided by `factor`, those shorter than original_max_len / high_freq_factor
  kept, and the band between interpolated smoothly.
  kind "linear" (position interpolation, Gemma 3): every frequency divided by
  `factor`; the other fields are unused.
  """

  factor: float
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  original_max_len: int | None = None
  kind: Literal["llama3", "linear"] = "llama3"

  def __post_init__(self):
    if self.kind not in ("llama3", "linear"):
      raise ValueError(f"RopeScaling.kind must be 'llama3' or 'linear', got {self.kind!r}.")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}.")
    if self.kind == "llama3" and not (
      self.original_max_len is not None
      and self.original_max_len > 0
      and self.low_freq_factor is not None
      and self.high_freq_factor is not None
      and 0 < self.low_freq_factor < self.high_freq_factor
    ):
      raise ValueError(
        "RopeScaling of kind 'llama3' needs original_max_len > 0 and "
        f"0 < low_freq_factor < high_freq_factor, got {self}."
      )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a `specjax.Transformer`.

  Attributes:
    vocab_size, d_model, n_layers, n_heads, d_ff: V, D, L, N, F.
    n_kv_heads: key/value heads K (grouped-query attention); N % K == 0.
    max_seq_len: the longest sequence (prompt + generation + draft slack).
    head_dim: per-head width H; defaults to d_model // n_heads.
    rope_theta: RoPE base frequency (used when positions == "rope").
    rope_scaling: optional Llama 3 frequency scaling of RoPE.
    sliding_window: if set, position i reads keys in (i - sliding_window, i].
    local_layers: the layers (0-based) using `sliding_window`; None: all.
    rope_local_theta: RoPE base of the `local_layers`, without `rope_scaling`
      (Gemma 3); None: every layer uses rope_theta and rope_scaling.
    norm_eps: epsilon of the normalisation layers.
    norm: "rmsnorm" (Llama) or "layernorm" (GPT-2).
    norm_offset: the norms multiply by `norm_offset + scale` (Gemma: 1.0).
    sandwich_norms: norms on the sublayers' outputs too (Gemma 2/3).
    scale_embeddings: embeddings times sqrt(d_model), rounded to the compute
      dtype (Gemma).

    mlp: "swiglu" (gated SiLU, Llama), "geglu" (gated tanh-GELU, Gemma) or
      "gelu" (plain GELU, GPT-2).
    attn_scale: the factor on q.k scores; None: head_dim ** -0.5 (Gemma:
      query_pre_attn_scalar ** -0.5).
    attn_softcap: scores become tanh(s / c) * c before the mask (Gemma 2).
    logit_softcap: output logits become tanh(l / c) * c (Gemma 2).
    positions: "rope" (rotary) or "learned" (absolute embedding table).
    qkv_bias: bias on the q/k/v projections (Qwen2, GPT-2).
    qk_norm: an RMSNorm over each head's query and key, before RoPE (Qwen3).
    out_bias: bias on the attention output projection (GPT-2).
    mlp_bias: biases in the MLP (GPT-2).
    tie_embeddings: the output head reuses the token embedding matrix.
    dtype: compute dtype of activations ("float32", "bfloat16", "float16").
    param_dtype: storage dtype of the parameters.
    init_std: standard deviation of the normal initialiser of weight matrices.
    scan_layers: stacked blocks run in a loop (`specjax/models/scan.py`); None:
      the platform's default (`default_scan_layers`).
    attention: "auto" (the platform's choice: on GPU a decode call's RoPE, cache
      write and attention in one kernel, `specjax.kernels.append_attention`;
      elsewhere, and for calls it does not take, "einsum"), "einsum",
      "dot_product" or "pallas" (`specjax.models.attention`); only "auto" and
      "einsum" have soft-capping (through "einsum").
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  max_seq_len: int
  head_dim: int | None = None
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  sliding_window: int | None = None
  local_layers: tuple[int, ...] | None = None
  rope_local_theta: float | None = None
  norm_eps: float = 1e-5
  norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
  norm_offset: float = 0.0
  sandwich_norms: bool = False
  scale_embeddings: bool = False
  mlp: Literal["swiglu", "geglu", "gelu"] = "swiglu"
  attn_scale: float | None = None
  attn_softcap: float | None = None
  logit_softcap: float | None = None
  positions: Literal["rope", "learned"] = "rope"
  qkv_bias: bool = False
  qk_norm: bool = False
  out_bias: bool = False
  mlp_bias: bool = False
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  init_std: float = 0.02
  scan_layers: bool | None = None
  attention: Literal["auto", "einsum", "dot_product", "pallas"] = "auto"

  def __post_init__(self):
    self._check_sizes()
    self._check_windows()
    self._check_scalars()

  def _check_sizes(self) -> None:
    """The integer sizes: positive, heads dividing evenly, an even RoPE head dimension."""
    for name in (
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "d_ff",
      "max_seq_len",
    ):
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive integer (>= 1), got {value!r}.")
      object.__setattr__(self, name, int(value))  # numpy integers hash like ints
    if self.head_dim is not None and (not is_int(self.head_dim) or self.head_dim < 1):
      raise ValueError(
        f"ModelConfig.head_dim must be None or a positive integer, got {self.head_dim!r}."
      )
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
        f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads "
        f"({self.n_heads}) unless head_dim is given."
      )
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
        f"ModelConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})."
      )
    if self.positions == "rope" and self.resolved_head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.resolved_head_dim}.")

  def _check_windows(self) -> None:
    """The sliding window and the layers that use it."""
    if self.sliding_window is not None and (
      not is_int(self.sliding_window) or self.sliding_window < 1
    ):
      raise ValueError(
        f"ModelConfig.sliding_window must be None or an integer >= 1, got {self.sliding_window!r}."
      )
    if self.local_layers is not None:
      layers = tuple(self.local_layers)
      if self.sliding_window is None:
        raise ValueError("ModelConfig.local_layers needs a sliding_window.")
      if any(not is_int(i) or not 0 <= i < self.n_layers for i in layers) or len(
        set(layers)
      ) != len(layers):
        raise ValueError(
          f"ModelConfig.local_layers must be distinct layer indices in [0, {self.n_layers}), "
          f"got {self.local_layers!r}."
        )
      object.__setattr__(self, "local_layers", tuple(int(i) for i in layers))

  def _check_scalars(self) -> None:
    """The float parameters (positive where they must be) and the named choices."""
    for name in ("rope_local_theta", "attn_scale", "attn_softcap", "logit_softcap"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"ModelConfig.{name} must be None or a number > 0, got {value!r}.")
    if self.scan_layers not in (None, True, False):
      raise ValueError(
        f"ModelConfig.scan_layers must be None, True or False, got {self.scan_layers!r}."
      )
    if not isinstance(self.norm_offset, (int, float)):
      raise ValueError(f"ModelConfig.norm_offset must be a number, got {self.norm_offset!r}.")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
    if not self.norm_eps > 0:
      raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}.")
    if not self.init_std > 0:
      raise ValueError(f"ModelConfig.init_std must be > 0, got {self.init_std!r}.")
    choices = {
      "norm": ("rmsnorm", "layernorm"),
      "mlp": ("swiglu", "geglu", "gelu"),
      "positions": ("rope", "learned"),
      "dtype": tuple(DTYPES),
      "param_dtype": tuple(DTYPES),
      "attention": ATTENTION_IMPLS,
    }
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(
          f"ModelConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}."
        )
    if self.attention not in ("auto", "einsum") and self.attn_softcap is not None:
      raise ValueError(
        f"ModelConfig.attention={self.attention!r} has no soft-capping, but "
        f"ModelConfig.attn_softcap={self.attn_softcap!r}: use attention='einsum' "
        "or leave attn_softcap None."
      )

  @property
  def resolved_head_dim(self) -> int:
    """H: head_dim if given, else d_model // n_heads."""
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer` (0-based); None: global attention."""
    if self.local_layers is None or layer in self.local_layers:
      return self.sliding_window
    return None

  def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of layer `layer`'s rotary embedding."""
    if self.rope_local_theta is not None and self.layer_window(layer) is not None:
      return self.rope_local_theta, None
    return self.rope_theta, self.rope_scaling

  @property
  def scanned(self) -> bool:
    """Whether the model runs scanned layers: `scan_layers`, or the platform's default."""
    return default_scan_layers() if self.scan_layers is None else bool(self.scan_layers)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return to_dtype(self.dtype, "ModelConfig.dtype")

  @property
  def weight_dtype(self) -> jnp.dtype:
    return to_dtype(self.param_dtype, "ModelConfig.param_dtype")

  def replace(self, **changes) -> ModelConfig:
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


def default_scan_layers(platform: str | None = None) -> bool:
  """Scanned layers by default on `platform` (default: the platform compiled
  for, `specjax.compiler_options.current_platform()`)? On TPU only. XLA:CPU
  copies each layer's weight slice before its product (docs/performance.md),
  and so does XLA:GPU (jax 0.10.2, H100: a `kDynamicSliceFusion` around a
  memcpy per weight and layer, each one splitting the step's command buffer
  and keeping the decode loop out of one), where unrolled layers read their
  weights in place and the whole loop is one command buffer.
  """

  from specjax import compiler_options

  return (platform or compiler_options.current_platform()) == "tpu"

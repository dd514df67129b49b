"""The one table of dtype names specjax accepts (configs, flags, checkpoints)."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def to_dtype(name: str, arg: str = "dtype") -> jnp.dtype:
  """`"bfloat16"` -> `jnp.dtype(bfloat16)`; raises naming `arg` for other names."""
  if name not in DTYPES:
    raise ValueError(f"{arg} must be one of {sorted(DTYPES)}, got {name!r}.")
  return jnp.dtype(DTYPES[name])


def dtype_name(dtype, arg: str = "dtype") -> str:
  """`jnp.bfloat16` (or `"bfloat16"`) -> `"bfloat16"`; raises naming `arg` otherwise."""
  for name, value in DTYPES.items():
    try:
      if jnp.dtype(dtype) == jnp.dtype(value):
        return name
    except TypeError:
      break
  raise ValueError(f"{arg} must be one of {sorted(DTYPES)}, got {dtype!r}.")

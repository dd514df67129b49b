"""safetensors files read one tensor at a time: memory-mapped, read-only NumPy views,
bfloat16 and float8 as ml_dtypes types (which safetensors' own NumPy reader refuses),
with no jax program compiled. The Hugging Face loaders (`specjax.hf.weights`) and the
heads' own files (`specjax.heads.files`) read through it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np

# safetensors dtype names -> NumPy dtypes (jax's ml_dtypes types for those NumPy lacks).
_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": jnp.bfloat16,
  "F8_E4M3": jnp.float8_e4m3fn,
  "F8_E5M2": jnp.float8_e5m2,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def read_tensors(
  files: list[str], skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, str, np.ndarray]]:
  """Yields (file, name, array) one tensor at a time, shard after shard; names
  for which `skip` is true are never read (a multimodal checkpoint's vision tower).

  Arrays are read-only NumPy views of the memory-mapped file (bfloat16 and
  float8 as ml_dtypes types), so a tensor's bytes are read when it is used.
  A file safetensors cannot parse (bad header, truncated) raises ValueError
  naming it.
  """
  from safetensors import safe_open  # imported here: only loading needs it

  for path in files:
    try:  # safetensors checks the header and the offsets against the file's size
      with safe_open(path, framework="numpy"):
        pass
      with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    except Exception as e:  # safetensors raises its own error types
      raise ValueError(f"cannot read safetensors file {path}: {e}") from e
    entries = {n: e for n, e in header.items() if n != "__metadata__" and not skip(n)}
    if os.path.getsize(path) > 8 + size:
      data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
    else:  # only empty tensors: mmap refuses an empty range
      data = np.zeros(0, np.uint8)
    for name, entry in sorted(entries.items()):  # in name order, as safetensors lists them
      dtype = _DTYPES.get(entry["dtype"])
      if dtype is None:
        raise ValueError(
          f"cannot read tensor {name!r} of safetensors file {path}: dtype "
          f"{entry['dtype']} is not one of {sorted(_DTYPES)}"
        )
      start, stop = entry["data_offsets"]
      yield path, name, data[start:stop].view(dtype).reshape(entry["shape"])

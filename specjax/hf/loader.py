"""`load_model`: a local Hugging Face checkpoint directory -> (Transformer, Tokenizer)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specjax.data.tokenizer import Tokenizer
from specjax.dtypes import dtype_name
from specjax.hf import config as hf_config
from specjax.hf import weights
from specjax.hf.hub import resolve_checkpoint
from specjax.models.scan import stack_layer_params
from specjax.models.transformer import Transformer
from specjax.validation import read_json_object


def read_config(path: str) -> dict:
  """The parsed `config.json` of checkpoint directory `path`.

  Raises FileNotFoundError for a missing directory or file and ValueError naming
  the file when it is not a JSON object.
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory {path} does not exist")
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"no config.json in {path}")
  return read_json_object(file)


def load_tokenizer(path: str) -> Tokenizer | None:
  """The `Tokenizer` of `path/tokenizer.json`, or None when there is none.

  Raises ValueError naming the file when it cannot be parsed.
  """
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  return Tokenizer.from_file(file)


def load_model(
  path: str,
  dtype=jnp.bfloat16,
  mesh: Mesh | None = None,
  rules: Mapping[str, str | None] | None = None,
  *,
  revision: str | None = None,
  cache_dir: str | None = None,
  allow_download: bool = False,
  scan_layers: bool | None = None,
) -> tuple[Transformer, Tokenizer | None]:
  """Loads a checkpoint of a supported family (`specjax.hf.config.SUPPORTED`:
  Llama/SmolLM, Mistral, Qwen2/3, Phi-3, Gemma 2/3, GPT-2) from a local directory
  or the local Hugging Face cache.

  Reads `config.json`, `model.safetensors` (or the shards listed in
  `model.safetensors.index.json`) and `tokenizer.json` when present. Tensors are
  converted one at a time straight into `dtype` (parameters and computation).

  Args:
    path: directory as written by `save_pretrained`, or a hub repo id
      ("org/name") resolved offline in the local Hugging Face cache
      (`specjax.hf.resolve_checkpoint`, with `revision`, `cache_dir` and
      `allow_download`).
    dtype: jnp.float32, jnp.bfloat16 or jnp.float16.
    mesh: optional `jax.sharding.Mesh`: each tensor goes straight into its
      sharding under `rules` (default `specjax.distributed.LOGICAL_RULES`);
      every device receives only its own shard, one tensor at a time.
    scan_layers: the model's layer layout (`ModelConfig.scan_layers`; None:
      the platform's default). Checkpoints are the same either way.

  Returns:
    `(model, tokenizer)`: a `specjax.Transformer` and a
    `specjax.data.tokenizer.Tokenizer` (None if the directory has no tokenizer.json).

  Raises:
    FileNotFoundError: a missing directory, config.json or weights file.
    ValueError: a bad dtype, config.json, tokenizer.json or weights file (the
      message names the file, and the field or tensor).
  """
  name = dtype_name(dtype)
  path = resolve_checkpoint(path, revision, cache_dir, allow_download)
  hf = read_config(path)
  cfg = hf_config.model_config(hf, name, source=os.path.join(path, "config.json"))
  cfg = cfg.replace(scan_layers=scan_layers)
  # Everything cheap is checked before any tensor is read.
  tokenizer = load_tokenizer(path)
  files = weights.shard_files(path)
  # Tensors are read into the unrolled layout (one path per layer), then stacked
  # for scanned layers.
  unrolled = nnx.eval_shape(lambda: Transformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0)))
  flat = nnx.to_flat_state(nnx.state(unrolled))
  place = _placer(unrolled, mesh, rules)
  params = weights.load_params(
    hf["model_type"], cfg, {p: v.get_value() for p, v in flat}, files, place
  )
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  if cfg.scanned:
    params = stack_layer_params(params, cfg.n_layers)
    if mesh is not None:
      params = _placed(params, abstract, mesh, rules)
  graphdef, state = nnx.split(abstract)
  loaded = nnx.from_flat_state([(p, v.replace(params[p])) for p, v in nnx.to_flat_state(state)])
  return nnx.merge(graphdef, loaded), tokenizer


def _placed(params: dict, abstract: Transformer, mesh: Mesh, rules) -> dict:
  """`params` (flat) moved into their shardings in `abstract` on `mesh`."""
  from specjax.distributed.mesh import LOGICAL_RULES
  from specjax.distributed.placement import param_shardings

  shardings = nnx.to_flat_state(param_shardings(abstract, mesh, rules or LOGICAL_RULES))
  return {p: jax.device_put(params[p], s.get_value()) for p, s in shardings}


def _placer(
  abstract: Transformer, mesh: Mesh | None, rules: Mapping[str, str | None] | None
) -> Callable[[weights.Path, np.ndarray], jax.Array] | None:
  """`weights.load_params`'s `place`: puts each parameter (by its path in `abstract`)
  into its sharding on `mesh` under `rules` (None: `LOGICAL_RULES`). None without a
  mesh: `load_params` then puts each tensor on the default device."""
  if mesh is None:
    return None
  from specjax.distributed.mesh import LOGICAL_RULES
  from specjax.distributed.placement import param_shardings

  shardings = {
    p: v.get_value()
    for p, v in nnx.to_flat_state(param_shardings(abstract, mesh, rules or LOGICAL_RULES))
  }
  return functools.partial(_place, shardings)


def _place(
  shardings: dict[weights.Path, jax.sharding.Sharding], param_path: weights.Path, value: np.ndarray
) -> jax.Array:
  """`value` (one tensor on the host) as an array sharded by `shardings[param_path]`:
  each device receives only its slice."""
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, shardings[param_path], lambda index: host[index])


def check_same_tokenizer(
  target_tokenizer, draft_tokenizer, target_path: str, draft_path: str
) -> None:
  """Raises unless both tokenizers map the same strings to the same ids.

  Takes the `Tokenizer`s `load_model` returns; None (no tokenizer.json) skips the
  check. Drafts with a different vocabulary *size* but the same tokenizer
  (Qwen2.5 0.5B vs 7B) pass; different tokenizers would need a token mapping.
  """
  if target_tokenizer is None or draft_tokenizer is None:
    return
  if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
    raise ValueError(
      f"the target ({target_path}) and draft ({draft_path}) use different "
      "tokenizers; a plain draft needs the target's vocabulary. Draft across "
      "tokenizers with specjax.drafting.CrossTokenizerDrafter or "
      "specjax.string_level_generate (experiments.decode: "
      "--config.drafter=cross_tokenizer or string_level)."
    )

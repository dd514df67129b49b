"""The attention implementations (`specjax.models.attention`) against the einsum
reference: prefill, ragged decode over stale slots, sliding windows, GQA and MHA,
token trees, the whole model's logits and greedy tokens, and the config's refusals.

The Pallas decode kernel runs in interpret mode here (SPECJAX_PALLAS_INTERPRET=1),
the same kernel a GPU compiles with Triton, executed as JAX operations on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import TINY, TINY_DRAFT
from specjax import compiler_options, trees
from specjax.models import attention as attention_lib
from specjax.models.attention import attend, attention
from specjax.models.transformer import attention_mask

S = 32  # cache slots: a multiple of 16, so the Pallas kernel can tile it
H = 16  # head dim: the kernel's smallest
LENGTHS = (3, 17, 28)  # each row's cached prefix; slots past it hold stale data
TOL = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 3e-2}


@pytest.fixture(autouse=True)
def interpret_pallas(monkeypatch):
  monkeypatch.setenv("SPECJAX_PALLAS_INTERPRET", "1")


def _qkv(t: int, n: int, k: int, dtype, stale_from: jax.Array):
  """Random q `[B, T, N, H]`, k and v `[B, K, S, H]`, with large values in every
  slot at or past `stale_from [B]` (a read of one moves the output far)."""
  b = stale_from.shape[0]
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, t, n, H))
  keys = jax.random.normal(kk, (b, k, S, H))
  values = jax.random.normal(kv, (b, k, S, H))
  stale = (jnp.arange(S)[None, :] >= stale_from[:, None])[:, None, :, None]
  keys = jnp.where(stale, 30.0, keys)
  values = jnp.where(stale, 100.0, values)
  return q.astype(dtype), keys.astype(dtype), values.astype(dtype)


def _plain_case(t: int, n: int, k: int, window: int | None, dtype):
  """q, k, v and the causal (windowed) mask of T tokens after each row's prefix."""
  lengths = jnp.array(LENGTHS, jnp.int32)
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  mask = attention_mask(positions, jnp.arange(S, dtype=jnp.int32), window)
  return (*_qkv(t, n, k, dtype, lengths + t), mask)


def _check(impl: str, q, k, v, mask, scale=None, contiguous=True):
  got = jax.jit(lambda *a: attention(*a, scale=scale, impl=impl, contiguous=contiguous))(
    q, k, v, mask
  )
  want = attend(q, k, v, mask, scale)
  assert got.shape == q.shape and got.dtype == q.dtype
  tol = TOL[q.dtype]
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
  )


CASES = {
  # name: (T, N, K, window)
  "prefill": (5, 4, 2, None),
  "decode-gqa": (1, 4, 2, None),
  "decode-mha": (1, 2, 2, None),
  "decode-window": (1, 4, 2, 4),
  "prefill-window": (5, 4, 2, 4),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["dot_product", "pallas"])
def test_impls_match_the_einsum_reference(impl, case, dtype):
  t, n, k, window = CASES[case]
  _check(impl, *_plain_case(t, n, k, window, dtype), scale=0.3 if case == "prefill" else None)


@pytest.mark.parametrize("case", ["decode-gqa", "decode-window"])
def test_pallas_decode_runs_the_kernel_within_each_row(monkeypatch, case):
  """The decode calls go through the kernel, not the fallback (here NaN), and the
  kernel stops at each row's length: the stale slots would move the output."""
  q, k, v, mask = _plain_case(*CASES[case][:3], CASES[case][3], jnp.float32)

  def no_fallback(q, *_):
    return jnp.full(q.shape, jnp.nan, q.dtype)

  monkeypatch.setattr(attention_lib, "dot_product_attend", no_fallback)
  jaxpr = str(jax.make_jaxpr(lambda *a: attention(*a, impl="pallas"))(q, k, v, mask))
  assert "pallas_call" in jaxpr
  _check("pallas", q, k, v, mask)
  # The same call reading every slot is far off: the garbage is there to be missed.
  everything = jnp.ones_like(mask)
  assert not np.allclose(attend(q, k, v, everything), attend(q, k, v, mask), atol=1.0)


@pytest.mark.parametrize("impl", ["dot_product", "pallas"])
@pytest.mark.parametrize("nodes", [(0, 5), (4, 5)], ids=["block", "one-node"])
def test_tree_masks(impl, nodes):
  """A token tree's block (T > 1) and one node whose ancestors leave holes in its
  mask (T == 1: told the mask is no run of slots, the Pallas path falls back, its
  kernel reads one run of slots; the model passes contiguous=False for trees)."""
  tree = trees.Tree.static(trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)]))
  lengths = jnp.array(LENGTHS, jnp.int32)
  start, stop = nodes
  _, _, mask = trees.tree_attention(lengths, S, tree, start, stop, sliding_window=6)
  q, k, v = _qkv(stop - start, 4, 2, jnp.float32, lengths + tree.num_nodes)
  if stop - start == 1:
    assert not bool(attention_lib.mask_span(mask[:, 0])[2])
  _check(impl, q, k, v, mask, contiguous=False)


LIVE = (3, 2, 1)  # lengths whose spans (+ T <= 5) fit the smallest prefix, 8 slots


@pytest.mark.parametrize(
  "impl, case",
  [
    ("einsum", "prefill"),
    ("einsum", "decode-gqa"),
    ("einsum", "decode-window"),
    ("dot_product", "prefill-window"),
    ("pallas", "prefill"),
  ],
)
def test_spans_read_only_the_live_prefix(monkeypatch, impl, case):
  """With per-row spans the XLA paths read the smallest prefix of the cache
  (8, 16 or 32 slots here) that covers the batch's longest row: the same
  function as the reference over every slot, and NaN past the prefix (which
  any read of it would spread) never reaches the output."""
  monkeypatch.setattr(attention_lib, "_MIN_PREFIX", 8)
  assert attention_lib.prefix_sizes(S) == (8, 16, 32)
  t, n, k, window = CASES[case]
  run = lambda q, k, v, mask, spans: attention(q, k, v, mask, impl=impl, spans=spans)
  # LENGTHS: the largest span needs all 32 slots; LIVE: 8 (stale slots beyond, NaN past 8).
  for lengths in (LENGTHS, LIVE):
    lengths = jnp.array(lengths, jnp.int32)
    spans = lengths + t
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    mask = attention_mask(positions, jnp.arange(S, dtype=jnp.int32), window)
    q, keys, values = _qkv(t, n, k, jnp.float32, spans)
    want = attend(q, keys, values, mask)
    if int(spans.max()) <= 8:
      keys, values = keys.at[:, :, 8:].set(jnp.nan), values.at[:, :, 8:].set(jnp.nan)
    got = jax.jit(run)(q, keys, values, mask, spans)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert "cond" in str(jax.make_jaxpr(run)(q, keys, values, mask, spans))


def test_spans_in_the_whole_model(monkeypatch, einsum_outputs, prompts):
  """The model passes each call's spans: with prefixes of 8 slots and up, the
  cached calls (prefill, decode, verification blocks) give the same tokens."""
  monkeypatch.setattr(attention_lib, "_MIN_PREFIX", 8)
  traced = []
  on_live_prefix = attention_lib._on_live_prefix

  def counted(fn, q, *args):
    traced.append(q.shape[1])
    return on_live_prefix(fn, q, *args)

  monkeypatch.setattr(attention_lib, "_on_live_prefix", counted)
  # The same weights under another config (max_seq_len: only a bound), so the
  # generate programs trace again with the small prefixes.
  target, draft = _pair("einsum", sliding_window=5, local_layers=(0,), max_seq_len=96)
  ar, spec = einsum_outputs
  out = specjax.autoregressive_generate(target, *prompts, **AR)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  out = specjax.speculative_generate(target, draft, *prompts, **SPEC)
  np.testing.assert_array_equal(out.tokens, spec.tokens)
  assert {1, SPEC["gamma"] + 1} <= set(traced)  # decode calls and verification blocks


@pytest.mark.parametrize("h", [16, 128], ids=["slots-minor", "head-minor"])
@pytest.mark.parametrize("case", ["prefill-window", "decode-gqa", "decode-window"])
def test_tpu_kernel_reads_each_rows_live_blocks(case, h):
  """The TPU (Mosaic) kernel in interpret mode, in both of its cache layouts: the
  reference's output, with NaN in every block of 8 slots past each row's last
  (any copy of one into the kernel would spread it) and stale slots before."""
  t, n, k, window = CASES[case]
  lengths = jnp.array(LENGTHS, jnp.int32)
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  mask = attention_mask(positions, jnp.arange(S, dtype=jnp.int32), window)
  q, keys, values = _qkv(t, n, k, jnp.float32, lengths + t)
  q, keys, values = (jnp.tile(x, (1, 1, 1, h // H)) for x in (q, keys, values))
  want = attend(q, keys, values, mask)
  past = jnp.arange(S)[None, :] >= -(-(lengths + t) // 8)[:, None] * 8
  keys, values = (jnp.where(past[:, None, :, None], jnp.nan, x) for x in (keys, values))
  got = attention_lib._tpu_attend(q, keys, values, mask, None, block=8, interpret=True)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("contiguous", [True, False])
def test_pallas_for_tpu_takes_the_kernel(monkeypatch, contiguous):
  """Traced for a TPU, "pallas" calls with one run of slots per query (decode and
  blocks) go through the Mosaic kernel; token trees through the live prefix."""
  monkeypatch.setattr(attention_lib, "_MIN_PREFIX", 8)
  q, k, v, mask = _plain_case(5, 4, 2, None, jnp.float32)
  spans = jnp.array(LENGTHS, jnp.int32) + 5
  with compiler_options.target_platform("tpu"):
    jaxpr = str(
      jax.make_jaxpr(lambda *a: attention(*a, impl="pallas", contiguous=contiguous, spans=spans))(
        q, k, v, mask
      )
    )
  assert ("specjax_ragged_attention" in jaxpr) == contiguous
  assert (" cond[" in jaxpr) != contiguous


def test_pallas_falls_back_where_the_kernel_cannot_tile():
  """Head dims and slot counts the kernel cannot tile take the dot_product path."""
  q, k, v, mask = _plain_case(1, 4, 2, None, jnp.float32)
  assert attention_lib._kernel_tiling(q, k) is not None
  assert attention_lib._kernel_tiling(q[..., :8], k[..., :8]) is None
  assert attention_lib._kernel_tiling(q, k[:, :, :24]) is None
  _check("pallas", q, k[:, :, :30], v[:, :, :30], mask[..., :30])


def _pair(impl: str, **overrides):
  cfg = specjax.ModelConfig(**{**TINY, **overrides, "attention": impl})
  return (
    specjax.Transformer(cfg, rngs=nnx.Rngs(0)),
    specjax.Transformer(cfg.replace(**TINY_DRAFT), rngs=nnx.Rngs(1)),
  )


@pytest.fixture(scope="module")
def einsum_pair():
  return _pair("einsum", sliding_window=5, local_layers=(0,))


# 9 prompt slots + 23 new tokens, or + 19 and a block of gamma + 1 = 4: 32 cache
# slots either way, which the Pallas kernel tiles.
AR = dict(max_new_tokens=23, sampling=specjax.GREEDY)
SPEC = dict(max_new_tokens=19, sampling=specjax.GREEDY, gamma=3)


@pytest.fixture(scope="module")
def einsum_outputs(einsum_pair, prompts):
  target, draft = einsum_pair
  return (
    specjax.autoregressive_generate(target, *prompts, **AR),
    specjax.speculative_generate(target, draft, *prompts, **SPEC),
  )


@pytest.mark.parametrize("impl", ["dot_product", "auto"])
def test_whole_model_matches_einsum(monkeypatch, impl, einsum_pair, einsum_outputs, prompts):
  """Same weights: logits within rounding and the same greedy tokens, autoregressive
  and speculative; with "auto" (interpreted as on a GPU) every cached call goes
  through the one-kernel path (`specjax.kernels.append_attention`), sliding-window
  layers included. "pallas" sends these calls there too (it differs only in the
  calls the kernel does not take, which the tests above check one by one)."""
  from specjax.kernels import append_attention as appended

  kernel_calls = []
  kernel = appended.append_attention

  def counted(qkv, *args, **kwargs):
    kernel_calls.append(qkv.shape)
    return kernel(qkv, *args, **kwargs)

  monkeypatch.setattr(appended, "append_attention", counted)
  target, draft = _pair(impl, sliding_window=5, local_layers=(0,))
  tokens = prompts[0]
  np.testing.assert_allclose(target(tokens), einsum_pair[0](tokens), atol=1e-5, rtol=1e-5)
  ar, spec = einsum_outputs
  out = specjax.autoregressive_generate(target, *prompts, **AR)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  out = specjax.speculative_generate(target, draft, *prompts, **SPEC)
  np.testing.assert_array_equal(out.tokens, spec.tokens)
  np.testing.assert_array_equal(out.num_generated, spec.num_generated)
  # Traced once per layer of each cached call: the target's (2 layers), the draft's (1),
  # at one query (decoding, drafting) and at gamma + 1 (verifying).
  assert len(kernel_calls) >= (3 if impl != "dot_product" else 0)
  assert impl != "dot_product" or not kernel_calls
  if kernel_calls:
    assert {shape[1] for shape in kernel_calls} >= {1, SPEC["gamma"] + 1}


@pytest.mark.parametrize(
  "fields, message",
  [
    (
      dict(attention="flash"),
      r"attention must be one of \('auto', 'einsum', 'dot_product', 'pallas'\)",
    ),
    (dict(attention="dot_product", attn_softcap=50.0), "attention='dot_product'.*attn_softcap"),
    (dict(attention="pallas", attn_softcap=50.0), "attention='pallas'.*attn_softcap"),
  ],
)
def test_config_refusals(tiny_cfg, fields, message):
  with pytest.raises(ValueError, match=message):
    tiny_cfg.replace(**fields)
  assert tiny_cfg.replace(attn_softcap=50.0).attention == "auto"


def test_dispatcher_refusals():
  q, k, v, mask = _plain_case(1, 4, 2, None, jnp.float32)
  with pytest.raises(ValueError, match="one of"):
    attention(q, k, v, mask, impl="flash")
  with pytest.raises(ValueError, match="no soft-capping"):
    attention(q, k, v, mask, cap=50.0, impl="dot_product")

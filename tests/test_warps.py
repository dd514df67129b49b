"""Penalties, logit bias, min-p and stop settings as warps (issue 65, requirement 1).

The warp at each position reads the row's text up to it, drafted tokens included
(`TokenHistory.along`): the speculative rules keep the target's law of the first
three tokens with every warp on (chi-square on V = 8, as tests/test_distribution.py),
greedy speculation gives plain greedy decoding, coupled speculation the plain
coupled text, and the stop settings stop rows where they should.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import specjax
from helpers import chisquare_pvalue, make_drafter, sequence_counts
from specjax.sampling import RowSampling, TokenHistory

V, ROWS, NEW = 8, 20_000, 3
PROMPT = jnp.array([1, 5, 2, 7], jnp.int32)

# Every warp that reads the text, on at once (temperature above 1 keeps the law wide).
WARPED = specjax.SamplingParams(
  temperature=1.2,
  presence_penalty=0.6,
  frequency_penalty=0.8,
  repetition_penalty=1.5,
  logit_bias={3: 1.5, 6: -2.0},
  min_p=0.05,
)


@pytest.fixture(scope="module")
def pair():
  cfg = specjax.ModelConfig(
    vocab_size=V,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=64,
    max_seq_len=16,
    init_std=0.4,
  )
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(cfg, rngs=nnx.Rngs(1))
  params = nnx.state(target, nnx.Param)
  noise = nnx.state(draft, nnx.Param)
  nnx.update(draft, jax.tree.map(lambda p, n: p + 0.6 * n, params, noise))
  return target, draft


@jax.jit
def _warped(target, seqs, sampling):
  """Each sequence's warped laws of its last three tokens, each read with the
  generated tokens before it (the prompt: the first len(PROMPT) ids)."""
  n = len(PROMPT)
  logits = target(seqs)[:, n - 1 :]  # [S, 3, V], before t1, t2, t3
  generated = seqs[:, n:]  # [S, 2]
  history = TokenHistory.of_prompts(seqs[:, :n], jnp.full((seqs.shape[0],), n, jnp.int32), V).along(
    generated
  )
  return specjax.warp_probs(logits, sampling.with_history(history, None))


def exact_joint(target, params):
  """`[V, V, V]` law of the first three tokens under `params`, from full forwards
  and the penalties of each prefix."""
  pairs = jnp.array(list(itertools.product(range(V), repeat=2)), jnp.int32)
  seqs = jnp.concatenate([jnp.tile(PROMPT, (V * V, 1)), pairs], axis=1)
  probs = np.asarray(_warped(target, seqs, RowSampling.of(params, V * V)), np.float64)
  p1 = probs[0, 0]
  p2 = probs[::V, 1].reshape(V, V)
  p3 = probs[:, 2].reshape(V, V, V)
  return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, joint):
  return chisquare_pvalue(sequence_counts(tokens, V), joint)


def _rows():
  return jnp.tile(PROMPT, (ROWS, 1)), jnp.full((ROWS,), len(PROMPT), jnp.int32)


def test_the_warp_changes_the_law(pair):
  """The harness sees the penalties: the warped law is not the plain one."""
  target, _ = pair
  warped = exact_joint(target, WARPED)
  plain = exact_joint(target, specjax.SamplingParams(temperature=1.2))
  assert np.abs(warped - plain).sum() > 0.2
  # Plain decoding follows the warped law (the harness itself is right).
  prompts, lengths = _rows()
  ar = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=NEW, sampling=WARPED, key=jax.random.key(1)
  )
  assert pvalue(ar.tokens, warped) > 1e-3
  assert pvalue(ar.tokens, plain) < 1e-6


TREE = specjax.trees.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])


# The head drafter's case (q from the committed text's warp) in the slow tier.
@pytest.mark.sample("token", "block", "tree", "coupled")
@pytest.mark.parametrize("rule", ["token", "block", "tree", "coupled", "head"])
def test_speculative_rules_keep_the_warped_law(pair, rule):
  """Chain drafts (the draft model advances its counts along the chain) under the
  token and block rules, a token tree and an EAGLE head's chain (whose drafters
  warp q with the committed counts only: still exact, q is the law they drew
  from) and the coupled rule (per-row keys; equal to plain coupled decoding)
  follow the warped law."""
  target, draft = pair
  prompts, lengths = _rows()
  joint = exact_joint(target, WARPED)
  run = dict(max_new_tokens=NEW, sampling=WARPED)
  if rule == "tree":
    drafter = specjax.drafting.TreeDrafter(draft, TREE, tree_mode="without_replacement")
    spec = specjax.speculative_generate(
      target, drafter, prompts, lengths, gamma=len(TREE), key=jax.random.key(3), **run
    )
  elif rule == "coupled":
    keys = jax.random.split(jax.random.key(4), ROWS)
    spec = specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=2, key=keys, verifier="coupled", **run
    )
    ar = specjax.autoregressive_generate(target, prompts, lengths, key=keys, **run)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
  else:
    drafter = make_drafter("eagle", target, draft) if rule == "head" else draft
    spec = specjax.speculative_generate(
      target,
      drafter,
      prompts,
      lengths,
      gamma=2,
      key=jax.random.key(5),
      verifier="token" if rule == "head" else rule,
      **run,
    )
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted  # verification really decides
  assert pvalue(spec.tokens, joint) > 1e-3


# Every setting on, a different mix per row (greedy rows: temperature 0).
def _greedy_rows(eos):
  return [
    specjax.SamplingParams(
      temperature=0.0,
      presence_penalty=1.5,
      frequency_penalty=0.5,
      logit_bias={7: 3.0, 100: -5.0},
      min_tokens=4,
      stop_token_ids=(eos[1],),
    ),
    specjax.SamplingParams(temperature=0.0, repetition_penalty=1.8, min_p=0.2, ignore_eos=True),
    specjax.SamplingParams(
      temperature=0.0, frequency_penalty=2.0, repetition_penalty=0.7, min_tokens=20
    ),
    specjax.SamplingParams(temperature=0.0, presence_penalty=-1.0, logit_bias={3: 100.0}),
  ]


@struct.dataclass
class _Hashed(specjax.drafting.ModelDrafter):
  """A draft model whose confidence is a hash of its drafted tokens: the verify
  length (`verify_lengths`) then changes from iteration to iteration."""

  def propose(self, *args, **kwargs):
    proposal, state = super().propose(*args, **kwargs)
    return proposal._replace(confidence=(proposal.tokens % 5) / 4.0), state


@pytest.mark.sample("chain", "eagle2")  # a static tree and cut verification: slow tier
@pytest.mark.parametrize("drafter", ["chain", "tree", "eagle2", "verify_length"])
def test_greedy_speculation_equals_greedy_decoding_with_every_setting(
  target, noisy_target, prompts, greedy_reference, drafter
):
  """A ragged batch, each row its own penalties, bias, min-p and stop settings:
  speculative decoding (a chain that drafts with its counts, a token tree or
  EAGLE-2's per-row trees, which do not) gives plain greedy decoding's tokens,
  and the settings change them."""
  eos = [int(greedy_reference.tokens[0, 2]), int(greedy_reference.tokens[1, 5])]
  rows = RowSampling.of(_greedy_rows(eos))
  run = dict(max_new_tokens=16, sampling=rows, eos_id=eos)
  plain = specjax.autoregressive_generate(target, *prompts, **run)
  if drafter == "tree":
    draft = specjax.drafting.TreeDrafter(noisy_target, TREE, tree_mode="without_replacement")
    spec = specjax.speculative_generate(target, draft, *prompts, gamma=len(TREE), **run)
  elif drafter == "verify_length":  # chains cut by their confidence: p's counts follow the cut
    lengths = dict(verify_lengths=(1, 2, 4), verify_costs=(1.0, 1.05, 1.1))
    spec = specjax.speculative_generate(
      target, _Hashed(noisy_target), *prompts, gamma=4, **lengths, **run
    )
    verified, iterations = np.sum(spec.stats.proposed), np.sum(spec.stats.row_iterations)
    assert iterations < verified < 4 * iterations  # the verify length varied
  elif drafter == "eagle2":  # a fresh head: it agrees by chance, if ever
    spec_tree = specjax.trees.DynamicTree(size=6, depth=3, branch=2, expand=2)
    draft = make_drafter("eagle", target, None).replace(tree=spec_tree)
    spec = specjax.speculative_generate(target, draft, *prompts, gamma=6, **run)
  else:
    spec = specjax.speculative_generate(target, noisy_target, *prompts, gamma=3, **run)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.num_generated, plain.num_generated)
  if drafter != "eagle2":
    assert 0 < float(spec.stats.acceptance_rate) < 1
  assert not np.array_equal(plain.tokens, greedy_reference.tokens)


def test_seeded_coupled_speculation_equals_plain_coupled_decoding(target, noisy_target, prompts):
  """Per-row keys: the coupled rule (chain and tree) gives the plain coupled text
  with every warp on (sampled rows, a greedy row among them)."""
  rows = RowSampling.of(
    [
      specjax.SamplingParams(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5),
      specjax.SamplingParams(temperature=1.1, repetition_penalty=1.4, min_p=0.05, top_k=40),
      specjax.SamplingParams(temperature=0.7, logit_bias={5: 4.0}, min_tokens=3, top_p=0.9),
      specjax.SamplingParams(temperature=0.0, frequency_penalty=1.0),
    ]
  )
  keys = jax.random.split(jax.random.key(9), 4)
  run = dict(max_new_tokens=16, sampling=rows, key=keys, eos_id=[1, 2])
  plain = specjax.autoregressive_generate(target, *prompts, **run)
  chain = specjax.speculative_generate(target, noisy_target, *prompts, gamma=3, **run)
  draft = specjax.drafting.TreeDrafter(noisy_target, TREE, tree_mode="without_replacement")
  tree = specjax.speculative_generate(target, draft, *prompts, gamma=len(TREE), **run)
  for out in (chain, tree):
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.num_generated, plain.num_generated)
  assert 0 < float(chain.stats.acceptance_rate) < 1


def test_min_tokens_ignore_eos_and_stop_token_ids(target, noisy_target, prompts, greedy_reference):
  """A row does not stop before min_tokens (the EOS it would emit is masked), stops
  after a stop id, runs to its budget with ignore_eos; plain and speculative alike."""
  ref = np.asarray(greedy_reference.tokens)
  eos = int(ref[0, 1])  # row 0 would stop at index 1
  stop = int(ref[1, 3])  # row 1 stops at index 3 (or at an earlier occurrence)
  rows = RowSampling.of(
    [
      specjax.SamplingParams(temperature=0.0, min_tokens=6),
      specjax.SamplingParams(temperature=0.0, stop_token_ids=(stop,)),
      specjax.SamplingParams(temperature=0.0, ignore_eos=True),
      specjax.SamplingParams(temperature=0.0),
    ]
  )
  run = dict(max_new_tokens=16, sampling=rows, eos_id=eos)
  for out in (
    specjax.autoregressive_generate(target, *prompts, **run),
    specjax.speculative_generate(target, noisy_target, *prompts, gamma=3, **run),
  ):
    tokens, n = np.asarray(out.tokens), np.asarray(out.num_generated)
    assert n[0] > 6 and eos not in tokens[0, :6]
    np.testing.assert_array_equal(tokens[0, :1], ref[0, :1])  # the first token is not EOS
    first_stop = int(np.argmax(ref[1] == stop)) + 1
    assert n[1] == first_stop and tokens[1, n[1] - 1] == stop
    np.testing.assert_array_equal(tokens[1, : n[1]], ref[1, : n[1]])
    assert n[2] == 16  # ignore_eos: the budget
    np.testing.assert_array_equal(tokens[2], ref[2])
    hits = np.nonzero(ref[3] == eos)[0]
    assert n[3] == (hits[0] + 1 if len(hits) else 16)


def test_new_settings_do_not_recompile(target, noisy_target, prompts):
  """Per-row warps are data: other penalties, biases and stop ids (a static
  SamplingParams that sets them too) reuse the compiled programs."""
  from helpers import traces

  def run(params):
    specjax.speculative_generate(
      target, noisy_target, *prompts, gamma=3, max_new_tokens=8, sampling=params, eos_id=[1, 2]
    )
    specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=8, sampling=params, eos_id=[1, 2]
    )

  run(RowSampling.of(_greedy_rows([3, 4])))
  with traces() as traced:
    run(RowSampling.of(_greedy_rows([9, 11])[::-1]))
    run(specjax.SamplingParams(temperature=0.0, presence_penalty=0.3, logit_bias={4: 2.0}))
  assert not traced


BAD = [
  (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
  (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
  (dict(repetition_penalty=0), "repetition_penalty must be in (0, 2] and at least 1.175e-38"),
  # Past what float32 / int32 hold (issue 73): inf once stored, 0 once stored, wrapped.
  (dict(repetition_penalty=1e-45), "repetition_penalty must be in (0, 2] and at least 1.175e-38"),
  (dict(temperature=1e39), "temperature must be a number >= 0 and at most 3.403e+38"),
  (dict(min_tokens=2**31), "min_tokens must be an integer >= 0 and at most 2147483647"),
  (dict(presence_penalty=1e-45), "presence_penalty underflows float32"),
  (dict(logit_bias={"5": 1e-45}), "logit_bias underflows float32"),
  (dict(min_p=1.5), "min_p must be in [0, 1]"),
  (dict(min_tokens=-1), "min_tokens must be an integer >= 0 and at most 2147483647"),
  (dict(logit_bias={"5": 101}), "logit_bias values must be in [-100, 100]"),
  (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
  (dict(logit_bias={"\u0661\u0662": 1}), "logit_bias keys must be token ids"),  # Arabic-Indic
  (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias must have at most 300"),
  (dict(logit_bias={"600": 1}), "logit_bias ids must be in [0, vocab_size=512)"),
  (dict(stop_token_ids=[600]), "stop_token_ids ids must be in [0, vocab_size=512)"),
  (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_library_refuses_out_of_range_settings(target, prompts, fields, message):
  """SamplingParams (and the vocabulary check before compiling) name the field and
  its range."""
  with pytest.raises(ValueError, match=re.escape(message)):
    specjax.autoregressive_generate(
      target, *prompts, max_new_tokens=4, sampling=specjax.SamplingParams(**fields)
    )


def test_rows_built_by_hand_and_string_level_are_checked(target, draft, prompts):
  rows = RowSampling.of(_greedy_rows([3, 4])).replace(min_p=jnp.array([0.0, 2.0, 0.0, 0.0]))
  with pytest.raises(
    ValueError, match=re.escape("sampling.min_p must be in [0, 1] (0 = off); row 1")
  ):
    specjax.autoregressive_generate(target, *prompts, max_new_tokens=4, sampling=rows)
  with pytest.raises(ValueError, match="string-level decoding takes temperature, top_k and top_p"):
    specjax.string_level_generate(
      target,
      draft,
      None,
      None,
      *prompts,
      gamma=2,
      max_new_tokens=4,
      sampling=specjax.SamplingParams(temperature=0.0, min_p=0.1),
    )


def test_a_law_that_is_not_finite_stops_its_row(tiny_cfg):
  """Issue 73: a row whose law holds NaN (a valid repetition penalty, 2e-38,
  dividing logits scaled to hundreds past float32's range) is never sampled
  from: it stops, flagged in `stats.non_finite`, with none of that draw kept —
  at the prefill (0 tokens) or at a later step; a row without the setting runs
  on. Both loops."""
  target = specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  draft = specjax.Transformer(tiny_cfg, rngs=nnx.Rngs(1))
  for model in (target, draft):
    model.final_norm.scale[...] = model.final_norm.scale[...] * 300.0
  prompts = jnp.arange(8, dtype=jnp.int32)[:, None] * 37 + 5  # one token each
  lengths = jnp.ones((8,), jnp.int32)
  hot = specjax.SamplingParams(temperature=1.0, repetition_penalty=2e-38)
  rows = RowSampling.of([hot] * 7 + [specjax.SamplingParams(temperature=1.0)])
  run = dict(max_new_tokens=8, sampling=rows, key=jax.random.key(0))
  spec = specjax.speculative_generate(target, draft, prompts, lengths, gamma=3, **run)
  plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
  for out in (spec, plain):
    n, flagged = np.asarray(out.num_generated), np.asarray(out.stats.non_finite)
    assert n[7] == 8 and flagged[7] == 0
    assert (n[flagged == 1] < 8).all() and flagged.sum() >= 5
  n, flagged = np.asarray(spec.num_generated), np.asarray(spec.stats.non_finite)
  assert flagged[:7].all() and 0 in n[:7] and any(0 < k < 8 for k in n[:7])  # both paths


@pytest.fixture(scope="module")
def served():
  """(url, target, tokenizer): the tiny serving engine behind the app."""
  from helpers import SERVING_ENGINE, serve_app
  from specjax.data.chat import ChatTemplate
  from specjax.serving import Engine, EngineConfig
  from specjax.serving.background import BackgroundEngine
  from specjax.serving.http import make_app
  from specjax.testing import tiny_setup

  target, draft, tokenizer = tiny_setup(0)
  engine = Engine(target, draft, EngineConfig(policy="adaptive", **SERVING_ENGINE))
  background = BackgroundEngine(engine)
  template = ChatTemplate(TEMPLATE)
  url, server, thread = serve_app(make_app(background, tokenizer, "tiny", template))
  yield url, target, tokenizer, template
  server.should_exit = True
  thread.join(10)
  background.close()


TEMPLATE = (
  "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
  "{% if add_generation_prompt %}<a>{% endif %}"
)


def library_text(target, tokenizer, ids, params, n=16) -> tuple[str, int]:
  """`(text, tokens)` the library decodes after `ids` (padded to the engine's bucket)."""
  padded = np.zeros((1, 32), np.int32)
  padded[0, : len(ids)] = ids
  out = specjax.autoregressive_generate(
    target, jnp.asarray(padded), jnp.asarray([len(ids)]), max_new_tokens=n, sampling=params
  )
  count = int(out.num_generated[0])
  return tokenizer.decode(np.asarray(out.tokens)[0, :count].tolist()), count


HTTP_BAD = [(f, m.replace("512", "256")) for f, m in BAD]


@pytest.mark.parametrize("fields, message", HTTP_BAD, ids=[m.split()[0] for _, m in HTTP_BAD])
def test_http_refuses_the_same_settings(served, fields, message):
  """The server answers 400 with the library's message, naming the field."""
  import httpx

  response = httpx.post(served[0] + "/v1/completions", json={"prompt": "x", **fields})
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert message in error["message"] and error["param"] == next(iter(fields))


def test_http_penalties_give_the_librarys_text(served):
  """The official client sends the fields (completions through `extra_body` for
  vLLM's); a greedy request gives the library's text with the same settings, and
  chat takes them too."""
  import openai

  url, target, tokenizer, template = served
  client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
  prompt = "def add(a, b):\n"
  settings = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"101": 5.0, "32": -100})
  extra = dict(repetition_penalty=1.3, min_p=0.1, min_tokens=3, stop_token_ids=[10])
  out = client.completions.create(
    model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra, **settings
  )
  params = specjax.SamplingParams(temperature=0.0, **settings, **extra)
  ids = tokenizer.encode(prompt)
  expected, n = library_text(target, tokenizer, ids, params)
  assert out.choices[0].text == expected
  assert expected != library_text(target, tokenizer, ids, specjax.GREEDY)[0]
  assert " " not in expected  # id 32 (a space) is banned by its bias
  assert out.choices[0].finish_reason == ("stop" if n < 16 else "length")
  messages = [{"role": "user", "content": "hi"}]
  chat = client.chat.completions.create(
    model="tiny",
    messages=messages,
    max_tokens=8,
    temperature=0,
    extra_body=dict(ignore_eos=True, repetition_penalty=1.5),
    **settings,
  )
  ids = tokenizer.encode(template.render(messages, add_generation_prompt=True))
  params = specjax.SamplingParams(
    temperature=0.0, ignore_eos=True, repetition_penalty=1.5, **settings
  )
  assert chat.choices[0].message.content == library_text(target, tokenizer, ids, params, 8)[0]

"""The bundled trained pair: sizes, one-call loading, greedy exactness. (The main
job, `experiments.decode` with its defaults: the decode step of
tests/test_launchers.py, `_check_main_job`.)"""

import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import pretrained
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.heads.eagle import EagleDrafter


@pytest.fixture(scope="module")
def pair():
  return pretrained.load_pair()


def test_bundle_sizes(pair):
  size = sum(
    os.path.getsize(os.path.join(d, f))
    for d, _, files in os.walk(pretrained.PAIR_DIR)
    for f in files
  )
  # The pair (18.5 MiB), the cross draft (0.6) and four bfloat16 heads (6.9, the
  # block drafter's 3.1 of them): 26.1 MiB, the package well under 32 MB.
  assert size <= 28 * 2**20
  assert pair.target.num_params >= 5_000_000
  assert pair.draft.num_params * 8 <= pair.target.num_params
  assert pair.tokenizer.vocab_size == pair.target.cfg.vocab_size == pair.draft.cfg.vocab_size
  card = pretrained.model_card()
  assert card["target"]["params"] == pair.target.num_params
  assert card["draft"]["params"] == pair.draft.num_params


def test_greedy_speculative_equals_autoregressive_on_held_out_prompts(pair):
  prompts, lengths = encode_prompts(pair.tokenizer, held_out_prompts(3))
  assert len(set(np.asarray(lengths).tolist())) > 1  # ragged rows
  kwargs = dict(max_new_tokens=32, sampling=specjax.GREEDY)
  ar = specjax.autoregressive_generate(pair.target, prompts, lengths, **kwargs)
  spec = specjax.speculative_generate(pair.target, pair.draft, prompts, lengths, gamma=4, **kwargs)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  # A trained, distilled draft: far above what random weights accept (~0).
  assert float(spec.stats.acceptance_rate) > 0.5
  # The bundled EAGLE head on the same prompts: exact, and trained.
  eagle = EagleDrafter(pair.target, pretrained.load_head("eagle", pair.target))
  spec = specjax.speculative_generate(pair.target, eagle, prompts, lengths, gamma=4, **kwargs)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  assert float(spec.stats.acceptance_rate) > 0.5
  # The bundled block drafter: its whole block of 7 per call, exact, and trained.
  dflash = pretrained.load_drafter("dflash", pair.target)
  spec = specjax.speculative_generate(pair.target, dflash, prompts, lengths, gamma=7, **kwargs)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  assert float(spec.stats.tokens_per_iteration) > 2.0


def test_load_pair_names_a_missing_file(monkeypatch, tmp_path):
  monkeypatch.setattr(pretrained, "DRAFT_DIR", str(tmp_path / "draft"))
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "draft")):
    pretrained.load_pair()


def test_load_cross_draft_loads_and_names_a_missing_file(monkeypatch, tmp_path):
  draft, tokenizer = pretrained.load_cross_draft()
  assert draft.cfg.vocab_size == tokenizer.vocab_size == 1024
  monkeypatch.setattr(pretrained, "CROSS_DRAFT_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    pretrained.load_cross_draft()


@pytest.mark.slow  # the launcher and its memory maps: test_launchers.py, compare_drafters
def test_drafter_comparison_runs_on_the_bundled_pair():
  from configs import compare_drafters as compare_config
  from specjax.jobs import compare_drafters

  config = compare_config.get_config()
  config.update(
    num_prompts=1,
    max_new_tokens=8,
    temperatures=(0.0,),
    layer_skip=(),
    gamma_sweep=(),
    gamma_max=4,
    # Each variant is a compiled program on the bundled pair (CI time): two
    # drafters and the two cross-tokenizer ways, one verifier (adaptive lengths
    # and trees are speculative_generate's own tests).
    verifiers=("greedy",),
    heads=(),
    adaptive=(),
  )
  config.trees.sizes = ()
  rows = compare_drafters.run(config)
  names = {(r["drafter"], r["verifier"], r["gamma"], r["adaptive"]) for r in rows}
  assert ("prompt lookup (n<=3)", "greedy", 4, "fixed") in names
  assert (compare_drafters.TLI, "greedy", 4, "fixed") in names
  assert (compare_drafters.SLEM, "greedy", 4, "fixed") in names
  assert len(rows) == 4
  for r in rows:
    assert 0 <= r["acceptance_rate"] <= 1 and r["speedup"] > 0
    assert r["c"] > 0 and r["predicted_speedup"] > 0  # measured drafting cost, Leviathan
  assert "| 0 | draft model | greedy | 4 | fixed |" in compare_drafters.markdown(rows)


def test_drafter_comparison_reports_each_category_of_a_prompt_file(tmp_path, monkeypatch):
  """`config.prompt_file` (issue 46): a bad file is named before the pair loads; a
  good one gives each row its categories' figures, pooled in the row's own."""
  from configs import compare_drafters as compare_config
  from specjax.jobs import compare_drafters

  config = compare_config.get_config("smoke")
  config.update(ngram=0, max_new_tokens=8, prompt_file=str(tmp_path / "missing.jsonl"))
  with monkeypatch.context() as m:
    m.setattr(pretrained, "load_pair", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(ValueError, match=r"^config.prompt_file: .*missing.jsonl: no such file"):
      compare_drafters.run(config)
  rows = [
    {"category": "code", "turns": ["def add(a, b):\n"]},
    {"category": "comment", "text": "# Return the sum\n"},
    {"category": "code", "prompt": "import os\n"},
  ]
  (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  config.prompt_file = str(tmp_path / "p.jsonl")
  (row,) = compare_drafters.run(config)  # the draft model, greedy
  per = row["per_category"]
  assert {c: f["prompts"] for c, f in per.items()} == {"code": 2, "comment": 1}
  for key in ("acceptance_rate", "tokens_per_iteration"):  # counts pooled over both
    values = [f[key] for f in per.values()]
    assert min(values) <= row[key] <= max(values), key
  for f in per.values():
    assert f["speedup"] == f["ar_ms_per_token"] / f["ms_per_token"] and f["ms_per_token"] > 0
  table = compare_drafters.markdown([row])
  assert "| 0 | draft model | greedy | 4 | fixed | code | 2 |" in table
  assert "| 0 | draft model | greedy | 4 | fixed | comment | 1 |" in table


def test_block_verification_accepts_more_on_the_bundled_pair(pair):
  """On real drafted blocks (draft sampled at temperature 1 after test-split
  contexts), the closed-form expected accepted tokens of block verification
  are at least token verification's on average."""
  from specjax.data import corpus_files
  from specjax.data.corpus import read_source
  from specjax.verify.expected import expected_accepted

  width, gamma = 48, 4
  contexts = []
  for path in corpus_files("test"):
    ids = pair.tokenizer.encode(read_source(path))
    if len(ids) >= width:
      contexts.append(ids[:width])
    if len(contexts) == 64:
      break
  ctx = jax.numpy.asarray(contexts, jax.numpy.int32)
  sampling = specjax.SamplingParams(temperature=1.0)
  drafted = specjax.autoregressive_generate(
    pair.draft,
    ctx,
    jax.numpy.full((len(ctx),), width),
    max_new_tokens=gamma,
    sampling=sampling,
    key=jax.random.key(3),
  ).tokens
  seq = jax.numpy.concatenate([ctx, drafted], axis=1)

  @jax.jit  # one program for both models and both rules, not op by op
  def expected(draft, target, seq, drafted):
    q = specjax.warp_probs(draft(seq), sampling)[:, width - 1 : width - 1 + gamma]
    p = specjax.warp_probs(target(seq), sampling)[:, width - 1 : width + gamma]
    return tuple(expected_accepted(rule, drafted, q, p).mean() for rule in ("token", "block"))

  token, block = map(float, expected(pair.draft, pair.target, seq, drafted))
  assert 0.5 < token < gamma  # a trained pair with real, partial agreement
  assert block >= token


@pytest.mark.slow  # the default tier runs this profile through the launcher (test_launchers.py)
def test_iteration_profile_runs():
  from experiments.profile_iteration import profile

  result = profile(gamma=2, repeats=2, max_new_tokens=8)
  for key in (
    "target_forward_1_ms",
    "target_forward_gamma_plus_1_ms",
    "draft_propose_ms",
    "verify_ms",
    "ar_ms_per_token",
    "prefill_ms",
    "spec_ms_per_iteration",
  ):
    assert result[key] > 0, key
  assert result["iterations"] >= 1
  # Greedy: the iteration calls no random-bit loop; each loop body launches kernels.
  assert result["spec_iteration_calls"] == 0
  assert min(result["ar_step_kernels"], result["spec_iteration_kernels"]) > 0


def test_load_pair_and_hf_load_model_return_the_same_tokenizer_type(pair):
  import specjax.hf

  tokenizer = specjax.hf.load_tokenizer(pretrained.PAIR_DIR)
  assert type(tokenizer) is type(pair.tokenizer)
  assert tokenizer.encode("def f(x):") == pair.tokenizer.encode("def f(x):")


def _pair_copy(monkeypatch, tmp_path):
  """A copy of the bundled pair under `tmp_path`, with `pretrained` pointing at it."""
  root = tmp_path / "pair"
  shutil.copytree(pretrained.PAIR_DIR, root)
  for name, rel in (
    ("PAIR_DIR", ""),
    ("TARGET_DIR", "target"),
    ("DRAFT_DIR", "draft"),
    ("TOKENIZER_FILE", "tokenizer.json"),
    ("CARD_FILE", "card.json"),
  ):
    monkeypatch.setattr(pretrained, name, str(root / rel) if rel else str(root))
  return root


def test_card_records_the_sha256_of_every_bundled_file():
  sums = pretrained.model_card()["sha256"]
  assert sorted(sums) == sorted(pretrained.BUNDLED_FILES)
  for rel, digest in sums.items():
    with open(os.path.join(pretrained.PAIR_DIR, rel), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == digest, rel


def test_load_pair_refuses_a_flipped_byte(monkeypatch, tmp_path):
  root = _pair_copy(monkeypatch, tmp_path)
  weights = root / "draft" / "model.safetensors"
  raw = bytearray(weights.read_bytes())
  before = hashlib.sha256(raw).hexdigest()
  raw[-2] ^= 0x01  # the lowest mantissa bit of a bfloat16 weight: still finite
  weights.write_bytes(bytes(raw))
  after = hashlib.sha256(raw).hexdigest()
  with pytest.raises(ValueError, match=rf"draft.model\.safetensors.*{before}.*{after}"):
    pretrained.load_pair()


def test_bundle_pair_writes_the_sums_load_pair_checks(monkeypatch, tmp_path):
  from experiments import bundle_pair

  root = _pair_copy(monkeypatch, tmp_path)
  (root / "tokenizer.json").write_text((root / "tokenizer.json").read_text() + "\n")
  card = {k: v for k, v in pretrained.model_card().items() if k != "sha256"}
  with pytest.raises(ValueError, match=r"tokenizer\.json"):
    pretrained.load_pair()
  bundle_pair.write_card(str(root), card)
  assert (
    pretrained.model_card()["sha256"]["tokenizer.json"]
    == hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest()
  )
  pair = pretrained.load_pair()
  assert pair.tokenizer.encode("x") and pair.draft.num_params


def test_load_pair_names_a_card_without_sums(monkeypatch, tmp_path):
  root = _pair_copy(monkeypatch, tmp_path)
  card = json.loads((root / "card.json").read_text())
  card.pop("sha256", None)
  (root / "card.json").write_text(json.dumps(card))
  with pytest.raises(ValueError, match=r"card\.json.*sha256"):
    pretrained.load_pair()


def test_load_drafter_builds_every_kind(pair):
  """One registry of drafters for the launchers: the bundled heads (optionally
  among the K most frequent ids), prompt lookup and layer skip."""
  from specjax import heads

  for kind in heads.bundled():
    assert type(pretrained.load_drafter(kind, pair.target)) is heads.kind(kind).drafter
  head = pretrained.load_head("medusa", pair.target)
  assert pretrained.load_drafter("medusa", pair.target, head=head).heads is head
  subset = pretrained.load_drafter("eagle", pair.target, vocab_subset=64)
  np.testing.assert_array_equal(subset.vocab_subset, pretrained.frequent_token_ids(64))
  assert pretrained.load_drafter("ngram", pair.target, max_ngram=2).max_ngram == 2
  assert pretrained.load_drafter("layer_skip", pair.target, num_layers=1).num_layers == 1
  match = "kind must be one of eagle, medusa, early_exit, dflash, dspark, ngram, "
  with pytest.raises(ValueError, match=match):
    pretrained.load_drafter("hydra", pair.target)
  with pytest.raises(ValueError, match=r"vocab_subset must be an int >= 0 \(0: all ids\)"):
    pretrained.load_drafter("eagle", pair.target, vocab_subset=-1)


def test_bundled_heads_load_fused_and_split_back_into_their_files(pair):
  """Loading fuses a head block's q/k/v and gate/up tensors; `head_tensors` (what
  experiments/bundle_heads.py writes) splits them back into the files' names and
  values, so the files and their card's sums stay as they are."""
  from specjax import heads
  from specjax.heads.files import head_tensors
  from specjax.hf.weights import read_tensors

  card = pretrained.heads_card()
  for kind in heads.bundled():
    head = pretrained.load_head(kind, pair.target, jnp.bfloat16)  # the files' dtype
    file = os.path.join(pretrained.HEADS_DIR, kind, "model.safetensors")
    stored = {name: value for _, name, value in read_tensors([file])}
    written = head_tensors(head)
    # A head trained on another's frozen layers stores only its own; the rest are the
    # other head's, name for name.
    for other in card["heads"][kind].get("shares", {}):
      shared = os.path.join(pretrained.HEADS_DIR, other, "model.safetensors")
      for _, name, value in read_tensors([shared]):
        assert name not in stored, name
        if name in written:
          stored[name] = value
    assert sorted(written) == sorted(stored)
    for name, value in stored.items():
      np.testing.assert_array_equal(np.asarray(written[name]), value, err_msg=name)
    if kind in ("eagle", "early_exit"):
      assert "block.attn.k_proj.kernel" in stored and "block.mlp.gate_proj.kernel" in stored
      assert head.block.attn.qkv_proj.kernel[...].dtype == jnp.bfloat16
    if kind == "dspark":  # the two heads alone; the block drafter's layers are dflash's
      own = {name for _, name, _ in read_tensors([file])}
      assert {"markov_w1", "markov_w2", "confidence_hidden.kernel"} <= own
      assert not any(name.startswith("layers.") for name in own)
    if kind == "dflash":  # its layers' projections are separate; the MLP's are fused
      assert "layers.1.k_proj.kernel" in stored and "layers.0.mlp.up_proj.kernel" in stored
      assert "mask_embedding" in stored


def test_load_checkpoints_loads_the_bundled_pair_and_names_a_missing_field():
  """The launchers' one pair loader (Hugging Face checkpoints: tests/test_decode.py)."""
  models = pretrained.load_checkpoints()
  assert (models.target_path, models.draft_path) == (pretrained.TARGET_DIR, pretrained.DRAFT_DIR)
  assert models.draft_tokenizer is models.tokenizer
  cross = pretrained.load_checkpoints(own_tokenizer=True)
  assert cross.draft_path == pretrained.CROSS_DRAFT_DIR
  assert (
    cross.draft_tokenizer.vocab_size == cross.draft.cfg.vocab_size != cross.tokenizer.vocab_size
  )
  alone = pretrained.load_checkpoints(need_draft=False)
  assert alone.draft is None and alone.draft_path is None and alone.draft_tokenizer is None
  with pytest.raises(ValueError, match="--draft needs --target"):
    pretrained.load_checkpoints(draft="d", fields=("--target", "--draft"))
  with pytest.raises(ValueError, match="config.draft must name the draft checkpoint"):
    pretrained.load_checkpoints("some/target")


def test_loading_compiles_no_program(caplog):
  """Reading, checking and converting the bundled files is NumPy work: a jax op
  there compiles a program per tensor shape (56 for the pair once, about 2 s of
  every launcher's start). Last in the module: it empties JAX's caches first, so
  that a program compiled by an earlier test cannot hide one."""
  jax.clear_caches()
  with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
    pair = pretrained.load_pair()
    pretrained.load_head("eagle", pair.target)
  compiled = [r.getMessage()[:120] for r in caplog.records if "Compiling" in r.getMessage()]
  assert not compiled, compiled

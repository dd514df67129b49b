"""Paper reproduction: the worked examples, the count drafters' tables, and bad
configs. (The quick run end to end, its report, verdicts and figures: the
reproduce step of tests/test_launchers.py, `_check_quick_reproduction`. The
count drafters' exactness on V = 8 is in tests/test_distribution.py with every
other drafter; the formulas' printed values in tests/test_theory.py.)"""

import numpy as np
import pytest

from configs import reproduce as reproduce_config
from specjax.drafting import count_drafter
from specjax.reproduce import examples, papers, report
from specjax.reproduce.run import apply_quick, check_config


def test_worked_examples_match_the_explainers():
  for example, paper in zip(papers.WORKED_EXAMPLES, (0.75, 0.375)):
    ex = examples.one_token_example(example["q"], example["p"], n=20_000)
    assert ex["acceptance_of_A"] == pytest.approx(paper)
    assert ex["sampled_acceptance_of_A"] == pytest.approx(paper, abs=0.03)
    np.testing.assert_allclose(ex["sampled_output_law"], ex["p"], atol=0.015)
  second = examples.one_token_example((0.8, 0.2), (0.3, 0.7), n=1000)
  assert second["residual"] == [0.0, 1.0]  # the whole residual on B
  assert second["acceptance"] == pytest.approx(0.5)
  shortcut = examples.top1_shortcut((0.4, 0.6), (0.3, 0.7), n=20_000)
  assert shortcut["shortcut_law"] == [0.0, 1.0]  # always the top-1: not p
  assert shortcut["shortcut_tv_to_p"] == pytest.approx(0.3)
  assert shortcut["speculative_tv_to_p"] < 0.015


def test_block_toy_gives_the_papers_values():
  toy = examples.block_toy(n=20_000)
  assert toy["token_exact"] == pytest.approx(10 / 9, abs=1e-5)
  assert toy["block_exact"] == pytest.approx(11 / 9, abs=1e-5)
  # Accepted tokens take values 0..2 (sd < 0.9): 5 standard errors.
  for rule in ("token", "block"):
    assert toy[f"{rule}_sampled"] == pytest.approx(toy[f"{rule}_exact"], abs=5 * 0.9 / 141)


def test_count_tables_are_smoothed_laws():
  docs = [np.array([1, 2, 1, 2, 3]), np.array([3, 3])]
  uni = count_drafter(docs, 5, 1, smoothing=1.0)
  q1 = np.exp(np.asarray(uni.log_q))
  np.testing.assert_allclose(q1, (np.array([0, 2, 2, 3, 0]) + 0.2) / 8)
  bi = count_drafter(docs, 5, 2, smoothing=1.0)
  q2 = np.exp(np.asarray(bi.log_q))
  np.testing.assert_allclose(q2.sum(axis=1), 1.0, rtol=1e-6)
  # After 1 always 2 (two counts + one pseudo-count spread as q1); never across documents.
  np.testing.assert_allclose(q2[1], (np.eye(5)[2] * 2 + q1) / 3, rtol=1e-6)
  np.testing.assert_allclose(q2[3, 3], (1 + q1[3]) / 2, rtol=1e-6)  # the (3, 3) of doc 2
  np.testing.assert_allclose(q2[0], q1, rtol=1e-6)  # never seen: the unigram


@pytest.mark.parametrize(
  "args, message",
  [
    (([np.array([0, 1])], 4, 3), "order must be 1 .* or 2"),
    (([np.array([0, 1])], 4, 2, 0.0), "smoothing must be a number > 0"),
    (([np.array([0, 4])], 4, 1), r"outside \[0, 4\)"),
    (([np.array([], np.int32)], 4, 1), "no tokens"),
    (([np.array([[0, 1]])], 4, 1), "1-D integer arrays"),
  ],
)
def test_count_drafter_refuses_bad_input(args, message):
  with pytest.raises(ValueError, match=message):
    count_drafter(*args)


def test_count_drafter_table_shape_is_checked():
  import jax.numpy as jnp

  from specjax.drafting import CountDrafter

  with pytest.raises(ValueError, match=r"log_q must have shape \(4, 4\) for order 2"):
    CountDrafter(jnp.zeros(4), vocab_size=4, order=2)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(drafters=("unigram", "distilled draft")), "must include 'corpus-trained draft'"),
    (dict(drafters=("trigram",)), "must be among"),
    (dict(gammas=(0, 2)), "config.gammas"),
    (dict(temperatures=()), "config.temperatures must be non-empty"),
    (dict(count_files=-1), "config.count_files must be >= 0"),
    (dict(coupled_drafters=("Medusa heads", "trigram")), r"coupled_drafters must be among"),
  ],
)
def test_bad_configs_name_the_field(change, message):
  config = reproduce_config.get_config()
  if "coupled_drafters" in change:
    config.drafters = tuple(d for d in config.drafters if d != "Medusa heads")
  config.update(change)
  with pytest.raises(ValueError, match=message):
    check_config(config)


def test_verdicts():
  assert report.in_range(0.1, 0.03, 0.13) == "within the paper's range"
  assert report.in_range(0.2, 0.03, 0.13).startswith("above")
  assert report.close(3.689, 3.69) == "agrees"
  assert report.close(3.5, 3.69).startswith("differs")


def test_quick_overrides_the_full_config():
  full = reproduce_config.get_config()
  quick = apply_quick(full)
  assert quick.num_prompts == full.quick.num_prompts and quick.gammas == full.quick.gammas
  assert quick.corpus_draft.train.num_steps == full.quick.corpus_draft.train.num_steps  # nested
  assert quick.corpus_draft.run == ""
  assert full.corpus_draft.run == "runs/draft_ce"  # the full config is left as it was

"""Every launcher in experiments/ runs with its defaults and exits 0.

A launcher is an `experiments/*.py` (not common.py) with a module-level `main`
and an `if __name__ == "__main__":` block; `test_every_launcher_has_a_step`
fails when one has no step in `STEPS` (or a reason in `HELP_ONLY`), so a new
launcher cannot go untested.

Each step runs `python -m experiments.NAME FLAGS` in a subprocess (cwd the
repository root, the test process's environment: tests/conftest.py's
compilation cache and XLA flags, so programs other tests compiled come from the
cache) and expects exit status 0. FLAGS are the launcher's required arguments
and small run-size flags only (fewer steps, tokens, requests or variants; the
launcher's own smoke preset; output paths under a temporary directory),
never another model: the launchers that read the bundled pair by default read
it here. The launchers whose inputs are training runs (generate_data,
evaluate_drafts, the bundle_* exporters) read a chain of small runs made by
earlier steps in the same temporary directory: a 6-step tiny target trained on
a 16-file corpus, an EAGLE head trained 2 steps on the bundled target, and the
data generated from them. The exporters write there too, never into
specjax/pretrained.

experiments.serve is started on a free port with its defaults, must answer
200 on GET /health, and must exit 0 on SIGTERM.

Steps run one at a time in `STEPS` order (2 cores: a launcher compiles on one
and computes on both). Running one step alone (`-k`) runs the steps it reads
from first.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pytest
from docs_blocks import healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600  # per step; the slowest takes about a minute here with a warm cache
SERVER_WAIT_S = 300  # for the server's warm-up (compiling every engine program)
SERVER_STOP_S = 60
# The tiny runs' corpus: the first files of each split of the standard library.
CORPUS_FILES = {"train": 12, "validation": 2, "test": 2}


@dataclasses.dataclass(frozen=True)
class Step:
  """One launcher run: `python -m experiments.<launcher> <flags>`.

  `flags` may name `{tmp}` (the steps' shared temporary directory) and, for
  the server, `{port}`. `needs`: the steps whose output this one reads.
  `slow`: run in the slow tier only (tests/conftest.py), for a launcher's
  longer run when a smaller one of the same launcher is in the default tier.
  `check(tmp, output)`: asserts what the run wrote (files under `tmp`, its
  printed `output`) beyond its exit status. `prepare(tmp)`: writes inputs no
  launcher makes (a hub-layout head) before the run.
  """

  id: str
  launcher: str
  flags: tuple[str, ...] = ()
  needs: tuple[str, ...] = ()
  server: bool = False
  slow: bool = False
  check: Callable[[str, str], None] | None = None
  prepare: Callable[[str], None] | None = None


def _check_measured_gamma(output: str) -> None:
  """A block drafter's default gamma is measured at start-up: each candidate's time
  per token is reported and the fastest is the one decoded with."""
  # The result is printed last, from a line that opens it (texts before it are escaped).
  result, _ = json.JSONDecoder().raw_decode(output[output.rindex("\n{") + 1 :])
  assert result["gamma_policy"] == "measured at start-up"
  probe = result["gamma_probe"]
  ms = {int(g): t for g, t in probe["ms_per_token"].items()}
  assert set(ms) == {1, 2, 4, 7} and result["gamma"] == probe["chosen"] == min(ms, key=ms.get)
  assert probe["plain_wins"] == (probe["plain_ms_per_token"] < min(ms.values()))


def _hub_eagle_head(tmp: str) -> None:
  """An EAGLE-1 head for the bundled target in the EAGLE repository's layout
  (config.json + model.safetensors; random weights), at tmp/hub_eagle."""
  from flax import nnx

  from specjax import pretrained
  from specjax.heads import HeadConfig, make_head
  from specjax.heads import config as head_config
  from specjax.hf import save_head
  from specjax.validation import read_json_object

  bundled = read_json_object(os.path.join(pretrained.HEADS_DIR, "eagle", "head_config.json"))
  target = HeadConfig.from_dict(bundled).target
  hub = dict(normed_features=True, embed_first=True, input_norm=False)
  save_head(make_head(head_config("eagle", target, **hub), rngs=nnx.Rngs(0)), f"{tmp}/hub_eagle")


def _check_collectives(tmp: str) -> None:
  """One device exchanges nothing: both step programs, no collectives."""
  with open(os.path.join(tmp, "collectives.json")) as f:
    rows = json.load(f)["rows"]
  assert [(r["mesh"], r["gamma"], r["collectives"]) for r in rows] == [("1x1", 0, 0), ("1x1", 4, 0)]


def _check_kernel_benchmark(tmp: str) -> None:
  """The kernel table names the CPU and times every case through XLA, each
  variant this CPU runs (or says why a variant is missing) and the paths a
  model gets."""
  with open(os.path.join(tmp, "kernel.json")) as f:
    result = json.load(f)
  assert result["machine"]["cpu_model"] and result["read_bandwidth_gbs"] > 0
  assert [(c["dtype"], c["rows"]) for c in result["cases"]] == [
    (d, r) for d in ("float32", "bfloat16") for r in (1, 2)
  ]
  for name, variant in result["variants"].items():
    if "path" in variant:
      assert all(c[f"{name}_ms"] > 0 for c in result["cases"]), name
      assert set(result["goals"][name]) == {"float32", "bfloat16"}
  # "chosen": the chain as a model runs it, each of its 8 shapes on a calibrated path.
  assert all(c["chosen_ms"] > 0 for c in result["cases"])
  assert len(result["chosen_paths"]) == 8
  # Calibration's candidates, which may include a build the table did not time
  # (plain AVX-512 beside AVX512-BF16).
  assert set(result["chosen_paths"].values()) <= {"xla", *result["chosen_candidates"]}


def _check_gpu_check(tmp: str) -> None:
  """The step section on a CPU: the kernels of a plain step and a speculative
  iteration from compiled HLO (no command buffers here), the floor's readers,
  and a profiler trace kept beside the JSON, summarised without a device
  timeline."""
  with open(os.path.join(tmp, "gpu_check.json")) as f:
    result = json.load(f)
  (row,) = result["step"]
  assert row["command_buffers"] == "none" and row["loop_in_command_buffer"] is False
  assert 0 < row["kernels_per_layer"] < row["kernels_per_step"] == row["launches_per_step"]
  assert 0 < row["spec_kernels_per_layer"] < row["spec_kernels_per_iteration"]
  assert row["ar_over_floor"] > 0 and row["timeline"] == "host"
  assert row["floor_holds"] == (row["ar_over_floor"] >= 0.97)
  assert row["options_refused"] is None
  floor = result["step_detail"]["floor"]
  assert floor["read_methods"][floor["read_method"]] == floor["read_bandwidth_gbs"]
  assert {"numpy", "xla_reduce"} <= set(floor["read_methods"])
  (case,) = result["step_detail"]["cases"]
  profile = case["profile"]
  assert profile["trace"].startswith(os.path.join(tmp, "gpu_check_traces"))
  assert os.path.exists(profile["trace"]) and profile["top_kernels"]
  assert "no device timeline" in profile["note"]
  assert case["spec"]["command_buffers"]["command_buffers"] == 0


def _check_hub_head_decode(tmp: str, output: str) -> None:
  with open(os.path.join(tmp, "decode_hub.json")) as f:
    result = json.load(f)
  assert result["texts_identical"] is True and result["draft"].startswith("eagle: ")


def _check_main_job(tmp: str, output: str) -> None:
  """The main job's result (`experiments.decode` on the bundled pair, its
  defaults but 16 new tokens): the held-out prompt, identical greedy texts, the
  statistics, and the floor report's arithmetic (config.report_floor, on by
  default)."""
  from specjax import pretrained
  from specjax.data.prompts import held_out_prompts

  with open(os.path.join(tmp, "decode.json")) as f:
    result = json.load(f)
  assert result["prompt"] == held_out_prompts(1)[0]
  assert result["target"] == pretrained.TARGET_DIR
  assert result["texts_identical"] is True and result["ar_text"] == result["spec_text"]
  for key in (
    "acceptance_rate",
    "tokens_per_iteration",
    "speedup",
    "ar_ms_per_token",
    "spec_ms_per_token",
    "gamma",
    "temperature",
  ):
    assert key in result, key
  assert 0 < result["acceptance_rate"] <= 1 and result["tokens_per_iteration"] >= 1
  assert result["gamma"] == 4 and result["gamma_policy"] == "by batch size"
  assert result["loop"] == "while" and result["loop_chunk"] is None
  ratio = result["ar_step_ms"] / result["target_bandwidth_floor_ms"]
  assert result["ar_over_floor"] == pytest.approx(ratio, rel=1e-9)
  ratio = result["ar_step_ms"] / result["target_matmul_floor_ms"]
  assert result["ar_over_matmul_floor"] == pytest.approx(ratio, rel=1e-9)
  models_ms = (
    result["target_verify_ms"] + result["draft_calls_per_iteration"] * (result["draft_call_ms"])
  )
  assert (
    abs(1 - models_ms / result["spec_ms_per_iteration"] - result["spec_overhead_fraction"]) < 1e-9
  )
  assert result["target_long_prefill_ms"] > 0 and result["spec_compile_seconds"] >= 0


def _check_quick_reproduction(tmp: str, output: str) -> None:
  """The quick reproduction's report: every section with its tables in
  report.md and report.json, the measured rows, the verdicts, progress lines,
  and six figures that are PNGs with something drawn."""
  import matplotlib.image

  from specjax.reproduce.run import SECTIONS

  out = os.path.join(tmp, "reproduce")
  with open(os.path.join(out, "report.json")) as f:
    result = json.load(f)
  with open(os.path.join(out, "report.md")) as f:
    markdown = f.read()
  assert [s["id"] for s in result["sections"]] == list(SECTIONS)
  for s in result["sections"]:
    assert f"## {s['title']}" in markdown
    for t in s["tables"]:
      assert t["rows"], f"{s['id']}: table {t['title']!r} is empty"
      assert t["title"] in markdown
  # Every measured variant: the quick run's temperature, alpha a rate, speedups positive.
  rows = result["rows"]
  assert {r["temperature"] for r in rows} == {1.0}
  assert all(0 <= r["alpha"] <= 1 and r["speedup"] > 0 and r["c"] >= 0 for r in rows)
  assert {"unigram", "bigram", "corpus-trained draft", "distilled draft"} <= {
    r["drafter"] for r in rows
  }
  # The unigram draft is the weakest, the distilled draft beats it by far.
  alpha = {(r["drafter"], r["temperature"]): r["alpha"] for r in rows if r["gamma"] == 4}
  assert alpha["unigram", 1.0] < alpha["distilled draft", 1.0]
  assert any(line.startswith("[4/4]") for line in output.splitlines())  # progress was shown
  formulas = result["sections"][0]["tables"][0]["rows"]
  assert all(row[-1] == "agrees" for row in formulas)
  assert len(result["figures"]) == 6
  for name in result["figures"]:
    path = os.path.join(out, name)
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 200
    assert image.std() > 0.01  # something is drawn


# Lines of /proc/self/maps a variant may leave above the count before the
# temperature's first variant. Every XLA:CPU executable keeps memory mappings
# of its code until it is freed; compare_drafters once compiled variant after
# variant until it passed the kernel's vm.max_map_count (65,530) and died in
# LLVM. Measured without the freeing (tiny pair, 2026-12-01), each variant added
# 207 to 339 lines; with it, this step's three came back to 876, 877 and 891
# after 875 before them (2-core AMD EPYC, 2026-12-02).
MEMORY_MAPS_TOLERANCE = 60


def _check_drafter_comparison(tmp: str, output: str) -> None:
  """compare_drafters' sweep (issue 28): each of its variants, run one after
  another in one process, leaves the memory-map count near where it was before
  the first; the rows and the markdown table are written. The step runs the
  chunked loops (issue 31), recorded on every row."""
  with open(os.path.join(tmp, "drafters.json")) as f:
    rows = json.load(f)["rows"]
  assert [r["drafter"] for r in rows] == ["draft model", "prompt lookup (n<=3)", "layer skip k=1"]
  assert all(r["loop"] == "chunked" and r["loop_chunk"] == 3 for r in rows)
  assert all(r["speedup"] > 0 and 0 <= r["acceptance_rate"] <= 1 for r in rows)
  before, after = rows[0]["memory_maps_before"], [r["memory_maps"] for r in rows]
  print(f"memory maps: {before} before the variants, {after} after each")
  assert max(after) - before <= MEMORY_MAPS_TOLERANCE, (before, after)
  with open(os.path.join(tmp, "drafters.md")) as f:
    assert f.read().count("\n| 0 | ") == len(rows)


# Head training on the bundled target: 2 steps of batch 2 x 32 tokens.
_TINY_HEAD_RUN = (
  "--config.num_steps=2",
  "--config.warmup_steps=1",
  "--config.batch_size=2",
  "--config.seq_len=32",
  "--config.eval_every=2",
  "--config.eval_batches=1",
  "--config.checkpoint_every=2",
  "--config.log_every=1",
)


def _check_constrained_decode(tmp: str, output: str) -> None:
  """`--config.constraint=signature`: the constraint recorded, every text of
  both loops a JSON object with the schema's fields, and the mask's cost."""
  with open(os.path.join(tmp, "decode_constrained.json")) as f:
    result = json.load(f)
  assert result["constraint"] == "signature" and result["constraint_states"] > 1
  assert result["valid_fraction"] == 1.0
  for text in result["ar_texts"] + result["spec_texts"]:
    value = json.loads(text)
    assert set(value) == {"name", "args"} and isinstance(value["args"], list), text
  assert result["mask_ms_per_iteration"] < result["iteration_ms_unmasked"]
  assert result["iteration_ms_masked"] > 0 and result["ar_mask_fraction"] < 1


# A prompt file in Spec-Bench's layout (question.jsonl): two categories, one of
# them over two batches of 2 rows (the last filled by repeating a prompt), and a
# row with no category.
_PROMPT_ROWS = (
  {"question_id": 1, "category": "code", "turns": ["def add(a, b):\n"]},
  {"question_id": 2, "category": "comment", "turns": ["# Return the sum\n"]},
  {"question_id": 3, "category": "code", "turns": ["import os\n"]},
  {"question_id": 4, "category": "code", "turns": ["class Point:\n"]},
  {"text": "def main():\n"},
)


def _prompt_file(tmp: str) -> None:
  with open(os.path.join(tmp, "prompts.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in _PROMPT_ROWS)


def _check_prompt_file_decode(tmp: str, output: str) -> None:
  """`--config.prompt_file`: every prompt decoded, counted once per category (the
  filling row left out), the overall figures over all of them."""
  with open(os.path.join(tmp, "decode_prompt_file.json")) as f:
    result = json.load(f)
  per = result["per_category"]
  assert list(per) == ["code", "comment", "default"]
  assert [per[c]["prompts"] for c in per] == [3, 1, 1]
  assert result["num_prompts"] == sum(f["prompts"] for f in per.values()) == len(_PROMPT_ROWS)
  assert result["texts_identical"] is True and result["prompt"] == "def add(a, b):\n"
  for figures in [result, *per.values()]:
    assert 0 <= figures["acceptance_rate"] <= 1 and figures["tokens_per_iteration"] >= 1
    assert figures["speedup"] == figures["ar_ms_per_token"] / figures["spec_ms_per_token"]
  # The overall rate is the categories' counts pooled: between their rates.
  rates = [f["acceptance_rate"] for f in per.values()]
  assert min(rates) <= result["acceptance_rate"] <= max(rates)
  assert "  code: 3 prompts" in output


def _check_table(tmp: str) -> None:
  """The decode table has its header, the separator and one line per default row."""
  with open(os.path.join(tmp, "table.md")) as f:
    lines = f.read().splitlines()
  assert len(lines) == 4 and lines[0].startswith("| dtype | draft dtype | drafter | T |"), lines
  assert [line.split(" | ")[3] for line in lines[2:]] == ["0", "1"], lines


STEPS = (
  # The chain's target: configs/train_tiny.py (6 steps) on the 16-file corpus;
  # max_seq_len 128 so that a held-out prompt (97 tokens) fits evaluate_drafts.
  Step(
    "train",
    "train",
    (
      "--config=configs/train_tiny.py",
      "--workdir={tmp}/target",
      "--config.data.root={tmp}/corpus",
      "--config.data.dir={tmp}/data",
      "--config.model.max_seq_len=128",
    ),
  ),
  Step(
    "train_head",
    "train",
    ("--config=configs/train_eagle.py", "--workdir={tmp}/eagle")
    + ("--config.data.root={tmp}/corpus", "--config.data.dir={tmp}/data_bundled")
    + ("--config.data.corpus_dir={tmp}/data_bundled",)  # encoded here on first use
    + _TINY_HEAD_RUN,
  ),
  # EAGLE-3 with the training-time test (2 steps unrolled), then decoding with it.
  Step(
    "train_eagle3",
    "train",
    ("--config=configs/train_eagle3.py", "--workdir={tmp}/eagle3")
    + ("--config.data.root={tmp}/corpus", "--config.data.dir={tmp}/data_bundled")
    + ("--config.data.corpus_dir={tmp}/data_bundled", "--config.head.ttt_steps=2")
    + _TINY_HEAD_RUN,
    slow=True,  # train_head runs this launcher; tests/test_eagle3.py trains the kind in process
  ),
  Step(
    "decode_eagle3",
    "decode",
    ("--config.drafter=eagle", "--config.head={tmp}/eagle3", "--config.max_new_tokens=8")
    + ("--config.report_floor=False",),
    needs=("train_eagle3",),
    slow=True,
  ),
  # The block drafter (DFlash): blocks of 4, 4 anchors per window, then decoding with it.
  Step(
    "train_dflash",
    "train",
    ("--config=configs/train_dflash.py", "--workdir={tmp}/dflash")
    + ("--config.data.root={tmp}/corpus", "--config.data.dir={tmp}/data_bundled")
    + ("--config.data.corpus_dir={tmp}/data_bundled", "--config.head.block_size=4")
    + ("--config.head.num_anchors=4",)
    + _TINY_HEAD_RUN,
    slow=True,  # tests/test_dflash_training.py runs configs/train_dflash.py in process
  ),
  Step(
    "decode_dflash",
    "decode",
    ("--config.drafter=dflash", "--config.head={tmp}/dflash", "--config.max_new_tokens=8")
    + ("--config.report_floor=False",),
    needs=("train_dflash",),
    slow=True,
  ),
  # The sequential block drafter (DSpark) with its config's defaults: the bundled block
  # drafter's frozen backbone, the Markov and confidence heads trained; then decoding.
  Step(
    "train_dspark",
    "train",
    ("--config=configs/train_dspark.py", "--workdir={tmp}/dspark")
    + ("--config.data.root={tmp}/corpus", "--config.data.dir={tmp}/data_bundled")
    + ("--config.data.corpus_dir={tmp}/data_bundled", "--config.head.num_anchors=4")
    + _TINY_HEAD_RUN,
  ),
  Step(
    "decode_dspark",
    "decode",
    ("--config.drafter=dspark", "--config.head={tmp}/dspark", "--config.max_new_tokens=8")
    + ("--config.report_floor=False",),
    needs=("train_dspark",),
    slow=True,  # a head by path decodes as decode_dflash shows; the bundled one below
  ),
  # The bundled sequential block drafter with decode's defaults, and its confidence
  # head's reliability data on the encoded corpus's validation split.
  Step(
    "decode_bundled_dspark",
    "decode",
    ("--config.drafter=dspark", "--config.max_new_tokens=16"),
    check=lambda tmp, output: _check_measured_gamma(output),
  ),
  Step(
    "calibrate_confidence",
    "calibrate_confidence",
    ("--data_dir={tmp}/data_bundled", "--data_root={tmp}/corpus", "--num_windows=2")
    + ("--seq_len=32", "--num_anchors=4", "--out={tmp}/calibration.json"),
    needs=("train_head",),
  ),
  # The two sampling benches at their defaults but one timed run (docs/usage.md runs
  # smaller ones of each in the default tier).
  Step(
    "forced_drafts",
    "forced_drafts",
    ("--num_runs=1", "--output_json={tmp}/forced.json", "--output_md={tmp}/forced.md"),
    slow=True,
  ),
  Step(
    "warp_settings",
    "warp_settings",
    ("--num_runs=1", "--output_json={tmp}/settings.json", "--output_md={tmp}/settings.md"),
    slow=True,
  ),
  # The bundled block drafter with decode's defaults (gamma: its block_size - 1); the
  # sequential one, built on it, in the default tier.
  Step(
    "decode_bundled_dflash",
    "decode",
    ("--config.drafter=dflash", "--config.max_new_tokens=16"),
    slow=True,
  ),
  Step(
    "generate_data",
    "generate_data",
    ("--target={tmp}/target", "--data_dir={tmp}/data", "--out={tmp}/data_gen")
    + ("--num_batches=2", "--batch_size=2", "--new_tokens=8"),
    needs=("train",),
  ),
  Step(
    "evaluate_drafts",
    "evaluate_drafts",
    ("--target={tmp}/target", "--drafts={tmp}/target", "--data_dir={tmp}/data")
    + ("--num_prompts=1", "--max_new_tokens=8"),
    needs=("train",),
  ),
  Step(
    "bundle_pair",
    "bundle_pair",
    ("--target={tmp}/target", "--draft={tmp}/target", "--data_dir={tmp}/data")
    + ("--out={tmp}/pair",),
    needs=("train",),
  ),
  Step(
    "bundle_cross_draft_reencode",
    "bundle_cross_draft",
    ("--reencode", "--data_gen={tmp}/data_gen", "--draft_data={tmp}/data")
    + ("--out={tmp}/data_x_gen",),
    needs=("generate_data",),
  ),
  Step(
    "bundle_cross_draft",
    "bundle_cross_draft",
    ("--draft={tmp}/target", "--draft_data={tmp}/data", "--out={tmp}/cross_draft"),
    needs=("train",),
  ),
  Step(
    "bundle_heads", "bundle_heads", ("--eagle={tmp}/eagle", "--out={tmp}/heads"), ("train_head",)
  ),
  # The main job, its defaults (the floor report too) but 16 new tokens.
  Step(
    "decode",
    "decode",
    ("--config.max_new_tokens=16", "--output_json={tmp}/decode.json"),
    check=_check_main_job,
  ),
  # Structured output: the bundled signature schema in both loops (64 tokens
  # hold a whole schema text, so each ends at EOS and parses).
  Step(
    "decode_constrained",
    "decode",
    ("--config.constraint=signature", "--config.report_floor=False")
    + ("--output_json={tmp}/decode_constrained.json",),
    check=_check_constrained_decode,
  ),
  # A prompt file with categories (issue 46), two rows per batch.
  Step(
    "decode_prompt_file",
    "decode",
    ("--config.prompt_file={tmp}/prompts.jsonl", "--config.batch_size=2")
    + ("--config.max_new_tokens=8", "--config.report_floor=False")
    + ("--output_json={tmp}/decode_prompt_file.json",),
    check=_check_prompt_file_decode,
    prepare=_prompt_file,
  ),
  # A head in a hub layout by path (specjax.hf.load_head): EAGLE-1 as the EAGLE repo saves it.
  Step(
    "decode_hub_head",
    "decode",
    ("--config.drafter=eagle", "--config.head={tmp}/hub_eagle", "--config.max_new_tokens=8")
    + ("--config.report_floor=False", "--output_json={tmp}/decode_hub.json"),
    check=_check_hub_head_decode,
    prepare=_hub_eagle_head,
  ),
  Step("benchmark", "benchmark", ("--config=configs/benchmark.py",)),  # tiny, its default preset
  # One small layer-chain at one row; this CPU's variant and the AVX2 build.
  Step(
    "kernel_benchmark",
    "kernel_benchmark",
    ("--config.rows=1,2", "--config.num_layers=1", "--config.num_runs=1")
    + ("--config.read_megabytes=64", "--config.variants=auto,avx2")
    + ("--output_json={tmp}/kernel.json",),
    check=lambda tmp, _: _check_kernel_benchmark(tmp),
  ),
  # Its default rows (the bundled pair at T = 0 and 1), without the floor report.
  Step(
    "decode_table",
    "decode_table",
    ("--config.decode.max_new_tokens=8", "--config.decode.report_floor=False")
    + ("--output_md={tmp}/table.md",),
    check=lambda tmp, _: _check_table(tmp),
  ),
  Step(
    "compare_drafters",
    "compare_drafters",
    ("--config=configs/compare_drafters.py:smoke", "--config.layer_skip=(1,)")
    + ("--config.loop=chunked", "--config.loop_chunk=3")
    + ("--output_json={tmp}/drafters.json", "--output_md={tmp}/drafters.md"),
    check=_check_drafter_comparison,
  ),
  Step(
    "load_test",
    "load_test",
    ("--output_dir={tmp}/load_test", "--config.rates=(4.0,)", "--config.num_requests=4")
    + ("--config.max_new_tokens=16", "--config.modes=('always',)", "--config.slots=2")
    + ("--config.prompt_buckets=(32,)",),
  ),
  # --quick cut further: the count drafters read 8 files, 2,000 samples per example.
  Step(
    "reproduce",
    "reproduce",
    ("--output_dir={tmp}/reproduce", "--quick", "--config.quick.count_files=8")
    + ("--config.quick.samples=2000",),
    check=_check_quick_reproduction,
  ),
  Step("profile_iteration", "profile_iteration", ("--repeats=2", "--max_new_tokens=8")),
  Step("memory_table", "memory_table"),
  Step("make_hf_checkpoint", "make_hf_checkpoint", ("--out={tmp}/hf",)),
  # The smoke scale is the CPU check of the GPU script. Its trees section is
  # compare_drafters.run, which the compare_drafters step runs; its decode
  # section compiles a dozen programs (about 5 minutes here): the slow tier's.
  Step(
    "gpu_check",
    "gpu_check",
    ("--scale=smoke", "--sections=step,scaled,scoring", "--output_json={tmp}/gpu_check.json"),
    check=lambda tmp, _: _check_gpu_check(tmp),
  ),
  Step(
    "gpu_check_decode",
    "gpu_check",
    ("--scale=smoke", "--sections=scoring,decode", "--output_json={tmp}/gpu_check.json"),
    slow=True,
  ),
  # The collective table on one device (1x1: none); the 8-device tables run in
  # docs/scale_out.md's slow tier.
  Step(
    "mesh_collectives",
    "mesh_collectives",
    ("--meshes=1x1", "--vocab=replicate", "--output_json={tmp}/collectives.json"),
    check=lambda tmp, output: _check_collectives(tmp),
  ),
  # The server with every default (its warm-up compiles each of its programs and
  # measures the adaptive policy: minutes here), and at a small size.
  Step("serve_defaults", "serve", ("--config.port={port}",), server=True, slow=True),
  Step(
    "serve",
    "serve",
    ("--config.port={port}", "--config.policy=always", "--config.slots=2")
    + ("--config.prompt_buckets=(64,)", "--config.max_new_tokens=16"),
    server=True,
  ),
  # The bundled sequential block drafter served (its greedy HTTP text: test_serving_dspark).
  Step(
    "serve_dspark",
    "serve",
    ("--config.port={port}", "--config.drafter=dspark", "--config.policy=always")
    + ("--config.slots=2", "--config.prompt_buckets=(64,)", "--config.max_new_tokens=16"),
    server=True,
    slow=True,
  ),
)

# Launchers run with --help only, each with a one-line reason (printed by the
# test). Keep this empty where at all possible.
HELP_ONLY: dict[str, str] = {
  "accelerator_check": "its compilers live in an environment of their own, where "
  "tests/aot/test_compile.py runs it",
}


def launchers() -> list[str]:
  """The launcher modules' names: experiments/*.py with a module-level `main` and
  an `if __name__ == "__main__":` block (common.py excluded)."""
  names = []
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))):
    name = os.path.basename(path)[:-3]
    if name == "common":
      continue
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    runs = any(
      isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body
    )
    if has_main and runs:
      names.append(name)
  return names


def test_every_launcher_has_a_step():
  stepped = {step.launcher for step in STEPS}
  found = set(launchers())
  missing = sorted(found - stepped - set(HELP_ONLY))
  assert not missing, (
    f"launchers without a step in tests/test_launchers.py STEPS: {missing} (add one, "
    "with small run-size flags, or a one-line reason in HELP_ONLY)"
  )
  stale = sorted((stepped | set(HELP_ONLY)) - found)
  assert not stale, f"STEPS or HELP_ONLY name launchers that do not exist: {stale}"
  assert not stepped & set(HELP_ONLY), "a launcher both in STEPS and HELP_ONLY"
  assert all(reason.strip() and "\n" not in reason for reason in HELP_ONLY.values())
  assert len({step.id for step in STEPS}) == len(STEPS)


@dataclasses.dataclass
class Result:
  step: Step
  argv: list[str]
  returncode: int | None
  output: str
  seconds: float
  why: str = ""  # what went wrong, beyond the exit status


class Chain:
  """Runs steps once each, a step's `needs` first, in one temporary directory."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    self.results: dict[str, Result] = {}
    self.by_id = {step.id: step for step in STEPS}

  def run(self, step_id: str) -> Result:
    if step_id not in self.results:
      step = self.by_id[step_id]
      for need in step.needs:
        if not _ok(self.run(need)):
          result = Result(step, [], None, "", 0.0, f"not run: step {need!r} it reads from failed")
          self.results[step_id] = result
          return result
      self.results[step_id] = (_serve if step.server else _run)(step, self.tmp)
    return self.results[step_id]


def _ok(result: Result) -> bool:
  return result.returncode == 0 and not result.why


def _argv(step: Step, tmp: str, port: int = 0) -> list[str]:
  flags = [flag.format(tmp=tmp, port=port) for flag in step.flags]
  return [sys.executable, "-m", f"experiments.{step.launcher}", *flags]


def _run(step: Step, tmp: str) -> Result:
  if step.prepare is not None:
    step.prepare(tmp)
  argv = _argv(step, tmp)
  start = time.perf_counter()
  process = subprocess.Popen(
    argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    output, why = process.communicate(timeout=TIMEOUT_S)[0], ""
  except subprocess.TimeoutExpired:
    process.kill()
    output, why = process.communicate()[0], f"timed out after {TIMEOUT_S} s"
  return Result(step, argv, process.returncode, output, time.perf_counter() - start, why)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _serve(step: Step, tmp: str) -> Result:
  """Starts the server, waits for /health, SIGTERMs it; its exit status and log."""
  port = _free_port()
  argv = _argv(step, tmp, port)
  start = time.perf_counter()
  with tempfile.TemporaryFile("w+") as log:
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    why = ""
    try:
      while not healthy(port):
        if process.poll() is not None:
          why = "exited before GET /health answered 200"
          break
        if time.perf_counter() - start > SERVER_WAIT_S:
          why = f"GET /health did not answer 200 within {SERVER_WAIT_S} s"
          break
        time.sleep(0.5)
      healthy_s = time.perf_counter() - start
      if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
          process.wait(timeout=SERVER_STOP_S)
          if not why and process.returncode != 0:
            why = f"exit status {process.returncode} after SIGTERM (want 0)"
        except subprocess.TimeoutExpired:
          why = why or f"still running {SERVER_STOP_S} s after SIGTERM"
    finally:
      if process.poll() is None:
        process.kill()
        process.wait()
    log.seek(0)
    output = log.read()
  output += f"\n[/health answered after {healthy_s:.1f} s]" if not why else ""
  return Result(step, argv, process.returncode, output, time.perf_counter() - start, why)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  from specjax.data.corpus import copy_subset

  tmp = str(tmp_path_factory.mktemp("launchers"))
  copy_subset(os.path.join(tmp, "corpus"), CORPUS_FILES)
  return Chain(tmp)


@pytest.mark.front_door  # run in tests/test_front_door.py's process
@pytest.mark.parametrize(
  "step_id", [pytest.param(s.id, marks=[pytest.mark.slow] if s.slow else []) for s in STEPS]
)
def test_launcher_runs(chain, step_id):
  result = chain.run(step_id)
  command = " ".join(a.replace(chain.tmp, "$TMP") for a in result.argv[1:])
  print(f"{step_id}: {command}: exit {result.returncode} in {result.seconds:.1f} s")
  assert _ok(result), (
    f"{step_id}: python {command}\n{result.why or f'exit status {result.returncode}'}; "
    f"output (tail):\n{result.output[-6000:]}"
  )
  if result.step.check is not None:
    result.step.check(chain.tmp, result.output)


def test_help_only_launchers_print_help():
  for launcher, reason in sorted(HELP_ONLY.items()):
    print(f"experiments.{launcher}: --help only: {reason}")
    process = subprocess.run(
      [sys.executable, "-m", f"experiments.{launcher}", "--help"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
    )
    # absl's --help prints the usage and exits with status 1: the usage it printed
    # (the module's docstring, then its flags) and no traceback are what count.
    output = process.stdout + process.stderr
    assert process.returncode in (0, 1) and "Traceback" not in output, output[-3000:]
    with open(os.path.join(ROOT, "experiments", f"{launcher}.py")) as f:
      first_line = ast.get_docstring(ast.parse(f.read())).splitlines()[0]
    assert first_line in process.stdout and "flags:" in process.stdout, output[-3000:]

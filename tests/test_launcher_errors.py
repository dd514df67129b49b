"""User errors of the launchers (issue 28): a missing checkpoint, run or data
directory is one line naming the flag, raised before any work starts. A config
field that does not exist (issue 62) is one line too, naming the nearest fields.

A few subprocesses check the format a user sees (`error: ...` on stderr, exit
status 2, no traceback); the others call the launchers' functions directly.
"""

import ast
import glob
import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import common
from specjax import pretrained
from specjax.training.checkpoint import HEAD_CONFIG_FILE, MODEL_CONFIG_FILE, check_run

# Runs in tests/test_front_door.py's process when the whole suite runs.
pytestmark = pytest.mark.front_door

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_user_error_is_one_line_on_stderr(tmp_path):
  missing = str(tmp_path / "MISSING")
  out = tmp_path / "D"
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.reproduce",
      f"--render_from={missing}",
      f"--output_dir={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={k: v for k, v in os.environ.items() if k != "SPECJAX_TRACEBACK"},
    timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert (
    done.stderr
    == f"error: --render_from: {missing}: no such file (a report.json of a finished run)\n"
  )
  assert not out.exists()


def test_a_bad_config_preset_is_one_line_not_the_config_files_traceback():
  done = subprocess.run(
    [sys.executable, "-m", "experiments.benchmark", "--config=configs/benchmark.py:fast"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert done.stderr.splitlines() == [
    "error: flag --config=configs/benchmark.py:fast: ValueError: preset must be one of "
    "['medium', 'self', 'tiny'], got 'fast'.",
    "Pass --helpshort or --helpfull to see help on flags.",
  ]


@pytest.mark.parametrize(
  "args, line",
  [
    # The launcher's default config (ml_collections parses it while the flag is defined).
    (
      ["experiments.decode", "--config.gama=4"],
      "error: --config.gama: configs/decode.py has no field gama (nearest: --config.gamma)",
    ),
    # A config given, a nested field, a value that would not parse (absl parses it later).
    (
      [
        "experiments.compare_drafters",
        "--config=configs/compare_trees.py",
        "--config.trees.max_dpeth=[3,",
      ],
      "error: --config.trees.max_dpeth: configs/compare_trees.py has no field "
      "trees.max_dpeth (nearest: --config.trees.max_depth)",
    ),
  ],
)
def test_a_config_field_that_does_not_exist_is_one_line(args, line):
  done = subprocess.run(
    [sys.executable, "-m", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={k: v for k, v in os.environ.items() if k != "SPECJAX_TRACEBACK"},
    timeout=120,
  )
  assert "Traceback" not in done.stderr, done.stderr
  assert (done.returncode, done.stderr, done.stdout) == (2, line + "\n", "")


def test_config_field_error_reads_every_way_of_naming_a_field(tmp_path):
  decode = os.path.join(common.CONFIG_DIR, "decode.py")
  near = "configs/decode.py has no field gama (nearest: --config.gamma)"
  for argv in (
    ["--config.gama=4"],
    ["--config.gama", "4"],
    ["--noconfig.gama"],
    ["-config.gama=4"],
    ["--config.gamma=2", "--config.gama=[1,"],
  ):
    assert common.config_field_error(["x", *argv], decode) == f"--config.gama: {near}"
  flagfile = tmp_path / "flags"
  flagfile.write_text("--config=configs/benchmark.py:tiny\n--config.target.nlayers=2\n")
  assert common.config_field_error(["x", f"--flagfile={flagfile}"], None) == (
    "--config.target.nlayers: configs/benchmark.py:tiny has no field target.nlayers "
    "(nearest: --config.target.n_layers)"
  )
  assert common.config_field_error(["x", "--config", decode, "--config.gamma.x=1"], None) == (
    "--config.gamma.x: gamma in configs/decode.py is a value (int), not a group of fields"
  )
  from configs import decode as decode_config  # nothing near: every field of the group

  fields = ", ".join(f"--config.{name}" for name in sorted(decode_config.get_config()))
  assert common.config_field_error(["x", "--config.zzz=1"], decode) == (
    f"--config.zzz: configs/decode.py has no field zzz (fields: {fields})"
  )
  # Fields that exist, a preset that does not (absl's parsing reports it), no field named.
  for argv, default in (
    (["--config.gamma=2", "--config.prompt=x"], decode),
    (["--config=configs/compare_trees.py", "--config.trees.max_depth=3"], None),
    (["--config=configs/benchmark.py:fast", "--config.gama=2"], None),
    (["--config=configs/benchmark.py:tiny"], None),
  ):
    assert common.config_field_error(["x", *argv], default) is None


def test_every_config_flag_is_defined_by_common():
  """The check above runs in `common.define_config_flag`: a launcher defining
  its --config another way would answer a mistyped field with a traceback."""
  defines = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))):
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
      if isinstance(node, ast.Attribute) and node.attr.startswith("DEFINE_config"):
        defines.setdefault(os.path.basename(path), set()).add(node.attr)
  assert defines == {"common.py": {"DEFINE_config_file"}}


def test_check_run_names_the_flag_and_what_the_directory_is(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"^--target: .*nowhere: no such run directory$"):
    check_run(str(tmp_path / "nowhere"), "--target")
  with pytest.raises(
    FileNotFoundError,
    match=r"^--target: .*stdlib_pair/target is not a training run directory: no "
    r"model_config.json \(it is a Hugging Face checkpoint: config.json\)$",
  ):
    check_run(pretrained.TARGET_DIR, "--target")
  head = tmp_path / "head"
  head.mkdir()
  (head / HEAD_CONFIG_FILE).write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"^--drafts: .* is the training run of a draft head"):
    check_run(str(head), "--drafts")
  with pytest.raises(FileNotFoundError, match=r"^--eagle: the run .*head holds no checkpoint yet"):
    check_run(str(head), "--eagle", kind="head")
  (head / MODEL_CONFIG_FILE).write_text("{}")
  (head / "checkpoints" / "4").mkdir(parents=True)
  check_run(str(head), "--eagle", kind="head")


def test_generate_data_checks_its_flags_before_the_target_loads(tmp_path):
  from specjax.training.continuations import write_continuations

  def generate(target, data_dir, out):
    write_continuations(target, data_dir, out, 1, 1, 8, 4, 0)

  with pytest.raises(
    FileNotFoundError, match=r"^--target: the target directory runs/target does not exist"
  ):
    generate("runs/target", str(tmp_path), str(tmp_path / "gen"))
  with pytest.raises(FileNotFoundError, match=r"^--data_dir: .*data: no such data directory$"):
    generate(pretrained.TARGET_DIR, str(tmp_path / "data"), str(tmp_path / "gen"))
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"^--data_dir: data directory .* lacks train.bin, "):
    generate(pretrained.TARGET_DIR, str(tmp_path), str(tmp_path / "gen"))
  assert not (tmp_path / "gen").exists()


def test_evaluate_and_bundle_launchers_name_the_missing_run(tmp_path):
  from experiments import bundle_cross_draft, bundle_heads, bundle_pair, evaluate_drafts

  nowhere, out = str(tmp_path / "nowhere"), tmp_path / "out"
  with pytest.raises(FileNotFoundError, match="^--target: .*nowhere: no such run directory$"):
    evaluate_drafts.compare(nowhere, [nowhere], nowhere)
  with pytest.raises(FileNotFoundError, match="^--target: .*nowhere: no such run directory$"):
    bundle_pair.bundle(nowhere, nowhere, nowhere, str(out))
  with pytest.raises(FileNotFoundError, match="^--medusa: .*nowhere: no such run directory$"):
    bundle_heads.bundle({"medusa": nowhere}, str(out))
  with pytest.raises(FileNotFoundError, match="^--draft: .*nowhere: no such run directory$"):
    bundle_cross_draft.bundle(nowhere, nowhere, str(out))
  with pytest.raises(FileNotFoundError, match="^--data_gen: .*nowhere: no such data directory$"):
    bundle_cross_draft.reencode(nowhere, nowhere, str(out))
  assert not out.exists()


def test_decode_names_the_checkpoint_flags(tmp_path, monkeypatch):
  from configs import decode as decode_config
  from specjax.jobs import decode

  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()
  config = decode_config.get_config()
  config.target, config.draft = "runs/target", "runs/draft"
  with pytest.raises(FileNotFoundError, match=r"^--config.target: runs/target: no such checkpoint"):
    decode.run(config)
  config.target = pretrained.TARGET_DIR
  with pytest.raises(FileNotFoundError, match=r"^--config.draft: runs/draft: no such checkpoint"):
    decode.run(config)
  config.target = config.draft = ""
  config.drafter, config.head = "eagle", "runs/eagle"
  with pytest.raises(
    FileNotFoundError, match=r"^--config.head: runs/eagle: no such checkpoint directory"
  ):
    decode.run(config)


def test_render_from_names_the_flag(tmp_path):
  from specjax.reproduce.run import read_saved_report

  with pytest.raises(ValueError, match=r"^--render_from: .* is a directory; name its report.json"):
    read_saved_report(str(tmp_path))
  saved = tmp_path / "report.json"
  saved.write_text(json.dumps({"rows": []}))
  with pytest.raises(ValueError, match=r"^--render_from: .* is not a report.json .*'config'"):
    read_saved_report(str(saved))


@pytest.mark.parametrize("launcher", ["decode", "benchmark", "compare_drafters"])
@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(loop="scan"), r"^config.loop must be one of \('while', 'chunked'\), got 'scan'"),
    (dict(loop="chunked", loop_chunk=0), r"^config.loop_chunk must be an integer >= 1, got 0"),
  ],
)
def test_loop_settings_are_checked_before_any_model_loads(launcher, changes, message):
  import importlib

  job = importlib.import_module(f"specjax.jobs.{launcher}")
  config = importlib.import_module(f"configs.{launcher}").get_config()
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    job.check_config(config)


def test_string_level_decoding_takes_the_while_loop_only():
  from configs import decode as decode_config
  from specjax.jobs import decode

  config = decode_config.get_config()
  config.drafter, config.loop = "string_level", "chunked"
  with pytest.raises(
    ValueError, match="^config.loop must be 'while' with config.drafter='string_level'"
  ):
    decode.check_config(config)

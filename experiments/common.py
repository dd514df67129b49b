"""What the launchers share: flag definitions and error reporting (result files and
markdown tables: `specjax.results`).

The one flag pattern: each launcher defines all of its flags in a module-level
`define_flags()`, built from the helpers here where flags are shared, and calls
it only under `if __name__ == "__main__":`. Importing a launcher therefore
defines no flags, so tests can import several launchers in one process without
absl raising DuplicateFlagError.

Every `main` checks its output paths (`specjax.validation.check_output_path`)
before any work: results are written only at the end of a run, which is too
late to learn that the path is unusable.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_flags

# Flags defined by the helpers here belong to the launcher that calls them, so
# that its --help lists them.
flags.disclaim_key_flags()

CONFIG_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "configs"))

# What a user's input can get wrong (a missing file or checkpoint, a bad value):
# reported as one line by `run`, not as a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError)


def run(main: Callable[[Sequence[str]], Any]) -> None:
  """`app.run(main)`, with a user error (`USER_ERRORS`) printed as one line and
  JAX's backend probing quiet (`quiet_backend_probing`).

  The launcher exits with status 2 and `error: MESSAGE` on stderr. Set
  SPECJAX_TRACEBACK=1 to see the traceback instead (a ValueError may also be a
  bug worth reading).
  """

  def guarded(argv: Sequence[str]) -> Any:
    quiet_backend_probing()  # after app.run has set up absl's logging
    try:
      return main(argv)
    except USER_ERRORS as e:
      if os.environ.get("SPECJAX_TRACEBACK"):
        raise
      message = str(e) or type(e).__name__
      if isinstance(e, OSError) and e.filename and e.strerror:
        message = f"{e.filename}: {e.strerror}"
      exit_with_error(message)

  app.run(guarded, flags_parser=_parse_flags)


def exit_with_error(message: str) -> None:
  """Ends the launcher as on a user error: `error: MESSAGE` on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with a bad flag reported as one `error:` line (exit 2).

  A config file that raises (a bad `:preset`, a bad value) reaches absl as a
  flag error that quotes the config file's whole traceback; the first line
  (which flag) and the last (what is wrong) are what a user needs.
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
      lines = [lines[0].removesuffix("Error whilst parsing config file:").strip(), lines[-1]]
    print(f"error: {' '.join(lines)}", file=sys.stderr)
    print("Pass --helpshort or --helpfull to see help on flags.", file=sys.stderr)
    sys.exit(2)


def define_config_flag(help_text: str, default_file: str | None = None) -> None:
  """Defines --config, an ml_collections config file (`PATH[:preset]`), locked.

  Fields are overridden with `--config.FIELD=VALUE`; locking makes a misspelt
  field an error instead of a silently ignored new field, reported here as one
  line with the nearest fields (`config_field_error`; ml_collections would raise
  it as a traceback from inside this definition when --config is absent, and
  from inside absl's parsing when it is given).

  Args:
    help_text: the flag's help.
    default_file: a file name in configs/ used when --config is absent; None
      makes --config required.
  """
  default = None if default_file is None else os.path.join(CONFIG_DIR, default_file)
  error = config_field_error(sys.argv, default)
  if error is not None and not os.environ.get("SPECJAX_TRACEBACK"):
    exit_with_error(error)
  config_flags.DEFINE_config_file("config", default, help_text, lock_config=True)
  if default is None:
    flags.mark_flag_as_required("config")


# `--config.FIELD[=VALUE]`, `--noconfig.FIELD` (one dash too), as ml_collections reads them.
_FIELD_FLAG = re.compile(r"^--?(?:no)?config\.([^=]+)")
_CONFIG_FLAG = re.compile(r"^--?config(?:=(.*))?$")


def config_field_error(argv: Sequence[str], default: str | None) -> str | None:
  """The first `--config.FIELD` of `argv` whose FIELD (dotted for a nested one)
  names no field of the config, as one line naming it and the nearest fields;
  None when all exist.

  The config is `--config=PATH[:preset]` from `argv` (flag files read), else
  `default`; a config that does not load is left to absl's parsing, which
  reports it. Only names are checked, never values: a value that would not
  parse does not hide the misspelt name. Below an indexed field (`a[0].b`), a
  dataclass or a None group, ml_collections judges the rest of the path.
  """
  with contextlib.suppress(flags.Error):  # a bad flag file: absl reports it when it parses
    argv = flags.FLAGS.read_flags_from_files(list(argv), force_gnu=False)
  paths = [match.group(1) for arg in argv if (match := _FIELD_FLAG.match(arg))]
  source = default
  for i, arg in enumerate(argv):
    if match := _CONFIG_FLAG.match(arg):
      given = match.group(1)
      source = argv[i + 1] if given is None and i + 1 < len(argv) else given
  if not paths or not source:
    return None
  try:  # the config alone, defined in a FlagValues of its own (no overrides)
    probe = flags.FlagValues()
    config_flags.DEFINE_config_file("config", source, flag_values=probe, sys_argv=argv[:1])
    config = probe["config"].value
  except Exception:  # reported, as before, when absl parses --config
    return None
  if source.startswith(CONFIG_DIR + os.sep):  # a launcher's default, as its docs name it
    source = os.path.join("configs", os.path.relpath(source, CONFIG_DIR))
  for path in paths:
    problem = _field_problem(config, path, source)
    if problem is not None:
      return f"--config.{path}: {problem}"
  return None


def _field_problem(config: ml_collections.ConfigDict, path: str, source: str) -> str | None:
  """What is wrong with the dotted field `path` of `config` (from `source`), or None."""
  holder, walked = config, ""
  for name in path.split("."):
    field = name.split("[", 1)[0]
    if isinstance(holder, (bool, int, float, str)):
      return f"{walked} in {source} is a value ({type(holder).__name__}), not a group of fields"
    if not isinstance(holder, ml_collections.ConfigDict):
      return None
    group = walked + "." if walked else ""
    if field not in holder:
      known = sorted(str(key) for key in holder)
      near = difflib.get_close_matches(field, known, n=3, cutoff=0.7)
      names = ", ".join(f"--config.{group}{key}" for key in (near or known))
      return f"{source} has no field {group}{field} ({'nearest' if near else 'fields'}: {names})"
    if field != name:
      return None
    holder, walked = holder[field], group + field
  return None


def define_output_flags(markdown: bool = False) -> None:
  """Defines --output_json, and --output_md when the launcher prints a markdown table."""
  flags.DEFINE_string("output_json", None, "Also write the result JSON to this path.")
  if markdown:
    flags.DEFINE_string("output_md", None, "Also write the markdown table to this path.")


def check_no_args(argv: Sequence[str]) -> None:
  """Raises a usage error for positional arguments (a flag typo often leaves one)."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}")


def quiet_backend_probing() -> None:
  """Hides JAX's INFO lines about accelerator backends it could not start.

  On a machine without a TPU, JAX's first backend look-up logs "Unable to
  initialize backend 'tpu': ... Failed to open libtpu.so" at INFO, which absl
  prints; warnings (e.g. a GPU without a CUDA jaxlib) still show.
  """
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

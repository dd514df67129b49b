"""Every code block in README.md and docs/*.md runs as written, and every relative link resolves.

One test per markdown file (README.md, then docs/*.md as found at collection),
running that file's blocks in file order; the harness is tests/docs_blocks.py.

Which blocks run, by the fence's language (its info string's first word):
- ```python (or py): the block is its own script, run by this interpreter in
  a subprocess (cwd a scratch tree that mirrors the repository root, see
  below; the repository on PYTHONPATH); it must exit 0.
- ```bash, sh or shell: the block is one `bash -euo pipefail` script (cwd the
  scratch tree, the repository on PYTHONPATH, this interpreter's directory
  first on PATH, so `python` is this interpreter); `\\` continuations and
  comments work as in bash. It must exit 0.
- any other language (text, console, json, toml, none, ...): not run.
Blocks may write to runs/ or /tmp, as written; a later block may read what an
earlier one wrote. The scratch tree (`docs_blocks.worktree()`, one per test
process) links every top-level entry of the repository but runs/, so runs/
starts empty and a developer's own runs/ is neither read nor overwritten.
Every block inherits the test process's environment, so the compilation cache
and XLA flags of tests/conftest.py apply. A failing block does not stop the file's later
blocks; the test then fails with each failure's file, the block's first line
number, the script as run and the tail of its output.

Markers: HTML comments on the line(s) directly above a fence (no blank line
between), one per line, combinable:
- `<!-- docs-test: skip: REASON -->`: not run. Only for what cannot run here
  (multi-host pods, GPUs, installs that .ci/run already does); the reason must
  be given, and is printed when the file's test runs.
- `<!-- docs-test: flags: FLAGS -->`: FLAGS are appended to every `python -m
  experiments.NAME` command of the (shell) block, and a flag of the command's
  own with the same name is dropped, so they override it (ml_collections adds
  up a tuple field given twice rather than keeping the last): the small
  run-size flags of a long command, e.g. `--config.max_new_tokens=8`.
- `<!-- docs-test: flags experiments.NAME: FLAGS -->`: the same, for that
  launcher's commands only (a block that trains and then decodes).
- `<!-- docs-test: server: PORT -->`: the block starts a long-running server:
  it runs in the background, must answer 200 on http://127.0.0.1:PORT/health
  within 120 s (or its timeout marker's seconds), stays up while the file's
  later blocks run, and at the end of the file gets SIGTERM (its whole process
  group) and must exit 0 within 60 s.
- `<!-- docs-test: timeout: SECONDS -->`: the block's time limit (default 300 s).
A marker not directly above a fence, an unknown marker or a skip without a
reason fails the file's test before any block runs.

A second test checks that every relative link in these files (inline and
reference links outside code) names an existing file or directory, and that a
`#anchor` into a markdown file (or the same file) names one of its headings
(GitHub's anchors: lowercase, punctuation dropped, spaces to hyphens).
"""

import glob
import os
import pathlib
import re
import textwrap

import docs_blocks
import pytest
from docs_blocks import ROOT, DocsError


def _docs_in_reading_order() -> list[str]:
  """README.md, then the guides in the order the README links them (a guide's
  commands may read what an earlier guide's wrote under runs/, as a reader's
  would), then any guide it does not link."""
  guides = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
  with open(os.path.join(ROOT, "README.md")) as f:
    linked = re.findall(r"\]\((docs/[\w.-]+\.md)\)", f.read())
  order = list(dict.fromkeys(g for g in linked if g in guides))
  return ["README.md"] + order + [g for g in guides if g not in order]


DOCS = _docs_in_reading_order()
# The files whose blocks the default tier runs (README 59 s, usage 117 s,
# bundled_pair 157 s alone, 2-core AMD EPYC, 2026-12-02); the other guides'
# commands train, serve, reproduce and compare for minutes each (about 45
# minutes all told), so they run in the slow tier (tests/conftest.py). A quick
# reproduction runs in the default tier besides: the reproduce launcher step.
QUICK = ("README.md", "docs/usage.md", "docs/bundled_pair.md")
QUICK += ("docs/how_it_works.md", "docs/layout.md")  # no blocks to run


@pytest.mark.front_door  # run in tests/test_front_door.py's process
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in DOCS]
)
def test_blocks_run(name):
  failures = docs_blocks.run_file(os.path.join(ROOT, name))
  assert not failures, f"{len(failures)} block(s) of {name} failed:\n\n" + "\n\n".join(failures)


def test_relative_links_resolve():
  broken = [b for name in DOCS for b in docs_blocks.broken_links(os.path.join(ROOT, name))]
  assert not broken, "broken links:\n" + "\n".join(broken)


# A path in backticks (the layout table, the guides' "see `specjax/...`") is a link too.
REPO_PATH = re.compile(r"`((?:specjax|experiments|configs|tests|docs)/[\w/.\-]*)`")


def test_repository_paths_named_in_docs_exist():
  missing = [
    f"{name}: {match.group(1)}"
    for name in DOCS
    for match in REPO_PATH.finditer(pathlib.Path(ROOT, name).read_text())
    if not os.path.exists(os.path.join(ROOT, match.group(1)))
  ]
  assert not missing, "paths that do not exist:\n" + "\n".join(missing)


# -- the harness itself, on markdown of its own


def _write(tmp_path, text, name="sample.md"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(text))
  return str(path)


def test_parse_reads_languages_markers_and_line_numbers(tmp_path):
  path = _write(
    tmp_path,
    """\
    # Title

    ```python
    print(1)
    ```

    <!-- docs-test: flags: --config.num_runs=3 -->
    <!-- docs-test: flags experiments.train: --config.num_steps=2 -->
    <!-- docs-test: timeout: 60 -->
    ```bash
    python -m experiments.decode
    ```

    1. In a list:

       <!-- docs-test: skip: needs a GPU -->
       ```sh
       nvidia-smi
         indented
       ```

    ````text
    ```python
    not a block
    ```
    ````
    """,
  )
  blocks = docs_blocks.parse(path)
  assert [(b.line, b.lang, b.kind) for b in blocks] == [
    (3, "python", "python"),
    (10, "bash", "bash"),
    (17, "sh", "bash"),
    (22, "text", None),
  ]
  assert blocks[0].code == "print(1)\n" and blocks[0].timeout == docs_blocks.DEFAULT_TIMEOUT_S
  assert blocks[1].flags == {"": "--config.num_runs=3", "experiments.train": "--config.num_steps=2"}
  assert blocks[1].timeout == 60 and blocks[1].skip is None
  assert blocks[2].skip == "needs a GPU" and blocks[2].code == "nvidia-smi\n  indented\n"


@pytest.mark.parametrize(
  "text, message",
  [
    ("<!-- docs-test: skip: -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- docs-test: skip: why -->\n\n```bash\nls\n```\n", "not directly above"),
    ("<!-- docs-test: skipp: why -->\n```bash\nls\n```\n", "unknown docs-test marker"),
    ("<!-- docs-test: server: http -->\n```bash\nls\n```\n", "positive number"),
    ("<!-- docs-test: timeout: 9 -->\n", "not directly above"),
    ("```bash\nls\n", "never closed"),
  ],
)
def test_parse_rejects_broken_markers(tmp_path, text, message):
  with pytest.raises(DocsError, match=message):
    docs_blocks.parse(_write(tmp_path, text))


def test_flags_go_after_each_launchers_own_flags_and_replace_the_same_names():
  flags = {"": "--config.num_runs=3", "experiments.train": "--config.num_steps=2"}
  code = textwrap.dedent(
    """\
    # python -m experiments.decode in a comment stays
    python -m experiments.train --config=configs/train_tiny.py \\
        --workdir=runs/x  # phase 1
    XLA_FLAGS=--a python3 -m experiments.decode --config.prompt="a | b" 2>&1 | tail -3
    python -m experiments.serve & sleep 1; python -m experimentsx.y
    ssh host --command="cd x && python -m experiments.decode --y"
    python -m experiments.decode --config.num_runs=5 --config.x="(1, 2)" --config.num_runs_x=1
    """
  )
  assert docs_blocks.add_flags(code, flags).splitlines() == [
    "# python -m experiments.decode in a comment stays",
    "python -m experiments.train --config=configs/train_tiny.py      --workdir=runs/x"
    " --config.num_steps=2 --config.num_runs=3  # phase 1",
    'XLA_FLAGS=--a python3 -m experiments.decode --config.prompt="a | b"'
    " --config.num_runs=3 2>&1 | tail -3",
    "python -m experiments.serve --config.num_runs=3 & sleep 1; python -m experimentsx.y",
    'ssh host --command="cd x && python -m experiments.decode --y --config.num_runs=3"',
    'python -m experiments.decode --config.x="(1, 2)" --config.num_runs_x=1 --config.num_runs=3',
  ]


def test_run_file_runs_blocks_in_order_and_reports_failures(tmp_path):
  out = tmp_path / "out.txt"
  path = _write(
    tmp_path,
    f"""\
    ```python
    import os, experiments  # the repository is importable, cwd mirrors its root
    assert os.path.samefile("experiments", {os.path.join(ROOT, "experiments")!r})
    # A scratch tree: runs/ is not the repository's (an earlier block may have made one).
    assert not os.path.islink("runs")
    open({str(out)!r}, "w").write("one\\n")
    ```

    ```bash
    # the second block sees what the first wrote
    grep -q one {out} \\
      && echo two >> {out}
    ```

    ```console
    $ exit 1
    ```

    <!-- docs-test: skip: cannot run here -->
    ```bash
    exit 1
    ```

    ```bash
    false | cat
    echo not reached
    ```

    <!-- docs-test: timeout: 1 -->
    ```python
    import time; time.sleep(30)
    ```
    """,
  )
  lines = []
  failures = docs_blocks.run_file(path, echo=lines.append)
  assert out.exists() and out.read_text() == "one\ntwo\n", (lines, failures)
  assert len(failures) == 2, failures
  assert failures[0].startswith(f"{path}:24: exit status 1") and "false | cat" in failures[0]
  assert "not reached" not in failures[0].split("--- its output")[1]
  assert failures[1].startswith(f"{path}:30: timed out after 1 s")
  assert f"{path}:20: skipped: cannot run here" in lines


def test_server_block_stays_up_for_the_file_then_exits_on_sigterm(tmp_path):
  port = _free_port()
  server = textwrap.dedent(
    """\
    import http.server, signal, sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    class Health(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
  )
  (tmp_path / "server.py").write_text(server)
  path = _write(
    tmp_path,
    f"""\
    <!-- docs-test: server: {port} -->
    ```bash
    python {tmp_path}/server.py {port}
    ```

    ```bash
    python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health')"
    ```
    """,
  )
  assert docs_blocks.run_file(path, echo=lambda line: None) == []
  # A server that dies of SIGTERM (status -15 / 143) fails the file.
  (tmp_path / "server.py").write_text(server.replace("lambda *_: sys.exit(0)", "signal.SIG_DFL"))
  failures = docs_blocks.run_file(path, echo=lambda line: None)
  assert len(failures) == 1 and "after SIGTERM (want 0)" in failures[0], failures


def test_broken_links_are_found(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "guide.md").write_text("# The `Engine` guide\n\n## Set-up, step 1\n")
  path = _write(
    tmp_path,
    """\
    # Top

    [ok](docs/guide.md) [ok](docs/guide.md#the-engine-guide) [ok](docs/guide.md#set-up-step-1)
    [ok](#top) [ok](https://example.com/x) [ok](docs) `[no](in/code.md)`
    [bad](docs/missing.md) [bad](docs/guide.md#nowhere) [bad](#bottom)
    [ref]: docs/gone.md

    ```text
    [no](in/a/block.md)
    ```
    """,
  )
  broken = [b.split(": ", 1)[1] for b in docs_blocks.broken_links(path)]
  assert broken == [
    "docs/missing.md (no such file)",
    "docs/guide.md#nowhere (no heading with that anchor)",
    "#bottom (no heading with that anchor)",
    "docs/gone.md (no such file)",
  ]


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]

"""The fenced code blocks of markdown files, and running them as tests/test_docs.py does.

See tests/test_docs.py for the conventions (which blocks run, and the
`<!-- docs-test: ... -->` markers that control them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
DEFAULT_TIMEOUT_S = 300.0
SERVER_WAIT_S = 120.0  # how long a server block may take to answer /health
SERVER_STOP_S = 60.0  # how long a server may take to exit after SIGTERM
TAIL_CHARS = 4000  # output shown in a failure message

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
# `flags: F` (every launcher) or `flags experiments.NAME: F` (that launcher only).
_KEY = re.compile(r"^(?P<key>skip|flags|server|timeout)(?:\s+(?P<arg>experiments\.\w+))?\s*:")
# A launcher's command: `python -m experiments.NAME` (python3, python3.11, and an
# environment's own, `.aot-env/bin/python`, too).
_LAUNCHER = re.compile(
  r"(?<![\w./-])(?:[\w.-]*/)*python[\d.]*\s+-m\s+(?P<module>experiments\.\w+)(?![\w.])"
)


class DocsError(ValueError):
  """A markdown file breaks the conventions (a bad marker, an unclosed fence)."""


@dataclasses.dataclass
class Block:
  """One fenced code block and what its markers say.

  Attributes:
    path: the markdown file.
    line: the 1-based line of the opening fence.
    lang: the info string's first word, lowercased ("" when none).
    code: the block's text (the fence's indentation removed), ending in a newline.
    skip: the reason given by a `skip` marker; None when the block runs.
    flags: launcher module ("experiments.NAME", or "" for every launcher) ->
      flags appended to its command lines, from `flags` markers.
    server: the port of a `server` marker; None otherwise.
    timeout: seconds the block may take (`timeout` marker, else DEFAULT_TIMEOUT_S).
  """

  path: str
  line: int
  lang: str
  code: str
  skip: str | None = None
  flags: dict[str, str] = dataclasses.field(default_factory=dict)
  server: int | None = None
  timeout: float = DEFAULT_TIMEOUT_S

  @property
  def kind(self) -> str | None:
    """ "python", "bash" or None (a block that is not run: text, console, json, ...)."""
    if self.lang in PYTHON:
      return "python"
    if self.lang in SHELL:
      return "bash"
    return None

  @property
  def where(self) -> str:
    """`FILE:LINE`, FILE relative to the repository when inside it."""
    path = os.path.relpath(self.path, ROOT)
    return f"{self.path if path.startswith('..') else path}:{self.line}"

  def script(self) -> str:
    """The code as run: for a shell block, each launcher's command line with its
    `flags` appended."""
    if self.kind != "bash" or not self.flags:
      return self.code
    return add_flags(self.code, self.flags)


def _apply_marker(body: str, pending: dict, where: str) -> None:
  match = _KEY.match(body)
  if match is None:
    raise DocsError(
      f"{where}: unknown docs-test marker {body!r} (want skip:, flags:, flags "
      "experiments.NAME:, server: or timeout:)"
    )
  key, arg, value = match["key"], match["arg"], body[match.end() :].strip()
  if arg and key != "flags":
    raise DocsError(f"{where}: only flags: takes a launcher name, got {body!r}")
  if key == "skip":
    if not value:
      raise DocsError(f"{where}: a skip marker needs a reason: <!-- docs-test: skip: REASON -->")
    pending["skip"] = value
  elif key == "flags":
    if not value:
      raise DocsError(f"{where}: a flags marker with no flags")
    module = arg or ""
    pending.setdefault("flags", {})
    pending["flags"][module] = f"{pending['flags'].get(module, '')} {value}".strip()
  else:
    try:
      number = int(value) if key == "server" else float(value)
    except ValueError:
      number = 0
    if number <= 0:
      raise DocsError(f"{where}: {key}: wants a positive number, got {value!r}")
    pending[key] = number


def parse(path: str) -> list[Block]:
  """The fenced code blocks of the markdown file `path`, in file order.

  Markers are `<!-- docs-test: ... -->` lines directly above a fence (no blank
  line between); a marker above anything else, an unknown marker, a skip
  without a reason or an unclosed fence raise DocsError.
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  blocks = []
  pending: dict = {}
  pending_line = 0
  i = 0
  while i < len(lines):
    line = lines[i]
    marker = _MARKER.match(line)
    fence = _FENCE.match(line)
    if marker:
      pending_line = pending_line or i + 1
      _apply_marker(marker["body"], pending, f"{path}:{i + 1}")
      i += 1
      continue
    if fence is None:
      if pending:
        raise DocsError(f"{path}:{pending_line}: a docs-test marker not directly above a block")
      i += 1
      continue
    indent, mark = len(fence["indent"]), fence["fence"]
    close = re.compile(rf"^ *{re.escape(mark[0])}{{{len(mark)},}}\s*$")
    body = []
    j = i + 1
    while j < len(lines) and not close.match(lines[j]):
      text = lines[j]
      body.append(text[min(indent, len(text) - len(text.lstrip(" "))) :])
      j += 1
    if j == len(lines):
      raise DocsError(f"{path}:{i + 1}: a code block that is never closed")
    info = fence["info"].strip().split()
    lang = info[0].lower().strip("{}.") if info else ""
    blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", **pending))
    pending, pending_line = {}, 0
    i = j + 1
  if pending:
    raise DocsError(f"{path}:{pending_line}: a docs-test marker not directly above a block")
  return blocks


def _command_end(text: str, start: int) -> int:
  """Where the simple command starting at `text[start]` ends: at an unquoted
  `|`, `&`, `;`, `)`, redirection, comment or newline, or where the quotes
  around `start` close. `text` has no line continuations."""
  quote = None  # the quote character `start` sits in
  for c in text[:start]:
    if quote:
      quote = None if c == quote else quote
    elif c in "'\"":
      quote = c
  outer = quote
  i = start
  while i < len(text):
    c = text[i]
    if quote:
      if c == "\\" and quote == '"':
        i += 2
        continue
      if c == quote:
        if quote == outer:
          return i
        quote = None
    elif c == "\\":
      i += 2
      continue
    elif c in "'\"":
      quote = c
    elif c in "|&;)\n" or (c == "#" and text[i - 1].isspace()):
      break
    elif c in "<>":
      while i > start and text[i - 1].isdigit():  # `2>&1`: the fd belongs to the redirection
        i -= 1
      break
    i += 1
  while i > start and text[i - 1].isspace():
    i -= 1
  return i


def _words(text: str, start: int, end: int) -> list[tuple[int, int]]:
  """(start, end) of each shell word of `text[start:end]`, quotes kept inside words."""
  words, i = [], start
  while i < end:
    if text[i].isspace():
      i += 1
      continue
    begin, quote = i, None
    while i < end and (quote or not text[i].isspace()):
      if quote and text[i] == quote:
        quote = None
      elif not quote and text[i] in "'\"":
        quote = text[i]
      i += 1
    words.append((begin, i))
  return words


def _flag_name(word: str) -> str | None:
  return word.split("=", 1)[0] if word.startswith("-") else None


def add_flags(code: str, flags: dict[str, str]) -> str:
  """`code` (a shell script) with `flags[module]` and `flags[""]` appended to every
  `python -m <module>` command, each replacing the command's own flag of the same
  name (ml_collections adds up repeated tuple fields, `--config.x="(1,)"
  --config.x="(2,)"` giving (1, 2), so the last one does not simply win).

  A command continued over several lines with `\\` becomes one line.
  """
  lines = re.sub(r"\\\n", " ", code).split("\n")
  out = []
  for line in lines:
    if line.lstrip().startswith("#"):
      out.append(line)
      continue
    pieces, last = [], 0
    for match in _LAUNCHER.finditer(line):
      extra = " ".join(f for f in (flags.get(match["module"], ""), flags.get("", "")) if f)
      if not extra or match.start() < last:
        continue
      end = _command_end(line, match.end())
      replaced = {_flag_name(extra[a:b]) for a, b in _words(extra, 0, len(extra))} - {None}
      kept, cursor = [], last
      for a, b in _words(line, match.end(), end):
        if _flag_name(line[a:b]) in replaced:
          kept.append(line[cursor:a].rstrip(" "))  # the word and the spaces before it go
          cursor = b
      pieces += [*kept, line[cursor:end], " " + extra]
      last = end
    out.append("".join(pieces) + line[last:])
  return "\n".join(out)


@functools.cache  # one scratch tree a process, made on first use
def worktree() -> str:
  """Where blocks run: a scratch directory that mirrors the repository (a symlink
  to each top-level entry but runs/), so that what blocks write under runs/
  starts empty in each test process and neither reads nor overwrites a
  developer's own runs/ (a stale runs/data once failed a guide here)."""
  path = tempfile.mkdtemp(prefix="specjax_docs_")
  for name in os.listdir(ROOT):
    if name not in ("runs", ".git"):
      os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
  return path


def _env() -> dict[str, str]:
  """The test process's environment (compilation cache, XLA flags), with the
  repository on PYTHONPATH and this interpreter first on PATH."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
  return env


def _argv(block: Block, script_dir: str) -> list[str]:
  path = os.path.join(script_dir, f"block_{block.line}.{'py' if block.kind == 'python' else 'sh'}")
  with open(path, "w") as f:
    if block.kind == "bash" and block.server:
      # SIGTERM goes to the block's whole process group: the server stops and
      # exits, and bash, whose trap runs after the server has exited, goes on
      # to exit with the server's status rather than 143.
      f.write("trap ':' TERM\n")
    f.write(block.script())
  if block.kind == "python":
    return [sys.executable, path]
  return ["bash", "-euo", "pipefail", path]


def _tail(text: str) -> str:
  return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def _failure(block: Block, why: str, output: str) -> str:
  return (
    f"{block.where}: {why}\n--- the {block.kind} block ---\n{block.script().rstrip()}\n"
    f"--- its output (tail) ---\n{_tail(output).rstrip()}"
  )


def _kill(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.killpg(process.pid, sig)


def _run(block: Block, script_dir: str) -> str | None:
  """Runs an ordinary block; its failure message, or None."""
  process = subprocess.Popen(
    _argv(block, script_dir),
    cwd=worktree(),
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,  # a process group: a timeout kills what the block started
  )
  try:
    output = process.communicate(timeout=block.timeout)[0]
  except subprocess.TimeoutExpired:
    _kill(process)
    output = process.communicate()[0]
    return _failure(block, f"timed out after {block.timeout:g} s", output)
  finally:
    _kill(process)  # whatever the block left running in the background
  if process.returncode != 0:
    return _failure(block, f"exit status {process.returncode}", output)
  return None


@dataclasses.dataclass
class _Server:
  block: Block
  process: subprocess.Popen
  log: str

  def output(self) -> str:
    with open(self.log, errors="replace") as f:
      return f.read()


def healthy(port: int) -> bool:
  """Whether a server on 127.0.0.1:`port` answers 200 on GET /health."""
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
      return response.status == 200
  except (urllib.error.URLError, OSError):
    return False


def _start_server(block: Block, script_dir: str) -> tuple[_Server, str | None]:
  """Starts a server block and waits for its /health; the server and a failure message."""
  log = os.path.join(script_dir, f"server_{block.line}.log")
  with open(log, "w") as f:
    process = subprocess.Popen(
      _argv(block, script_dir),
      cwd=worktree(),
      env=_env(),
      stdout=f,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
  server = _Server(block, process, log)
  wait = block.timeout if block.timeout != DEFAULT_TIMEOUT_S else SERVER_WAIT_S
  deadline = time.monotonic() + wait
  while not healthy(block.server):
    if process.poll() is not None:
      why = f"the server exited with status {process.returncode} before /health answered"
      return server, _failure(block, why, server.output())
    if time.monotonic() > deadline:
      why = f"http://127.0.0.1:{block.server}/health did not answer 200 within {wait:g} s"
      return server, _failure(block, why, server.output())
    time.sleep(0.5)
  return server, None


def _stop_server(server: _Server) -> str | None:
  """SIGTERMs a server block; a failure message unless it exits 0."""
  process = server.process
  if process.poll() is not None:
    why = f"the server exited by itself (status {process.returncode}) before the file's end"
    return _failure(server.block, why, server.output())
  _kill(process, signal.SIGTERM)
  try:
    process.wait(timeout=SERVER_STOP_S)
  except subprocess.TimeoutExpired:
    _kill(process)
    process.wait()
    why = f"the server did not exit within {SERVER_STOP_S:g} s of SIGTERM"
    return _failure(server.block, why, server.output())
  finally:
    _kill(process)
  if process.returncode != 0:
    why = f"the server exited with status {process.returncode} after SIGTERM (want 0)"
    return _failure(server.block, why, server.output())
  return None


def run_file(path: str, echo=print) -> list[str]:
  """Runs the python and shell blocks of the markdown file `path`, in order.

  Server blocks stay up until the file's last block has run, then get SIGTERM.
  A failing block does not stop the rest. Returns the failure messages (empty:
  the file passed); a broken marker raises DocsError before anything runs.

  Args:
    path: a markdown file.
    echo: called with one line per block (where, and what happened).
  """
  blocks = parse(path)
  failures, servers = [], []
  with tempfile.TemporaryDirectory(prefix="docs_test_") as script_dir:
    try:
      for block in blocks:
        if block.kind is None:
          continue
        if block.skip is not None:
          echo(f"{block.where}: skipped: {block.skip}")
          continue
        start = time.perf_counter()
        if block.server:
          server, failure = _start_server(block, script_dir)
          servers.append(server)
        else:
          failure = _run(block, script_dir)
        seconds = time.perf_counter() - start
        echo(f"{block.where}: {block.kind} {'FAILED' if failure else 'ok'} ({seconds:.1f} s)")
        if failure:
          failures.append(failure)
    finally:
      for server in servers:
        failure = _stop_server(server)
        if failure:
          failures.append(failure)
  return failures


# -- links


_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


def _without_fences(text: str) -> str:
  """`text` without its fenced code blocks."""
  kept, fence = [], None
  for line in text.splitlines():
    match = _FENCE.match(line)
    if fence is None and match:
      fence = match["fence"]
      continue
    if fence is not None:
      if re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
        fence = None
      continue
    kept.append(line)
  return "\n".join(kept)


def _prose(text: str) -> str:
  """`text` without fenced blocks, inline code and HTML comments (where links do not count)."""
  prose = re.sub(r"<!--.*?-->", "", _without_fences(text), flags=re.S)
  return re.sub(r"(`+)(?:(?!\1).)+?\1", "", prose)


def anchors(path: str) -> set[str]:
  """The heading anchors GitHub makes for the markdown file `path`."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  seen: dict[str, int] = {}
  out = set()
  for line in _without_fences(text).splitlines():
    match = _HEADING.match(line)
    if not match:
      continue
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match["title"])  # a link: its text
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    out.add(slug if count == 0 else f"{slug}-{count}")
  return out


def broken_links(path: str) -> list[str]:
  """`FILE: TARGET (why)` for each relative link of the markdown file `path` whose
  file does not exist, or whose `#anchor` is not a heading of a markdown target."""
  with open(path, encoding="utf-8") as f:
    prose = _prose(f.read())
  targets = [m["target"] for m in _LINK.finditer(prose)]
  targets += [m["target"] for m in _REFERENCE.finditer(prose)]
  broken = []
  for target in targets:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
      continue
    file, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
    name = os.path.relpath(path, ROOT)
    if not os.path.exists(resolved):
      broken.append(f"{name}: {target} (no such file)")
    elif anchor and resolved.endswith(".md") and anchor.lower() not in anchors(resolved):
      broken.append(f"{name}: {target} (no heading with that anchor)")
  return broken

"""What XLA:GPU launches, read from its thunk sequence (not the HLO).

XLA:GPU lowers the optimised HLO to thunks: kernels, library calls, memcpys,
loops and command buffers (CUDA graphs), and records command buffers on the
thunks, after the HLO: since 2026's XLA, `compiled.as_text()` shows no
`command_buffer` computations, so counting them in the HLO counts none. The
thunk sequence is written by `--xla_dump_to` (a compile option or XLA_FLAGS) as
`module_*.thunk_sequence_after_thunk_passes.txt` (`thunk_sequence.txt` where the
passes changed nothing); `dump_options(dir)` asks for it, `read_dump(dir)` reads it.

  000: kCommandBuffer [source | next=010 (1)]
      001: kCopy ...                        (nested: recorded in the buffer)
  010: kWhile [...]
  condition:
      011: kCustomKernel [...] loop_compare_fusion grid: [1, 1, 1] ...
    body:
      012: kDynamicSliceFusion [...]        (offsets computed on the host)
          013: kCopy ...

A `kWhile` outside a command buffer runs on the host: each trip launches its
condition, copies the predicate to the host and waits for it, then launches
its body. Inside one (CUDA conditional nodes) the trips cost the host nothing.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

_LINE = re.compile(r"^(\s*)\d+:\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_SECTION = re.compile(r"^\s*(condition|body):\s*$")
_GRID = re.compile(r"grid: \[(\d+), (\d+), (\d+)\]")
CONTROL = ("kCommandBuffer", "kWhile", "kConditional", "kSequential", "kDynamicSliceFusion")
MEMCPY = ("kCopy", "kMemset32BitValue", "kMemzero", "kCopyToHost", "kCopyToDevice", "kMemcpy")
_COLLECTIVE = re.compile(
  r"AllReduce|AllGather|ReduceScatter|AllToAll|CollectivePermute|Nccl|Collective"
)


@dataclasses.dataclass
class Thunk:
  """One thunk: its kind ("kCustomKernel"), the rest of its line (the kernel's
  name and grid), what it holds (a command buffer's or dynamic-slice fusion's
  thunks: `children`; a loop's `condition` and `body`; a conditional's branches
  are its `children`)."""

  kind: str
  text: str = ""
  children: list[Thunk] = dataclasses.field(default_factory=list)
  condition: list[Thunk] = dataclasses.field(default_factory=list)
  body: list[Thunk] = dataclasses.field(default_factory=list)

  @property
  def category(self) -> str:
    """ "control", "memcpy", "collective" or "kernel" (everything a GPU runs)."""
    if self.kind in CONTROL:
      return "control"
    if self.kind in MEMCPY:
      return "memcpy"
    if _COLLECTIVE.search(self.kind):
      return "collective"
    return "kernel"

  @property
  def one_block(self) -> bool:
    """A kernel of one thread block (`grid: [1, 1, 1]`): launch cost, no parallelism."""
    grid = _GRID.search(self.text)
    return bool(grid) and grid.groups() == ("1", "1", "1")

  def inner(self) -> list[Thunk]:
    return self.children + self.condition + self.body


def parse(text: str) -> list[Thunk]:
  """The top-level thunks of a thunk-sequence dump, nested as in the dump."""
  root = Thunk("root")
  stack: list[tuple[int, Thunk, str]] = [(-1, root, "children")]
  for line in text.splitlines():
    section = _SECTION.match(line)
    if section:
      # The labels' indentation is not reliable: they belong to the innermost
      # open loop (still reading its condition, for "body").
      want = section.group(1)
      while len(stack) > 1 and not (
        stack[-1][1].kind == "kWhile" and (want == "condition" or stack[-1][2] == "condition")
      ):
        stack.pop()
      indent, node, _ = stack[-1]
      stack[-1] = (indent, node, want)
      continue
    match = _LINE.match(line)
    if not match:
      continue
    indent = len(match.group(1))
    while len(stack) > 1 and stack[-1][0] >= indent:
      stack.pop()
    _, parent, where = stack[-1]
    node = Thunk(match.group(2), match.group(3).strip())
    getattr(parent, where).append(node)
    stack.append((indent, node, "children"))
  return root.children


def _walk(thunks: list[Thunk], recorded: bool = False):
  """(thunk, inside a command buffer) for every thunk, depth first."""
  for t in thunks:
    yield t, recorded
    yield from _walk(t.inner(), recorded or t.kind == "kCommandBuffer")


def _host_launches(thunks: list[Thunk]) -> int:
  """What the host issues for one run of `thunks` (nested host loops once per
  trip): a command buffer, kernel, memcpy or collective counts 1; a host loop
  its condition, its body and the predicate's copy; a dynamic-slice fusion or a
  conditional the copy of its offsets or predicate to the host, then what it
  holds (every branch: an upper bound)."""
  n = 0
  for t in thunks:
    if t.kind == "kWhile":
      n += _host_launches(t.condition) + _host_launches(t.body) + 1
    elif t.kind in ("kDynamicSliceFusion", "kConditional"):
      n += 1 + _host_launches(t.children)
    elif t.kind == "kSequential":
      n += _host_launches(t.children)
    else:
      n += 1
  return n


def _count(thunks: list[Thunk], category: str) -> int:
  return sum(1 for t, _ in _walk(thunks) if t.category == category)


def summary(text: str) -> dict:
  """What a program's thunk sequence launches.

  Returns:
    `kernels`, `memcpys`, `collectives` (each thunk once, loops' bodies once),
    `one_block_kernels`, `command_buffers`, `kernels_in_command_buffers`,
    `dynamic_slice_fusions` (thunks whose offsets the host computes),
    `host_loops` (loops the host drives: a predicate copy and wait per trip),
    `device_loops` (loops recorded in a command buffer), and `generation_loop`:
    for the loop with the most kernels (the generation or serving loop),
    `on_device`, its body's `kernels` (nested loops once) and
    `host_launches_per_trip` (0 on the device; else condition + body launches +
    the predicate copy, a command buffer counting 1).
  """
  top = parse(text)
  walked = list(_walk(top))
  loops = [(t, recorded) for t, recorded in walked if t.kind == "kWhile"]
  out = {
    "kernels": sum(1 for t, _ in walked if t.category == "kernel"),
    "memcpys": sum(1 for t, _ in walked if t.category == "memcpy"),
    "collectives": sum(1 for t, _ in walked if t.category == "collective"),
    "one_block_kernels": sum(1 for t, _ in walked if t.category == "kernel" and t.one_block),
    "command_buffers": sum(1 for t, _ in walked if t.kind == "kCommandBuffer"),
    "kernels_in_command_buffers": sum(1 for t, r in walked if r and t.category == "kernel"),
    "dynamic_slice_fusions": sum(1 for t, _ in walked if t.kind == "kDynamicSliceFusion"),
    "host_loops": sum(1 for _, recorded in loops if not recorded),
    "device_loops": sum(1 for _, recorded in loops if recorded),
    "generation_loop": None,
  }
  if loops:
    loop, recorded = max(loops, key=lambda lr: _count(lr[0].body, "kernel"))
    out["generation_loop"] = {
      "on_device": recorded,
      "kernels": _count(loop.body, "kernel"),
      "host_launches_per_trip": 0
      if recorded
      else _host_launches(loop.condition) + _host_launches(loop.body) + 1,
    }
  return out


def dump_options(directory: str) -> dict:
  """Compile options that make XLA write its dumps (the thunk sequence among
  them) under `directory`: `lowered.compile(dump_options(d))`."""
  return {"xla_dump_to": directory}


def read_dump(directory: str) -> str | None:
  """The thunk sequence of the one module dumped under `directory` (after XLA's
  thunk passes where it wrote that file), or None where there is none (a
  backend other than XLA:GPU)."""
  for pattern in ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"):
    found = sorted(glob.glob(os.path.join(directory, pattern)))
    if found:
      with open(found[-1]) as f:
        return f.read()
  return None

"""Counting what a compiled program executes: kernels per loop body, from its HLO.

Each launching instruction of a top-level computation is one kernel of fixed
cost; `hlo_ops` lists what the loop bodies execute, `cache_copies` what
rewrites a cache-sized buffer whole. Why these counts matter:
docs/performance.md ("How `specjax.bench` measures").
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")  # unindented, ends in {
_OPCODE = re.compile(r"=\s+(?:\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(?:calls|to_apply|condition|body|branch_computations)=\{?%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_ENTRY = re.compile(r"^ENTRY\s+%([\w.\-]+)", re.MULTILINE)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s+=")
_OPERAND = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")
# The computations a while, conditional or call runs: one name, or a {list}.
_RUNS = re.compile(
  r"(?:to_apply|condition|body|branch_computations|true_computation|false_computation)="
  r"(\{[^}]*\}|%?[\w.\-]+)"
)
# Bytes per element of HLO's element types (sub-byte types rounded up).
_ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2}
_ITEM_BYTES |= {"u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ITEM_BYTES |= {"c64": 8, "c128": 16}
# What rewrites a whole buffer rather than updating it in place.
WHOLE_BUFFER_OPS = ("copy", "select", "concatenate", "transpose")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines, from `compiled.as_text()`."""
  comps: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(1)
      comps[name] = []
    elif line.strip() == "}":
      name = None
    elif name is not None and " = " in line:
      comps[name].append(line)
  return comps


def kernel_counts(hlo_text: str) -> dict[str, collections.Counter]:
  """Per top-level computation (entry, loop bodies and conditions, branches): the
  opcodes it launches, counted. Fusion bodies and reducers are not top-level."""
  comps = computations(hlo_text)
  folded = set()
  for lines in comps.values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) not in ("while", "conditional", "call"):
        folded.update(_CALLED.findall(line))
  counts = {}
  for name, lines in comps.items():
    if name in folded:
      continue
    ops = (m.group(1) for m in map(_OPCODE.search, lines) if m)
    counts[name] = collections.Counter(op for op in ops if op not in _FREE)
  return counts


def while_bodies(hlo_text: str) -> list[str]:
  """Names of the computations that are the bodies of while loops, outermost first."""
  bodies = []
  for lines in computations(hlo_text).values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) == "while":
        bodies.extend(_BODY.findall(line))
  return bodies


def trip_counts(hlo_text: str) -> dict[str, int | None]:
  """Each while loop's body -> its trip count where XLA knows it (None: a loop
  that evaluates its condition at run time; on GPU, a device-to-host wait per
  trip)."""
  counts = {}
  for lines in computations(hlo_text).values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) == "while":
        known = _TRIPS.search(line)
        for body in _BODY.findall(line):
          counts[body] = int(known.group(1)) if known else None
  return counts


def loop_kernels(compiled_text: str) -> list[dict]:
  """For each while loop of a compiled program: its body's kernel count and the
  five most frequent opcodes (a summary for reports)."""
  counts = kernel_counts(compiled_text)
  out = []
  for body in while_bodies(compiled_text):
    c = counts.get(body, collections.Counter())
    out.append({"body": body, "kernels": sum(c.values()), "top": dict(c.most_common(5))})
  return out


class HloOp(NamedTuple):
  """One output of an instruction a loop body executes (`hlo_ops`).

  Attributes:
    body: the loop-body computation it runs in (or one that body calls).
    name: the instruction's name; `name#i` for output i of a multi-output fusion.
    opcode: its opcode; effective: a fusion's root opcode (through bitcasts).
    shape, bytes: the output's, e.g. "f32[2,1,2056,16]".

  """

  body: str
  name: str
  opcode: str
  effective: str
  shape: str
  bytes: int


def _array_bytes(shape: str) -> int:
  """Bytes of one array shape such as `f32[2,16]` (0 for a token or an unknown type)."""
  match = _ARRAY.search(shape)
  if not match:
    return 0
  dims = [int(d) for d in match.group(2).split(",") if d]
  return _ITEM_BYTES.get(match.group(1), 0) * math.prod(dims)


def _output_shapes(line: str) -> list[str]:
  """The output array shapes of an instruction line (several for a tuple)."""
  rhs = line.split(" = ", 1)[1]
  if rhs.startswith("("):
    rhs = rhs[: rhs.index(")")]
  else:
    rhs = rhs.split(" ", 1)[0]
  return [m.group(0) for m in _ARRAY.finditer(rhs)]


def _roots(lines: list[str]) -> list[str]:
  """The effective opcode of each output of a fused computation: its root's,
  through bitcasts (one per tuple element). An in-place update counts only on
  the fusion's own operand; one on a buffer the fusion computes first (a select
  of two caches) writes all of it and reports that buffer's opcode."""

  by_name = {}
  root = None
  for line in lines:
    name = _NAME.match(line)
    if name:
      by_name[name.group(1)] = line
      if line.lstrip().startswith("ROOT"):
        root = name.group(1)

  def resolve(name: str) -> str:
    line = by_name.get(name, "")
    op = _OPCODE.search(line)
    opcode = op.group(1) if op else "parameter"
    if opcode in ("bitcast", "dynamic-update-slice", "scatter"):
      operands = _OPERAND.findall(line.split(opcode + "(", 1)[1])
      if not operands:
        return opcode
      updated = resolve(operands[0])
      if opcode == "bitcast" or updated != "parameter":
        return updated
    return opcode

  if root is None:
    return []
  line = by_name[root]
  op = _OPCODE.search(line)
  if op and op.group(1) == "tuple":
    return [resolve(n) for n in _OPERAND.findall(line.split("tuple(", 1)[1].split(")", 1)[0])]
  return [resolve(root)]


def _loop_computations(comps: dict[str, list[str]], roots: list[str]) -> dict[str, str]:
  """Each computation `roots` and every while loop's body run (a root or body, and
  what it calls, conditions and nested loops included, fusions excluded) -> the
  root or outermost body it runs under."""
  edges: dict[str, list[str]] = {}
  for name, lines in comps.items():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) in ("while", "conditional", "call"):
        called = []
        for group in _RUNS.findall(line):
          called.extend(n.strip().lstrip("%") for n in group.strip("{}").split(",") if n.strip())
        edges.setdefault(name, []).extend(c for c in called if c in comps)
  starts = list(roots)
  for lines in comps.values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) == "while":
        starts.extend(_BODY.findall(line))
  owner: dict[str, str] = {}
  for start in starts:
    stack = [start]
    while stack:
      comp = stack.pop()
      if comp not in owner:
        owner[comp] = start
        stack.extend(edges.get(comp, []))
  return owner


def hlo_ops(compiled_text: str, entry: bool = False) -> list[HloOp]:
  """What the while loops' bodies of a compiled program execute, output by output.

  Args:
    compiled_text: `jax.jit(f).lower(...).compile().as_text()`.
    entry: also the entry computation's own instructions: for a program that is
      itself the body of a host loop (a serving engine's step), where a cache
      that is not donated is copied on the way in.

  Returns:
    One `HloOp` per output of each launching instruction of every loop body
    (and the computations it calls), in program order.
  """

  comps = computations(compiled_text)
  roots = _ENTRY.findall(compiled_text) if entry else []
  owner = _loop_computations(comps, roots)
  ops = []
  for comp, body in owner.items():
    for line in comps[comp]:
      op, name = _OPCODE.search(line), _NAME.match(line)
      if not op or not name or op.group(1) in _FREE:
        continue
      opcode, shapes = op.group(1), _output_shapes(line)
      if opcode in ("while", "conditional", "call"):
        continue  # their computations are listed themselves
      effective = [opcode] * len(shapes)
      if opcode == "fusion":
        called = _CALLED.search(line)
        roots = _roots(comps.get(called.group(1), [])) if called else []
        effective = roots if len(roots) == len(shapes) else ["fusion"] * len(shapes)
      for i, (shape, eff) in enumerate(zip(shapes, effective)):
        label = name.group(1) if len(shapes) == 1 else f"{name.group(1)}#{i}"
        ops.append(HloOp(body, label, opcode, eff, shape, _array_bytes(shape)))
  return ops


def cache_copies(compiled_text: str, min_bytes: int, entry: bool = False) -> list[HloOp]:
  """The loop-body outputs that rewrite a buffer of at least `min_bytes` whole
  (`WHOLE_BUFFER_OPS`, not an in-place update). Pass one layer's K cache size,
  with shapes where no other buffer in the loop is that large.
  """
  return [
    op
    for op in hlo_ops(compiled_text)
    if op.effective in WHOLE_BUFFER_OPS and op.bytes >= min_bytes
  ]


_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
# XLA:GPU outlines what it records in a command buffer (a CUDA graph) into a
# computation of this name, called once where the sequence stood.
COMMAND_BUFFER = "command_buffer"


def _callees(line: str) -> list[str]:
  """The computations a while, conditional or call instruction runs."""
  called = []
  for group in _RUNS.findall(line):
    called.extend(n.strip().lstrip("%") for n in group.strip("{}").split(",") if n.strip())
  return called


def launches(hlo_text: str, computation: str | None = None, graphs_as_one: bool = False) -> dict:
  """Kernels one run of `computation` (default: the entry) launches, nested
  control flow included: its own launching instructions, the computations its
  calls run, a conditional's costliest branch, and each while loop's body and
  condition once per trip (its known trip count; once where XLA does not know
  it, counted in `unknown_trips`). `graphs_as_one`: a call of a command buffer
  counts as one launch (what the host issues) instead of its kernels.

  Returns:
    `{"kernels": int, "unknown_trips": int}`.
  """
  comps = computations(hlo_text)
  name = computation or _ENTRY.search(hlo_text).group(1)
  memo: dict[str, tuple[int, int]] = {}

  def count(comp: str) -> tuple[int, int]:
    if comp in memo:
      return memo[comp]
    memo[comp] = (0, 0)  # no recursion in HLO; guards a malformed text
    kernels = unknown = 0
    for line in comps.get(comp, []):
      op = _OPCODE.search(line)
      if not op or op.group(1) in _FREE:
        continue
      opcode = op.group(1)
      if opcode == "while":
        known = _TRIPS.search(line)
        trips = int(known.group(1)) if known else 1
        unknown += 0 if known else 1
        body_k, body_u = count(_BODY.search(line).group(1))
        cond_k, cond_u = count(_CONDITION.search(line).group(1))
        kernels += trips * body_k + (trips + 1) * cond_k
        unknown += body_u + cond_u
      elif opcode == "call":
        callee = _callees(line)[0]
        if graphs_as_one and callee.startswith(COMMAND_BUFFER):
          kernels += 1
        else:
          k, u = count(callee)
          kernels, unknown = kernels + k, unknown + u
      elif opcode == "conditional":
        branches = [count(c) for c in _callees(line)]
        k, u = max(branches, default=(0, 0))
        kernels, unknown = kernels + 1 + k, unknown + u
      else:
        kernels += 1
    memo[comp] = (kernels, unknown)
    return memo[comp]

  kernels, unknown = count(name)
  return {"kernels": kernels, "unknown_trips": unknown}


def command_buffers(hlo_text: str, body: str | None = None) -> dict:
  """What of a compiled program XLA:GPU records in command buffers (CUDA graphs;
  none on other backends, nor where XLA forms them from thunks rather than in
  the HLO).

  Returns:
    `command_buffers` (calls of command-buffer computations), `kernels_in_command_buffers`
    (one run of each, summed), `command_buffer_ops` (their five most frequent
    opcodes), and with `body` (a while loop's body): `loop_in_command_buffer`
    (the loop itself is recorded: one graph launch for all its trips) and
    `body_launches` (what the host launches per trip: 0 when the loop is
    recorded, else its kernels with each command buffer counted once).
  """
  comps = computations(hlo_text)
  ops: collections.Counter = collections.Counter()
  calls = kernels = 0
  holder = None
  for comp, lines in comps.items():
    for line in lines:
      op = _OPCODE.search(line)
      if not op:
        continue
      if op.group(1) == "call" and _callees(line)[0].startswith(COMMAND_BUFFER):
        callee = _callees(line)[0]
        calls += 1
        kernels += launches(hlo_text, callee)["kernels"]
        for inner in comps.get(callee, []):
          inner_op = _OPCODE.search(inner)
          if inner_op and inner_op.group(1) not in _FREE:
            ops[inner_op.group(1)] += 1
      if body is not None and op.group(1) == "while" and _BODY.search(line).group(1) == body:
        holder = comp
  out = {
    "command_buffers": calls,
    "kernels_in_command_buffers": kernels,
    "command_buffer_ops": dict(ops.most_common(5)),
  }
  if body is not None:
    recorded = holder is not None and holder.startswith(COMMAND_BUFFER)
    out["loop_in_command_buffer"] = recorded
    per_trip = 0 if recorded else launches(hlo_text, body, graphs_as_one=True)["kernels"]
    out["body_launches"] = per_trip
  return out


# Collective opcodes (an async pair counts once, at its start).
COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-broadcast",
)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


class Collective(NamedTuple):
  """One collective a program runs per call (`collectives`).

  Attributes:
    opcode: one of `COLLECTIVES`.
    times: how often one call runs it (loop trip counts multiplied; each branch
      of a conditional counts as if taken: an upper bound).
    shape, bytes: the array it exchanges (the result; a reduce-scatter's operand,
      the whole before scattering), bytes per run.
    group: devices per group it runs over.
    link_bytes: bytes each device sends per run, as bandwidth-optimal (ring)
      algorithms do: all-reduce 2 (g - 1) / g of the array, all-gather,
      reduce-scatter and all-to-all (g - 1) / g, a permute all of it.
  """

  opcode: str
  times: int
  shape: str
  bytes: int
  group: int
  link_bytes: float


def _group_size(line: str, num_devices: int) -> int:
  """Devices per replica group: from `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (the
  product of the named axes), `[groups,size]<=[n]` or `{{0,1,...},...}`."""
  mesh = _GROUPS_MESH.search(line)
  if mesh:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
    axes = re.findall(r"'(\w+)'", mesh.group(2))
    return math.prod(int(sizes[a]) for a in axes)
  iota = _GROUPS_IOTA.search(line)
  if iota:
    return int(iota.group(2))
  listed = _GROUPS_LIST.search(line)
  if listed and listed.group(1):
    return len(listed.group(1).split(","))
  return num_devices  # no groups: all devices


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
  """How often one call of the program runs each computation it reaches through
  while loops (body: the known trip count; unknown: 1), conditionals and calls."""
  times = {entry: 1}
  stack = [entry]
  while stack:
    comp = stack.pop()
    for line in comps.get(comp, []):
      op = _OPCODE.search(line)
      if not op or op.group(1) not in ("while", "conditional", "call"):
        continue
      trips = _TRIPS.search(line)
      body = set(_BODY.findall(line))
      for group in _RUNS.findall(line):
        for name in (n.strip().lstrip("%") for n in group.strip("{}").split(",")):
          if name in comps and name not in times:
            times[name] = times[comp] * (int(trips.group(1)) if trips and name in body else 1)
            stack.append(name)
  return times


def collectives(compiled_text: str, num_devices: int) -> list[Collective]:
  """The collectives one call of a compiled SPMD program runs between its
  `num_devices` devices, with the bytes each moves (`Collective`).

  Read from `jax.jit(f).lower(...).compile().as_text()` of a program on a mesh;
  a program on one device has none."""
  comps = computations(compiled_text)
  entry = _ENTRY.search(compiled_text)
  if entry is None:
    return []
  out = []
  for comp, times in _multiplicities(comps, entry.group(1)).items():
    for line in comps[comp]:
      op = _OPCODE.search(line)
      if not op:
        continue
      opcode = op.group(1).removesuffix("-start")
      if opcode not in COLLECTIVES:
        continue
      shapes = _output_shapes(line)
      if op.group(1).endswith("-start") and len(shapes) > 1:
        shapes = shapes[len(shapes) // 2 :]  # (operands, results) of an async start
      size = sum(_array_bytes(s) for s in shapes)
      g = _group_size(line, num_devices)
      if opcode == "reduce-scatter":
        size *= g
      share = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(opcode, (g - 1) / g)
      out.append(Collective(opcode, times, ",".join(shapes), size, g, share * size))
  return out


def collective_summary(ops: list[Collective]) -> dict[str, dict[str, float]]:
  """Per opcode: runs per call and bytes per call (`bytes` exchanged arrays,
  `link_bytes` sent by each device), summed over `collectives`' list."""
  summary: dict[str, dict[str, float]] = {}
  for op in ops:
    s = summary.setdefault(op.opcode, {"count": 0, "bytes": 0, "link_bytes": 0.0})
    s["count"] += op.times
    s["bytes"] += op.times * op.bytes
    s["link_bytes"] += op.times * op.link_bytes
  return summary

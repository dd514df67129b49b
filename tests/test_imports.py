"""The import graph: no module imports, at any depth of its code, a module that
imports it back (imports inside functions count: they hide a cycle, not remove it)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
  """Dotted name -> file for every module of `package` under `root`."""
  names = {}
  for path in sorted((root / package).rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    names[".".join(parts)] = path
  return names


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """module -> the modules of `package` it imports anywhere in its code.

  `from a.b import c` imports `a.b.c` when that is a module, else `a.b`; relative
  imports are resolved against the importing module's package."""
  names = module_names(root, package)

  def known(name: str) -> str | None:
    while name and name not in names:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for module, path in names.items():
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets.update(known(alias.name) for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = here.split(".")[: len(here.split(".")) - node.level + 1]
          base = ".".join([*up, base] if base else up)
        for alias in node.names:
          full = f"{base}.{alias.name}"
          targets.add(full if full in names else known(base))
    graph[module] = {t for t in targets if t is not None and t != module}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_specjax_has_no_import_cycle():
  assert cycles(import_graph(ROOT, "specjax")) == []


def test_a_cycle_hidden_in_a_function_body_is_found(tmp_path):
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("")
  (package / "a.py").write_text("from pkg.sub import b\n")
  (package / "sub" / "b.py").write_text("def f():\n  from .. import c\n")
  (package / "c.py").write_text("import pkg.a\n")
  (package / "d.py").write_text("from pkg import c\n")  # imports into the cycle, not part of it
  assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub.b"]]

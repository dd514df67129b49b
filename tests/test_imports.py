"""The import graph: no module imports, at any depth of its code, a module that
imports it back (imports inside functions count: they hide a cycle, not remove it);
the head kinds sit below training and the Hugging Face package, and reach into no
other package's private names."""

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


def _base(module: str, here: str, node: ast.ImportFrom) -> str:
  """The module `node` imports from, its relative levels resolved against `here`."""
  base = node.module or ""
  if node.level:
    up = here.split(".")[: len(here.split(".")) - node.level + 1]
    base = ".".join([*up, base] if base else up)
  return base


def _inside(name: str, package: str) -> bool:
  return name == package or name.startswith(package + ".")


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(root: pathlib.Path, package: str) -> list[tuple[str, str]]:
  """`(module, dotted name)` for each private name (a leading underscore, dunders
  aside) of a module outside `package` that a module of `package` imports or reads:
  `from a import _b`, or `from a import b` then `b._c` for a module `a.b` (anywhere in
  its code). A class's private method named through the class (an override calling
  the one it overrides) is the class's business, not counted. Aliases are per module,
  not per scope."""
  found, names = [], module_names(root, package.split(".")[0])
  for module, path in names.items():
    if not _inside(module, package):
      continue
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}  # a name bound by an import -> the dotted module or name it is
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          if alias.asname:
            aliases[alias.asname] = alias.name
          else:
            aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
      elif isinstance(node, ast.ImportFrom):
        base = _base(module, here, node)
        for alias in node.names:
          full = f"{base}.{alias.name}"
          if _private(alias.name) and not _inside(base, package):
            found.append((module, full))
          aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Attribute) and _private(node.attr)):
        continue
      parts, value = [node.attr], node.value
      while isinstance(value, ast.Attribute):
        parts.insert(0, value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id in aliases:
        owner = ".".join([aliases[value.id], *parts[:-1]])
        if owner in names and not _inside(owner, package):
          found.append((module, f"{owner}.{node.attr}"))
  return sorted(set(found))


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


def test_head_kinds_import_neither_training_nor_hf():
  """`specjax.heads` is below `specjax.training` and `specjax.hf` (both import the
  kinds); what the kinds share with them lives lower (`specjax.losses`,
  `specjax.models.hub_names`, `specjax.models.hub_config`)."""
  graph = import_graph(ROOT, "specjax")
  above = ("specjax.training", "specjax.hf")
  wrong = {
    module: sorted(t for t in targets if any(_inside(t, p) for p in above))
    for module, targets in graph.items()
    if _inside(module, "specjax.heads")
  }
  assert {m: t for m, t in wrong.items() if t} == {}


def test_head_kinds_use_no_other_packages_private_names():
  assert private_reaches(ROOT, "specjax.heads") == []


def test_private_reaches_are_found(tmp_path):
  package = tmp_path / "pkg"
  (package / "low").mkdir(parents=True)
  (package / "kinds").mkdir()
  for folder in (package, package / "low", package / "kinds"):
    (folder / "__init__.py").write_text("")
  (package / "low" / "names.py").write_text("def _same(x):\n  return x\n")
  (package / "low" / "base.py").write_text("class Base:\n  def _hook(self):\n    pass\n")
  (package / "kinds" / "own.py").write_text("def _mine():\n  pass\n")
  (package / "kinds" / "a.py").write_text(
    "from pkg.low import names\nfrom pkg.kinds import own\n"
    "def f():\n  from pkg.low.names import _same\n  return names._same, own._mine, _same\n"
  )
  (package / "kinds" / "b.py").write_text(
    "import pkg.low.names\nfrom pkg.low.base import Base\n"
    "x = pkg.low.names._same\nclass Mine(Base):\n  def _hook(self):\n    return Base._hook(self)\n"
  )
  assert private_reaches(tmp_path, "pkg.kinds") == [
    ("pkg.kinds.a", "pkg.low.names._same"),
    ("pkg.kinds.b", "pkg.low.names._same"),
  ]

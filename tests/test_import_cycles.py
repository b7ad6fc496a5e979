"""No import cycles in ``jax_dora/``: a static walk of every import.

Counts every ``import`` of a project module, at module level, inside a
function or under ``if TYPE_CHECKING`` (a lazy or typing-only import that
closes a loop is still a loop a reader has to untangle). The last two cycles
were cut by issue 24: the mode strategies drive the orchestrator through the
``ModeHost`` protocol, and reward workers import ``rewards.builtin`` instead
of their own package.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for f in (ROOT / "jax_dora").rglob("*.py"):
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = f
  return mods


def import_graph() -> dict[str, set[str]]:
  mods = _modules()

  def resolve(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph: dict[str, set[str]] = {m: set() for m in mods}
  for mod, path in mods.items():
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      targets: list[str] = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          pkg = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(pkg + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
      for t in targets:
        if t.startswith("jax_dora"):
          r = resolve(t)
          if r and r != mod:
            graph[mod].add(r)
  return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  out: set[tuple[str, ...]] = set()

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
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.add(tuple(sorted(comp)))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_walker_finds_a_cycle_it_is_shown():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
  assert cycles({"a": {"b"}, "b": set()}) == set()


def test_no_import_cycles_beyond_the_known_ones():
  graph = import_graph()
  assert "jax_dora.config" in graph and "jax_dora.csv_fields" in graph["jax_dora.data.pipeline"]
  assert cycles(graph) == KNOWN_CYCLES

"""The packages' imports point one way: pallas_kernels <- coat_jax, and no
module imports (directly or through others) a module that imports it back.
A submodule's implicit import of its own package is not counted."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('coat_jax', 'pallas_kernels')


def _modules() -> dict[str, str]:
  modules = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if name.endswith('.py'):
          path = os.path.join(folder, name)
          module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
          modules[module.removesuffix('.__init__')] = path
  return modules


def _graph() -> dict[str, set[str]]:
  """module -> the project's modules it imports (anywhere in its code)."""
  modules = _modules()
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        subs = [f'{node.module}.{a.name}' for a in node.names
                if f'{node.module}.{a.name}' in modules]
        names = subs if len(subs) == len(node.names) else [node.module]
      else:
        continue
      graph[module] |= {n for n in names if n in modules and n != module
                        and not f'{module}.'.startswith(f'{n}.')}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
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
        cycles.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return cycles


def test_no_import_circles():
  assert _cycles(_graph()) == []


def test_the_checker_finds_a_circle():
  assert _cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [
      ['a', 'b', 'c']]


def test_kernels_do_not_import_the_library():
  graph = _graph()
  assert not [(m, n) for m, deps in graph.items() if m.startswith(
      'pallas_kernels') for n in deps if n.startswith('coat_jax')]

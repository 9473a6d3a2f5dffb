"""The package's shape, checked from its source: no import cycle between modules or
between packages, no function over ~100 lines, no file over ~450 (docs/design.md)."""

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "arl_jax")
MAX_FUNCTION_LINES, MAX_FILE_LINES = 100, 450


def _modules() -> dict[str, str]:
  """`{dotted module name: path}` of every module of the package."""
  modules = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        modules[dotted.removesuffix(".__init__")] = path
  return modules


def _imports(path: str, module: str, modules) -> set[str]:
  """The package's modules `path` imports, at any depth of its code (an import
  inside a function is still a dependency)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the module's package
        parts = module.split(".")[:-node.level] if not path.endswith("__init__.py") else \
            module.split(".")[:len(module.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      names = [f"{base}.{alias.name}" for alias in node.names] + [base]
    else:
      continue
    for name in names:
      while name and name not in modules:  # `from pkg import symbol` -> pkg
        name = name.rpartition(".")[0]
      if name and name != module:
        found.add(name)
  return found


def _graph(nodes_of) -> dict[str, set[str]]:
  modules = _modules()
  graph = collections.defaultdict(set)
  for module, path in modules.items():
    for target in _imports(path, module, modules):
      a, b = nodes_of(module), nodes_of(target)
      if a != b:
        graph[a].add(b)
  return graph


def _cycles(graph) -> list[list[str]]:
  """The strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
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


def _package_of(module: str) -> str:
  """A module's package (`arl_jax.sampler.engine` -> `arl_jax.sampler`); the
  top-level modules are each their own node."""
  parts = module.split(".")
  if len(parts) >= 2 and os.path.isdir(os.path.join(ROOT, *parts[:2])):
    return ".".join(parts[:2])  # (a subpackage belongs to its top package)
  return module


def test_no_import_cycle_between_modules():
  assert _cycles(_graph(lambda m: m)) == []


def test_no_import_cycle_between_packages():
  assert _cycles(_graph(_package_of)) == []


def test_no_function_over_a_hundred_lines_and_no_file_over_450():
  long_functions, long_files = [], []
  for module, path in _modules().items():
    source = open(path, encoding="utf-8").read()
    if source.count("\n") > MAX_FILE_LINES:
      long_files.append(f"{module}: {source.count(chr(10))} lines")
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          long_functions.append(f"{module}.{node.name}: {length} lines")
  assert long_functions == [] and long_files == []


# Each package's layer (its `__init__` docstring says the same): a module may
# import its own package and the packages of lower layers, never a peer of its
# own layer or one above. The commands and the API are the top-level modules.
LAYERS = {
    "arl_jax.core": 0, "arl_jax.sandbox": 0,
    "arl_jax.sharding": 1, "arl_jax.envs": 1, "arl_jax.metrics": 1,
    "arl_jax.models": 2,
    "arl_jax.sampler": 3, "arl_jax.orchestrator": 3, "arl_jax.learner": 3,
    "arl_jax.judges": 3,
    "arl_jax.distributed": 4, "arl_jax.gateway": 4,
    "arl_jax.config": 5,
    "arl_jax.training": 6,
    "arl_jax": 7, "arl_jax.launch": 7, "arl_jax.plot": 7, "arl_jax.diff": 7, "arl_jax.export_hf": 7,
    "arl_jax.serve": 7,
    "arl_jax._moved": 7,
    "arl_jax.testing": 8,
}


def test_every_import_points_down_the_layers():
  graph = _graph(_package_of)
  assert set(graph) | {b for targets in graph.values() for b in targets} <= set(LAYERS), (
      "a package or top-level module without a layer: add it to LAYERS and say so in its "
      "__init__ docstring")
  upward = sorted(f"{a} (layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]})"
                  for a, targets in graph.items() for b in targets if LAYERS[b] >= LAYERS[a]
                  and not (a == "arl_jax" and b == "arl_jax._moved"))
  assert upward == []


def test_the_top_level_holds_the_commands_and_the_api_only():
  top = sorted(name for name in os.listdir(PACKAGE) if name.endswith(".py"))
  assert top == ["__init__.py", "_moved.py", "diff.py", "export_hf.py", "launch.py", "plot.py",
                 "serve.py"]

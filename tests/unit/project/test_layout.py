"""The package's layout, checked: its layers import only downwards, no modules import each other
in a circle, and no module or function outgrows what a reader can hold.

Every import is read from the source, also the ones inside functions (an import moved into a
function still couples the two modules; it only hides the circle from Python). The layer order
below is the one place it is written; docs/architecture.md explains it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "ds_omni"

# Bottom first. A module may import its own layer and the layers below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "batch"),  # the contract data/ and model/ share; torch only
    ("config",),  # the typed config and its strict file loader
    ("parallel",),  # the plan and its derived facts, pure planners, thin collectives
    ("data",),  # sources -> balanced, packed micro-batches; never imports model/
    ("model",),  # OmniModel (representation only) and the HF family adapters
    ("parallelize",),  # applies a plan to a built model
    ("train",),  # the composition root, the step, the loop, checkpoints, supervision
    ("sim", "coverage"),  # tools built on the layers below
    ("cli", "__main__"),  # entry points
)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_FIELD_DOC_LINES = 2  # a field's docstring; the long explanation lives in docs/
MAX_MODULE_DOC_LINES = 15  # what a module is for and what it is not; the why lives in docs/


def _modules() -> dict[str, Path]:
    """Dotted name -> path of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement of `module` names (a name imported from a
    package counts as its submodule when there is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                 for alias in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("ds_omni") and name != module:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {t for node in ast.walk(tree)
                         if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in _targets(module, node)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    """The layer index of a package module (the package's own __init__ counts as an entry point)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__main__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its top-level name '{top}' is in no layer of LAYERS "
                         f"(tests/unit/project/test_layout.py); add it to the layer it belongs to")


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "modules that import each other in a circle (break it by moving what both " \
        "need below both):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_upward_imports():
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                    for m, targets in import_graph().items() for t in targets
                    if layer_of(t) > layer_of(m))
    assert not upward, "imports that run up a layer (LAYERS in tests/unit/project/test_layout.py):\n" + \
        "\n".join(upward)


def test_modules_and_functions_are_short():
    long_modules = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in MODULES.values()
                    if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    long_functions = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                                          f"{node.name}: {n} lines")
    assert not long_modules + long_functions, (
        f"over {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function (split by what "
        "each part is):\n" + "\n".join(long_modules + long_functions))


def test_module_docstrings_are_short():
    long_docs = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in MODULES.values()
                 if (doc := ast.get_docstring(ast.parse(p.read_text()), clean=False))
                 and (n := len(doc.strip("\n").splitlines())) > MAX_MODULE_DOC_LINES]
    assert not long_docs, (f"module docstrings over {MAX_MODULE_DOC_LINES} lines (say what the "
                           "module is for; move the explanation to docs/ and name where):\n"
                           + "\n".join(long_docs))


def long_field_docs(paths) -> list[str]:
    """Dataclass fields of `paths` whose docstring (the string right after the field) has more
    than MAX_FIELD_DOC_LINES lines."""
    found = []
    for path in paths:
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for field, after in zip(cls.body, cls.body[1:]):
                if isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr) \
                        and isinstance(after.value, ast.Constant) \
                        and isinstance(after.value.value, str) \
                        and len(after.value.value.strip().splitlines()) > MAX_FIELD_DOC_LINES:
                    found.append(f"{path.name}:{field.lineno} {cls.name}.{ast.unparse(field.target)}")
    return found


def test_field_docstrings_are_short():
    """A field (of a config or any other class of the package) says what it is, its unit and its
    default's meaning in two lines; docs/ says more (config.md links its section:
    `docs/page.md#heading-start` in the docstring)."""
    long_docs = long_field_docs(sorted(PACKAGE.rglob("*.py")))
    assert not long_docs, (f"field docstrings over {MAX_FIELD_DOC_LINES} lines (move the "
                           "explanation to docs/ and name its section):\n" + "\n".join(long_docs))


# ------------------------------------------------------------------ the checker's own checks
def test_field_doc_reader_sees_a_long_docstring(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("class A:\n    x: int = 0\n    \"\"\"One.\n    Two.\n    Three.\"\"\"\n"
                      "    y: int = 0\n    \"\"\"One.\"\"\"\n")
    assert long_field_docs([module]) == ["m.py:2 A.x"]



def test_circle_finder_sees_a_hidden_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_import_reader_sees_function_local_and_relative_imports(tmp_path):
    source = ("def f():\n    from ds_omni.model import omni\n"
              "from .. import errors\nfrom ds_omni.parallel.plan import ParallelPlan\n")
    tree = ast.parse(source)
    module = "ds_omni.data.loader"
    found = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _targets(module, node)}
    assert found == {"ds_omni.model.omni", "ds_omni.errors", "ds_omni.parallel.plan"}


def test_every_top_level_name_has_a_layer():
    for module in MODULES:
        layer_of(module)  # raises, naming the module, when its top-level name has no layer
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("ds_omni.nowhere.x")


def test_every_import_of_the_package_resolves():
    """A moved name breaks its importers; those inside functions (most of benchmarks/ and tests/
    import lazily) would only break when run. Every `from ds_omni.x import y` anywhere in the
    repository names a module that exists and a name it has."""
    import importlib
    root = PACKAGE.parent
    broken = []
    for path in sorted(p for d in ("ds_omni", "tests", "benchmarks", "examples")
                       for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and \
                    (node.module or "").startswith("ds_omni"):
                try:
                    module = importlib.import_module(node.module)
                except ModuleNotFoundError:
                    broken.append(f"{path.relative_to(root)}:{node.lineno} {node.module}")
                    continue
                broken += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{a.name}"
                           for a in node.names if not hasattr(module, a.name) and
                           importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            elif isinstance(node, ast.Import):
                broken += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names
                           if a.name.startswith("ds_omni") and
                           importlib.util.find_spec(a.name) is None]
    assert not broken, "imports of names that do not exist:\n" + "\n".join(broken)


def test_the_project_stands_on_its_own_files():
    """Nothing shipped points outside the repository (the design notes a checkout sits next to
    are not part of it: docs/ says what a reader needs)."""
    root = PACKAGE.parent
    outside = "../" + "shared"
    files = [root / "README.md", root / "BENCHMARKS.md", root / "Makefile", root / "pyproject.toml"]
    files += [p for d in ("ds_omni", "docs", "tests", "benchmarks", "examples", "launch")
              for p in (root / d).rglob("*") if p.suffix in (".py", ".md", ".json", ".sh")]
    found = [str(p.relative_to(root)) for p in files if p.exists() and outside in p.read_text()]
    assert not found, f"files that reference {outside}: {found}"

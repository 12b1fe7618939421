"""No import cycle in vit/ or bench/, counting imports inside functions: a function-level import
only hides a cycle until the day someone moves it to the top of the file."""

import ast
from pathlib import Path

from helpers import ROOT

PACKAGES = ("vit", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, here: str, is_package: bool, modules: set[str]) -> list[str]:
    """The project modules one import statement loads (a name taken from a package counts as the
    package, a submodule taken from it as the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the package that holds `here`
        package = here.split(".") if is_package else here.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    if base not in modules:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def edges(source: str, here: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules a module's source imports, anywhere in it (top level, functions,
    classes)."""
    return {
        m for node in ast.walk(ast.parse(source)) for m in imported(node, here, is_package, modules)
    } - {here}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {
        name: edges(path.read_text(), name, path.name == "__init__.py", set(files))
        for name, path in files.items()
    }


def knots(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each holds a
    cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component, w = set(), None
            while w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, set[str]], component: set[str]) -> str:
    """A shortest cycle through the component's first module, and the component's other modules."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & component):
            if w == start:
                others = sorted(component - set(path))
                return " -> ".join(path + [start]) + (
                    f" (one knot with {', '.join(others)})" if others else ""
                )
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"{component} is not strongly connected")


def test_the_graph_sees_imports_inside_functions():
    source = (
        "import os\nimport vit.errors\nfrom vit import data, hetero\nfrom vit.hetero import "
        "Adapted\n"
        "def f():\n    from vit.hetero.census import DTYPES\n    from . import model\n"
        "class C:\n    def g(self):\n        from .hetero import stages\n"
    )
    modules = {
        "vit",
        "vit.errors",
        "vit.data",
        "vit.hetero",
        "vit.hetero.census",
        "vit.hetero.stages",
        "vit.model",
        "vit.train",
    }
    assert edges(source, "vit.train", False, modules) == {
        "vit.errors",
        "vit.data",
        "vit.hetero",
        "vit.hetero.census",
        "vit.model",
        "vit.hetero.stages",
    }
    assert edges("from .census import DTYPES\n", "vit.hetero", True, modules) == {
        "vit.hetero.census"
    }
    graph = import_graph()
    assert {"vit.engines", "vit.freeze.activation_cache"} <= graph["vit.trainer"]
    assert "vit.run.cli" in graph["vit.train"]
    assert "bench.common" in graph["bench.train"]


def test_cycle_finder_names_the_modules_of_a_cycle():
    graph = {
        "a": {"b", "x"},
        "b": {"c"},
        "c": {"a", "d"},
        "d": set(),
        "x": {"c"},
        "e": {"f"},
        "f": {"e"},
    }
    assert knots(graph) == [{"a", "b", "c", "x"}, {"e", "f"}]
    assert [describe(graph, k) for k in knots(graph)] == [
        "a -> b -> c -> a (one knot with x)",
        "e -> f -> e",
    ]
    assert knots({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    found = knots(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, k) for k in found)


# The packages of vit/, bottom first: each may import only itself and the packages before it
# (docs/architecture.md keeps the same table, with what each holds). bench/ and plot_logs.py sit
# outside the library and may import any.
LAYERS = (
    "core",
    "runtime",
    "data",
    "model",
    "telemetry",
    "training",
    "checkpoints",
    "engines",
    "planner",
    "freeze",
    "reports",
    "run",
    "trainer",
    "train",
)


def layer_of(module: str) -> str:
    """'vit.planner.census' -> 'planner', 'vit.train' -> 'train', 'vit' -> '' (the package's own
    __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Each import of vit/ that goes up the table (or names a package the table lacks), as 'a -> b
    (why)'."""
    rank = {name: i for i, name in enumerate(layers)}
    found = []
    for a in sorted(m for m in graph if m.startswith("vit")):
        for b in sorted(m for m in graph[a] if m.startswith("vit")):
            la, lb = layer_of(a), layer_of(b)
            missing = [x for x in (la, lb) if x and x not in rank]
            if missing:
                found.append(f"{a} -> {b} (package {missing[0]} is not in the table)")
            elif la and lb and rank[lb] > rank[la]:
                found.append(f"{a} -> {b} ({lb} is above {la})")
    return found


def test_the_layer_check_sees_an_import_that_goes_up():
    graph = {
        "vit.core.a": {"vit.runtime.b"},
        "vit.runtime.b": {"vit.core.a"},
        "vit.train": {"vit.training.c"},
        "vit.training.c": set(),
        "vit.x.d": {"vit.core.a"},
        "vit": set(),
    }
    assert upward_imports(graph) == [
        "vit.core.a -> vit.runtime.b (runtime is above core)",
        "vit.x.d -> vit.core.a (package x is not in the table)",
    ]


def test_every_package_imports_only_the_packages_below_it():
    graph = import_graph()
    packages = {layer_of(m) for m in graph if m.startswith("vit.")}
    assert packages == set(LAYERS), (
        f"packages not in the table, or table rows with no package: {packages ^ set(LAYERS)}"
    )
    found = upward_imports(graph)
    assert not found, "imports that go up the package table (docs/architecture.md):\n" + "\n".join(
        found
    )


def test_the_architecture_page_lists_the_same_table():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = [
        line.split("|")[2].strip().strip("`").removeprefix("vit/").rstrip("/").removesuffix(".py")
        for line in page.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert tuple(rows) == LAYERS, rows

"""No package of the workspace has an import cycle.

Every module under every ``packages/*/src`` is parsed with :mod:`ast`; an import anywhere
in a module (at module level or inside a function) is an edge, except under
``if TYPE_CHECKING:``, which never runs. A cycle, even one that Python resolves because
one of its imports sits inside a function, means two modules each need the other: the
shared piece belongs in a third. The test names every cycle it finds.
"""

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src`` (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[tuple[str, ...]]:
    """What ``module`` imports, skipping ``if TYPE_CHECKING:`` bodies, relative imports
    resolved against ``module``: one tuple per imported name, the modules it may be, most
    specific first (``from a import b`` is ``a.b`` when that is a module, else ``a``)."""
    names: set[tuple[str, ...]] = set()
    package = module if is_package else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update((alias.name,) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update((f"{base}.{alias.name}", base) for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph(srcs: list[Path]) -> dict[str, set[str]]:
    """Module -> the workspace modules it imports (itself excluded)."""
    files = {}
    for src in srcs:
        files |= module_files(src)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = imported_names(tree, module, path.name == "__init__.py")
        found = {next((n for n in candidates if n in files), None) for candidates in names}
        graph[module] = found - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules (Tarjan)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_in(graph, group) for group in groups]


def cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is strongly connected but has no cycle")


def test_no_import_cycles_in_any_package():
    srcs = sorted(PACKAGES.glob("*/src"))
    assert len(srcs) >= 6, f"expected the workspace's packages under {PACKAGES}"
    found = cycles(import_graph(srcs))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_function_level_import_closes_a_cycle(tmp_path):
    src = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import f\n",
            "pkg/b.py": "def f():\n    from pkg import a\n",
        },
    )
    assert cycles(import_graph([src])) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_relative_and_type_checking_imports(tmp_path):
    src = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from .c import g\n",
            "pkg/sub/c.py": "from ..d import h\n",
            "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub\n",
        },
    )
    graph = import_graph([src])
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.d"}
    assert graph["pkg.d"] == set()  # the TYPE_CHECKING import does not count
    assert cycles(graph) == []
    (src / "pkg/d.py").write_text("import pkg.sub.c\n")
    assert cycles(import_graph([src])) == [["pkg.d", "pkg.sub.c", "pkg.d"]]


def test_from_a_package_import_a_submodule_is_an_edge_to_the_submodule(tmp_path):
    """``from pkg import b`` needs ``pkg.b``, not what ``pkg/__init__.py`` imports."""
    src = write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "from pkg import b\ndef f():\n    pass\n",
            "pkg/b.py": "X = 1\n",
        },
    )
    graph = import_graph([src])
    assert graph["pkg.a"] == {"pkg.b"}
    assert cycles(graph) == []
    (src / "pkg/b.py").write_text("from pkg import f\n")  # a name of pkg/__init__.py
    assert cycles(import_graph([src])) == [["pkg", "pkg.a", "pkg.b", "pkg"]]


@pytest.mark.parametrize("else_import", [True, False])
def test_the_else_of_type_checking_counts(tmp_path, else_import):
    body = "    import pkg.b\n" if else_import else "    pass\n"
    src = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n" + body,
            "pkg/b.py": "import pkg.a\n",
        },
    )
    assert bool(cycles(import_graph([src]))) is else_import

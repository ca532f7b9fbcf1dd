"""No import cycles in `pagedllm`: between modules, or between packages (engine, worker,
spec_decode, ...; a top-level module such as config or sampling_params counts as its own).

Every `import` counts, at the top of a module or inside a function (a late import is still a
dependency); only `if TYPE_CHECKING:` blocks, which never run, do not. The package facade
`pagedllm/__init__.py` is left out of the package graph: every module imports through it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pagedllm modules `name` imports (a `from package import name` may name a module)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module in known and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def package_of(module: str) -> str:
    """pagedllm.engine.scheduler -> pagedllm.engine; pagedllm.config.model -> pagedllm.config."""
    return ".".join(module.split(".")[:2])


def module_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_no_module_imports_itself_back():
    assert cycles(module_graph()) == []


def test_no_package_imports_itself_back():
    graph: dict[str, set[str]] = {}
    edges: dict[tuple[str, str], str] = {}
    for name, targets in module_graph().items():
        if name == "pagedllm":
            continue
        for target in targets:
            source, sink = package_of(name), package_of(target)
            if source != sink:
                graph.setdefault(source, set()).add(sink)
                edges.setdefault((source, sink), f"{name} -> {target}")
    found = cycles(graph)
    assert not found, [(cycle, [edge for (a, b), edge in edges.items() if a in cycle and b in cycle]) for cycle in found]


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

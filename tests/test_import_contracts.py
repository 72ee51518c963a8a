"""The layers hold (import-linter, configured in pyproject): cli > demo > api | client > engine > codec | transport > proto, the generated protocol code (kvferry.proto) imports nothing else of kvferry, the client SDK imports no server code, no production module imports kvferry.testing, and the transport base imports no backend (backends import only the base)."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_layers_contract():
    lint = str(Path(sysconfig.get_path("scripts")) / "lint-imports")
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def test_no_import_cycle_inside_the_package():
    """No module of kvferry imports, directly or not, one that imports it back (imports made
    inside functions count; those only for type checking do not run and do not)."""
    import grimp

    graph = grimp.build_graph("kvferry", exclude_type_checking_imports=True)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("kvferry")}
             for m in graph.modules}
    cycles = [sorted(c) for c in _strongly_connected(edges) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in _strongly_connected(edges) if len(c) > 1] == [["a", "b", "c"]]


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                found.append(component)
    return found

"""The `length` package's imports point one way (no cycles), checked on the source itself:
every import statement (module level or inside a function) between its modules forms a
graph, and that graph must have no cycle."""

import ast
from pathlib import Path

import rps_astro_cli.length as length_pkg

PKG = "rps_astro_cli.length"
ROOT = Path(length_pkg.__file__).parent


def import_graph() -> dict[str, set[str]]:
    mods = {PKG if p.stem == "__init__" else f"{PKG}.{p.stem}": p for p in ROOT.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return []

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_find_cycle_sees_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_length_package_has_no_import_cycle():
    graph = import_graph()
    assert f"{PKG}.store" in graph[f"{PKG}.pipeline"]  # the scan does see imports
    assert find_cycle(graph) == []


def test_base_and_models_do_not_import_the_store():
    graph = import_graph()
    for low in ("base", "classic", "baselines", "transformer", "data", "prompts", "dist"):
        assert not graph[f"{PKG}.{low}"] & {PKG, f"{PKG}.store", f"{PKG}.pipeline", f"{PKG}.evaluate"}, low

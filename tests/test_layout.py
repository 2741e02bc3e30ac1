"""The tree's promises, checked from the source: the product never imports the lab, the
product package has no import cycle, and the embedder interface imports no implementation."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[1] / "service"
PLPYTHON = Path(__file__).resolve().parents[1] / "plpython"


def _module_name(path: Path) -> str:
    root = PLPYTHON if path.is_relative_to(PLPYTHON) else SERVICE
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every module of ours this file imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when that is a module of ours.
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known or n.split(".")[0] == "poimen_lab")
    return out


def _graph(package: str) -> dict[str, set[str]]:
    root = PLPYTHON if package == "poimen_core" else SERVICE
    files = {_module_name(p): p for p in (root / package).rglob("*.py")}
    known = set(files)
    return {name: _imports(path, known) - {name} for name, path in files.items()}


def test_relative_imports_are_not_used() -> None:
    # The checks below read absolute imports only; keep it that way.
    for path in (SERVICE / "poimen_memory").rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)), (
            f"{path} uses a relative import"
        )


def test_the_product_never_imports_the_lab() -> None:
    graph = _graph("poimen_memory")
    offenders = {
        m: sorted(d) for m, d in graph.items() if any(x.startswith("poimen_lab") for x in d)
    }
    assert offenders == {}


@pytest.mark.parametrize(("package", "modules"), [("poimen_memory", 30), ("poimen_core", 8)])
def test_the_product_has_no_import_cycle(package: str, modules: int) -> None:
    graph = _graph(package)
    assert len(graph) > modules  # the walk really read the package
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_embedder_interface_imports_no_implementation() -> None:
    graph = _graph("poimen_memory")
    assert graph["poimen_memory.embedders.base"].isdisjoint(
        {"poimen_memory.embedders.local", "poimen_memory.embedders.remote"}
    )


def test_only_settings_reads_the_environment() -> None:
    """Settings are parsed once: no other product module reads a variable from os.environ
    (passing the environment through to a child process is not reading it)."""
    readers = []
    for path in (SERVICE / "poimen_memory").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.value if isinstance(node, ast.Subscript) else None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value if node.func.attr in ("get", "pop") else node.func
            if isinstance(target, ast.Attribute) and target.attr in ("environ", "getenv"):
                readers.append(_module_name(path))
    assert sorted(set(readers)) == ["poimen_memory.settings"]


def test_the_optimizer_routes_with_the_shared_words() -> None:
    """The optimizer's enums (what the text is routed to) name exactly the vocabulary's words,
    which migrate writes into SQL (memory.strategies(), memory.set_policy's checks)."""
    from poimen_core import vocabulary
    from poimen_core.optimizer import QuestionType, SearchStrategy

    assert tuple(SearchStrategy) == vocabulary.STRATEGIES
    assert tuple(QuestionType) == vocabulary.QUESTION_TYPES


def test_one_writer_inserts_nodes_and_edges() -> None:
    """memory._write_nodes (sql/068_write.sql) is the only product code that writes nodes
    and edges: the CLI, POST /memory/nodes and memory.add_nodes all batch into it. (The lab's
    bench loads synthetic corpora by COPY and INSERT, outside the product.)"""
    root = SERVICE.parent
    pattern = re.compile(r"\b(INSERT\s+INTO|COPY)\s+memory\.(nodes|edges)\b", re.IGNORECASE)
    files = [
        *(SERVICE / "poimen_memory").rglob("*.py"),
        *(SERVICE / "poimen_memory").rglob("*.sql"),
        *(PLPYTHON / "poimen_core").rglob("*.py"),
    ]
    writers = {
        (p.relative_to(root).as_posix(), m.group(2))
        for p in files
        for m in pattern.finditer(p.read_text())
    }
    write = "service/poimen_memory/sql/068_write.sql"
    assert writers == {(write, "nodes"), (write, "edges")}
